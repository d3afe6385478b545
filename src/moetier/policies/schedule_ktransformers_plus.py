"""Enhanced-KTransformers, the TriMoE paper's GPU + AMX CPU baseline (its 5.1.2), "ktransformers-plus".

What the papers say:
- TriMoE 5.1.2: "Enhanced Ktransformer [2]: GPU-CPU. We added prefetching and on-demand loading of hot experts on
  top of its processing of all non-shared experts using AMX-CPU, making it the strongest baseline under this
  architecture".
- KTransformers (SOSP'25, TriMoE's [2]): the GPU runs attention and the shared experts from HBM; the routed
  experts run on the AMX CPU from host memory; experts kept in GPU memory run there.
- TriMoE 5.2.1: "En-KTransformers is limited by host bandwidth when serving cold experts on the CPU".

Our model, per layer call (the gate's routing is known when the experts run):
- shared experts and HBM-resident routed experts compute on the GPU (eq. 1);
- "on-demand loading of hot experts": the non-resident routed experts are ordered hottest first (tokens in this
  call); the k hottest are loaded over PCIe and computed on the GPU (eq. 2), the rest run on the AMX CPU (eq. 3,
  host-bandwidth bound for cold experts). k is the prefix length that minimises the GPU/CPU makespan
  (`schedule_tri_base.hot_split`): the GPU takes hot experts on demand for as long as that shortens the layer,
  which is as busy as this design can keep it ("the strongest baseline under this architecture");
- "prefetching": experts the EMA predictor calls hot are prefetched into HBM in the background (the simulator's
  planner, hidden by the attention/dense window), as for every system with `prefetches`.

Simplifications (named): the paper gives neither the hot threshold nor how many experts it loads on demand; the
balancing prefix is our reading (it cannot be weaker than any fixed threshold on the same order). Every expert
stays striped (no NDP, no relayout). No refinement, no per-expert cost comparison beyond the hot order.
KTransformers' own CPU-side tricks (Expert Deferral overlapping CPU experts with the next layer's GPU work, NUMA
placement) are not modelled. CPU and GPU kernel times come from the profile's efficiency curves, not kernels.

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on NDP; no refinement moves; the makespan is
never above both the all-CPU split (k = 0) and the resident-only GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_tri_base import DOMAINS, TriExpert, TriOutcome, hot_split, tri_plan
from moetier.types import Domain


class KTransformersPlusScheduler:
    name = "ktransformers-plus"
    domains = frozenset((Domain.ACCEL, Domain.HOST))
    prefetches = True
    relayouts = False
    rebalances = False
    refines = False

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        codes, t = hot_split(experts, n_dimms, 1, "ktransformers-plus schedule")
        return TriOutcome(tri_plan(experts, [DOMAINS[k] for k in codes], t.makespan), t, t, 0)


__all__ = ["KTransformersPlusScheduler"]
