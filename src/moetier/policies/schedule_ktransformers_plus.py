"""KTransformers-style GPU + AMX CPU baseline (TriMoE paper 5.1), "ktransformers-plus": resident experts,
shared experts and the misses the load predictor calls hot (loaded on demand over PCIe) compute on the GPU,
every other routed expert on the CPU. Hot experts are prefetched into HBM in the background.

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on NDP; greedy = totals, no moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_tri_base import TriExpert, TriOutcome, domain_totals, tri_plan
from moetier.types import Domain


class KTransformersPlusScheduler:
    name = "ktransformers-plus"
    domains = frozenset((Domain.ACCEL, Domain.HOST))
    prefetches = True
    relayouts = False
    rebalances = False
    refines = False

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        gpu, cpu = Domain.ACCEL, Domain.HOST
        doms = [gpu if (e.resident or e.key.expert < 0 or e.key.expert in hot) else cpu for e in experts]
        t = domain_totals(experts, doms, n_dimms)
        return TriOutcome(tri_plan(experts, doms, t.makespan), t, t, 0)


__all__ = ["KTransformersPlusScheduler"]
