"""kTransformers-style static mapping (the paper's main baseline, VI-A3).

The fast tier holds a fixed placement of high-frequency experts (shared experts are always
there: they are `cached`). Each layer call computes the cached experts on the fast lane (high
load first) and every uncached expert on the slow lane (low load first); nothing crosses the
link and the placement never changes (`admits` False). Without a slow domain (a CPU-only
machine) a miss has nowhere else to go: it is moved for this call only (gpu_lru.moved_timeline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moetier.policies.schedule_base import ExpertWork, Lane, Schedule, by_load, check_work, lane_ready, timeline
from moetier.policies.schedule_gpu_lru import moved_timeline


def split_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Schedule:
    """Cached experts on the fast lane (high load first), uncached on the slow lane (low load first)."""
    hits = by_load(work, [i for i, w in enumerate(work) if w.cached], descending=True)
    misses = by_load(work, [i for i, w in enumerate(work) if not w.cached], descending=False)
    return timeline(work, ready, hits, (), misses)


class KTransformersScheduler:
    name = "ktransformers"
    admits = False
    placement = "frequency"
    cache_policy = "lfu"  # Table I; never consulted while admits is False

    def schedule(self, work: Sequence[ExpertWork], ready: Mapping[Lane, float] | None = None) -> Schedule:
        t0 = lane_ready(ready)
        if not check_work(work):
            return moved_timeline(work, t0)
        return split_timeline(work, t0)
