"""Enhanced-KTransformers, the TriMoE paper's GPU + AMX CPU baseline (its 5.1.2), "ktransformers-plus".

What the papers say:
- TriMoE 5.1.2: "We added prefetching and on-demand loading of hot experts on top of its processing of all
  non-shared experts using AMX-CPU, making it the strongest baseline under this architecture".
- KTransformers (SOSP'25, TriMoE's [2]): the GPU runs attention and the shared experts from HBM; the routed
  experts run on the AMX CPU from host memory; experts kept in GPU memory run there.
- TriMoE 5.2.1: "En-KTransformers is limited by host bandwidth when serving cold experts on the CPU".

Our model, per layer call, the sentence as written (issue 30):
- shared experts and HBM-resident routed experts compute on the GPU (eq. 1);
- "on-demand loading of hot experts": a routed expert the system calls hot (`hot`: the EMA load predictor's hot
  class, the top 5% of the layer's experts by predicted load, the same set its "prefetching" targets) that is not
  in HBM (its prefetch did not fit the window) is loaded over PCIe and computed on the GPU (eq. 2);
- "processing of all non-shared experts using AMX-CPU": every other routed expert runs on the AMX CPU (eq. 3,
  host-bandwidth bound for cold experts);
- "prefetching": experts the predictor calls hot are prefetched into HBM in the background (the simulator's
  planner, hidden by the attention/dense window), as for every system with `prefetches`.
The reading that balances the GPU against the CPU per call (the GPU taking any expert that shortens the layer)
is kept as a labelled upper bound, "ktransformers-plus-split" (schedule_ktransformers_split.py).

Simplifications (named): the paper gives no hot threshold; the predictor's hot class (5%, Fig. 3's "small number
of hot experts") is ours. Every expert stays striped (no NDP, no relayout). No refinement. KTransformers' own
CPU-side tricks (Expert Deferral overlapping CPU experts with the next layer's GPU work, NUMA placement) are not
modelled. CPU and GPU kernel times come from the profile's efficiency curves, not kernels.

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on NDP; no refinement moves; a non-resident
routed expert is on the GPU only when it is in `hot`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_tri_base import DOMAINS, TriExpert, TriOutcome, price_paths, sum_totals, tri_plan
from moetier.types import Domain


class KTransformersPlusScheduler:
    name = "ktransformers-plus"
    domains = frozenset((Domain.ACCEL, Domain.HOST))
    prefetches = True
    relayouts = False
    rebalances = False
    refines = False

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        p = price_paths(experts, n_dimms, (True, True, False), "ktransformers-plus schedule")
        codes = [0 if (e.resident or e.key.expert < 0 or e.key.expert in hot) else 1 for e in experts]
        t = sum_totals(p, codes, n_dimms)
        return TriOutcome(tri_plan(experts, [DOMAINS[k] for k in codes], t.makespan), t, t, 0)


__all__ = ["KTransformersPlusScheduler"]
