"""The fast tier's state before the first call in the simulator: the scheduler's default cache
policy and its initial placement (policies/placement.py), warmed from the replayed calls.

The "warm-up window" a frequency placement is built from (the history a static mapping such as
kTransformers' is profiled from) is the trace's first SimConfig.warmup_steps decode steps, which
are then not replayed; with warmup_steps = 0 it is the replayed trace itself, an oracle that
favours the static mappings (benchmarks/hybrid_sim.py always uses a warm-up).

Invariants: at most `slots` keys, no duplicates, routed experts only; deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moetier.policies.placement import initial_placement
from moetier.policies.schedule_base import Scheduler
from moetier.specs import ModelSpec
from moetier.types import ExpertKey


def default_cache_policy(scheduler: Scheduler) -> str:
    return str(getattr(scheduler, "cache_policy", None) or "lru")


def initial_keys(
    scheduler: Scheduler, spec: ModelSpec, slots: int, calls: Sequence[tuple[int, Mapping[int, int]]]
) -> list[ExpertKey]:
    """Up to `slots` experts to warm the cache with. `calls`: (layer, {expert: tokens}) per call."""
    if slots <= 0:
        return []
    freq: dict[ExpertKey, int] = {}
    for layer, counts in calls:
        for e, n in counts.items():
            k = ExpertKey(layer, e)
            freq[k] = freq.get(k, 0) + n
    placement = str(getattr(scheduler, "placement", None) or "frequency")
    return initial_placement(placement, spec.moe_layers, spec.num_experts, slots, freq)
