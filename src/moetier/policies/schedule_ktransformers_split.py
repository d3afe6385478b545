"""Enhanced-KTransformers read as the best GPU/CPU split per call, "ktransformers-plus-split": a labelled UPPER
BOUND on the TriMoE paper's GPU + AMX CPU baseline (its 5.1.2), kept beside the paper-following
"ktransformers-plus" (schedule_ktransformers_plus.py; issue 30).

What the paper says (TriMoE 5.1.2): "We added prefetching and on-demand loading of hot experts on top of its
processing of all non-shared experts using AMX-CPU". This reading (issue 17's default) goes further than the
sentence: the non-resident routed experts are ordered hottest first (tokens in this call) and the k hottest are
loaded over PCIe and computed on the GPU (eq. 2), the rest run on the AMX CPU (eq. 3), k the prefix length that
minimises the GPU/CPU makespan (`schedule_tri_base.hot_split`). The GPU thus takes on demand every expert that
shortens the layer, hot or not (about 22 per call at batch 512), which no fixed hot threshold on the same order can
beat: an upper bound on any "hot experts on the GPU" reading. Experts the EMA predictor calls hot are prefetched
into HBM in the background (the simulator's planner), as for "ktransformers-plus".

Simplifications (named): those of "ktransformers-plus" (no Expert Deferral, everything striped, LUT kernel times).

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on NDP; no refinement moves; the makespan is
never above both the all-CPU split (k = 0) and the resident-only GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_ktransformers_plus import KTransformersPlusScheduler
from moetier.policies.schedule_tri_base import DOMAINS, TriExpert, TriOutcome, hot_split, tri_plan


class KTransformersSplitScheduler(KTransformersPlusScheduler):
    """En-KTransformers' domains and background actions; only the split of a call differs."""

    name = "ktransformers-plus-split"

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        codes, t = hot_split(experts, n_dimms, 1, "ktransformers-plus-split schedule")
        return TriOutcome(tri_plan(experts, [DOMAINS[k] for k in codes], t.makespan), t, t, 0)


__all__ = ["KTransformersSplitScheduler"]
