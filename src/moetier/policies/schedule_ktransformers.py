"""kTransformers-style static mapping (the paper's main baseline, VI-A3).

The fast tier holds a fixed placement of high-frequency experts (shared experts are always
there: they are `cached`). Each layer call computes the cached experts on the fast lane (high
load first) and every uncached expert on the slow lane (low load first); nothing crosses the
link and the placement never changes (`admits` False). Without a slow domain (a CPU-only
machine) a miss has nowhere else to go: it is moved for this call only (schedule_base.moved_timeline).

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready); with a slow domain nothing crosses the link.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_base import ExpertWork, LayerScheduler, Plan, by_load, timeline


def split_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
    """Cached experts on the fast lane (high load first), uncached on the slow lane (low load first)."""
    hits = by_load(work, [i for i, w in enumerate(work) if w.cached], descending=True)
    misses = by_load(work, [i for i, w in enumerate(work) if not w.cached], descending=False)
    return timeline(work, ready, hits, (), misses)


class KTransformersScheduler(LayerScheduler):
    name = "ktransformers"
    admits = False
    placement = "frequency"
    cache_policy = "lfu"  # Table I; never consulted while admits is False

    plan = staticmethod(split_timeline)
