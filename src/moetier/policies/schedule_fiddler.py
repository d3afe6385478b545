"""Fiddler-style miss handling (the paper's II-C: "a miss computes on the CPU").

Our reading of Fiddler: the fast tier holds a static popularity placement (placement
"frequency", `admits` False: a moved expert is used for this call only and never admitted).
Each miss is decided on its own, ignoring queueing, by Fiddler's latency test: it computes on
the slow lane when `slow_s <= move_s + fast_s` (ties stay on the CPU: no link traffic), else it
is moved and computed on the fast lane. Cached experts compute on the fast lane (high load
first), CPU misses low load first, moved misses high load first. Without a slow domain every
miss is moved.

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready); with a slow domain a miss computes on `cpu` iff slow_s <= move_s + fast_s.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_base import ExpertWork, LayerScheduler, Plan, by_load, timeline


class FiddlerScheduler(LayerScheduler):
    name = "fiddler"
    admits = False
    placement = "frequency"
    cache_policy = "lfu"  # never consulted while admits is False

    def plan(self, work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
        hits = [i for i, w in enumerate(work) if w.cached]
        on_cpu = [
            i for i, w in enumerate(work) if not w.cached and w.slow_s is not None and w.slow_s <= w.move_s + w.fast_s
        ]
        cset = set(on_cpu)
        moved = [i for i, w in enumerate(work) if not w.cached and i not in cset]
        fast, slow = by_load(work, hits, True), by_load(work, on_cpu, False)
        return timeline(work, ready, fast, by_load(work, moved, True), slow)
