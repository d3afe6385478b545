"""The dense torch executor: every routed expert of a call computed in full on one domain.

Decode (one token) takes a short path with no sort and no scatter; prefill groups tokens by
expert with one argsort (`group_tokens`). Neither loops over all E experts or over tokens.
The experts are acquired from the store in plan order (resident first, so a miss's load never
evicts an expert the call still needs) and their weighted outputs summed in ascending expert id,
as the transformers reference does: the result does not depend on residency, cache policy or
prefetch timing (bit-identical runs in bf16).

Invariants: exact (the reference's math per expert, its combine order); every acquired expert is
released before the next is acquired, also on error, so one slot is enough.
"""

from __future__ import annotations

import torch

from moetier.kernels.experts import ExpertFn
from moetier.runtime.executors.base import ExpertStoreLike, Grouped, ResidentFirst, group_tokens
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.types import Domain, Plan


class DenseExecutor:
    """Steps 3-5 of one MoE layer call on one domain: acquire, compute `fn`, combine."""

    def __init__(self, store: ExpertStoreLike, fn: ExpertFn, num_experts: int) -> None:
        self.store, self.fn, self.num_experts = store, fn, num_experts

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k]. Decode: expert -> gate weight of the one token; prefill: group_tokens."""
        if ids.shape[0] == 1:  # decode: k experts, one token each
            id_list = ids[0].tolist()
            return Grouped(dict.fromkeys(id_list, 1), dict(zip(id_list, weights[0].tolist(), strict=True)))
        active, groups = group_tokens(ids, weights, self.num_experts)
        return Grouped(active, groups)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H]."""
        store, fn = self.store, self.fn
        out = torch.zeros_like(x)  # [T, H]
        if x.shape[0] == 1:  # decode
            w_of: dict[int, float] = grouped.data
            ys: dict[int, torch.Tensor] = {}
            for task in plan.tasks:  # 1. move + compute, in plan order
                views = store.acquire(task.key)
                try:
                    ys[task.key.expert] = fn(x, views)  # [1, H]
                finally:
                    store.release(task.key)
            for e in sorted(ys):  # 2. combine in expert order, whatever the residency
                out.add_(ys[e], alpha=w_of[e])  # [1, H] += w * expert(x)
            return out
        groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = grouped.data
        outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for task in plan.tasks:  # 1. move + compute, in plan order
            e = task.key.expert
            tok, w = groups[e]  # [c], [c]
            views = store.acquire(task.key)
            try:
                y = fn(x[tok], views)  # [c, H]
                outs[e] = (tok, (y * w[:, None]).to(out.dtype))
            finally:
                store.release(task.key)
        for e in sorted(outs):  # 2. combine in expert order, whatever the residency (as the reference does)
            out.index_add_(0, *outs[e])
        return out


def build(ctx: BuildContext) -> Built:
    """One DenseExecutor and the resident-first scheduler per MoE layer."""
    loaded = ctx.loaded
    domain = Domain.ACCEL if loaded.device.type == "cuda" else Domain.HOST
    return Built({
        b.layer: (ResidentFirst(b.store, domain), DenseExecutor(b.store, b.expert_fn, b.num_experts))
        for b in loaded.blocks
    })  # fmt: skip


SPEC = ExecutorSpec(name="dense", build=build)
