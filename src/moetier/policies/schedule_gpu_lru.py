"""GPU-only on-demand loading (mixtral-offloading / AdapMoE style, the paper's AdapMoE baseline).

Every expert computes on the fast domain. The fast lane first computes the cached experts
(high load first) while the link moves the misses back to back, high load first (the same
transfer priority as HybriMoE, so the two differ only in what the CPU does); each moved expert
then computes on the fast lane in arrival order, never before its move ends. The slow domain
is never used. Moved experts are admitted into the cache (`admits`), ranked by LRU by default.

`moved_timeline` is also what every other scheduler degrades to without a slow domain (a
CPU-only machine: the "link" is the disk and there is nowhere else to compute a miss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moetier.policies.schedule_base import ExpertWork, Lane, Schedule, by_load, check_work, lane_ready, timeline


def moved_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Schedule:
    """Cached experts on the fast lane (high load first), every miss moved (high load first) then computed there."""
    hits = by_load(work, [i for i, w in enumerate(work) if w.cached], descending=True)
    misses = by_load(work, [i for i, w in enumerate(work) if not w.cached], descending=True)
    return timeline(work, ready, hits, misses, ())


class GpuLruScheduler:
    name = "gpu-lru"
    admits = True
    placement = "frequency"
    cache_policy = "lru"

    def schedule(self, work: Sequence[ExpertWork], ready: Mapping[Lane, float] | None = None) -> Schedule:
        t0 = lane_ready(ready)
        check_work(work)
        return moved_timeline(work, t0)
