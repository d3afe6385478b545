"""MoNDE-style GPU + NDP baseline (TriMoE paper 5.1), "monde": each expert to the cheaper of weight migration
(the GPU, eq. 1-2) and activation migration (NDP on its home DIMM, eq. 4): the greedy start of schedule_trimoe
over {GPU, NDP}, no refinement. Hot experts are prefetched into HBM; no relayout, no rebalancing: cold experts
stay on the DIMMs the offline layout put them on.

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on the CPU; no refinement moves.
"""

from __future__ import annotations

from moetier.policies.schedule_trimoe import TriMoEScheduler
from moetier.types import Domain


class MondeScheduler(TriMoEScheduler):
    name = "monde"
    domains = frozenset((Domain.ACCEL, Domain.NDP))
    relayouts = False
    rebalances = False
    refines = False  # the greedy start alone, whatever max_iters


__all__ = ["MondeScheduler"]
