"""GPU-only on-demand loading (mixtral-offloading / AdapMoE style, the paper's AdapMoE baseline).

Every expert computes on the fast domain. The fast lane first computes the cached experts
(high load first) while the link moves the misses back to back, high load first (the same
transfer priority as HybriMoE, so the two differ only in what the CPU does); each moved expert
then computes on the fast lane in arrival order, never before its move ends. The slow domain
is never used. Moved experts are admitted into the cache (`admits`), ranked by LRU by default.

`moved_timeline` (schedule_base.py, re-exported here) is also what every other scheduler degrades
to without a slow domain (a CPU-only machine: the "link" is the disk and there is nowhere else to
compute a miss).

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready); nothing ever runs on `cpu`.
"""

from __future__ import annotations

from moetier.policies.schedule_base import LayerScheduler, moved_timeline


class GpuLruScheduler(LayerScheduler):
    name = "gpu-lru"
    admits = True
    placement = "frequency"
    cache_policy = "lru"

    plan = staticmethod(moved_timeline)  # with or without a slow domain: every miss is moved


__all__ = ["GpuLruScheduler", "moved_timeline"]
