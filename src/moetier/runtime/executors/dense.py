"""The dense torch executor: every routed expert of a call computed in full on one domain.

Decode (one token) takes a short path with no sort and no scatter; prefill groups tokens by
expert with one argsort (`group_tokens`). Neither loops over all E experts or over tokens.
The steps are base.group_by_expert and base.execute_per_expert (the native executor's fallback too).
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
from moetier.runtime.executors.base import (
    ExpertStoreLike,
    Grouped,
    ResidentFirst,
    execute_per_expert,
    group_by_expert,
)
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.types import Domain, Plan


class DenseExecutor:
    """Steps 3-5 of one MoE layer call on one domain: acquire, compute `fn`, combine."""

    def __init__(self, store: ExpertStoreLike, fn: ExpertFn, num_experts: int) -> None:
        self.store, self.fn, self.num_experts = store, fn, num_experts

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k]. Decode: expert -> gate weight of the one token; prefill: group_tokens."""
        return group_by_expert(ids, weights, self.num_experts)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H]."""
        return execute_per_expert(self.store, self.fn, x, plan, grouped)


def build(ctx: BuildContext) -> Built:
    """One DenseExecutor and the resident-first scheduler per MoE layer."""
    loaded = ctx.loaded
    domain = Domain.ACCEL if loaded.device.type == "cuda" else Domain.HOST
    return Built({
        b.layer: (ResidentFirst(b.store, domain), DenseExecutor(b.store, b.expert_fn, b.num_experts))
        for b in loaded.blocks
    })  # fmt: skip


SPEC = ExecutorSpec(name="dense", build=build)
