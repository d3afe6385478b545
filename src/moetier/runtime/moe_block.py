"""TieredMoE: the MoE block every family's block is swapped for.

One call runs the pipeline once: route -> plan -> move -> compute -> combine.

1. route: the family's own router module (kept from the reference block) gives
   top-k ids and weights per token; `on_logits` (score-aware caching) gets the router
   logits and `after_route` (the prefetcher, runtime/prefetch.py) the block's input and
   ids, both before any expert of the call is touched;
2. plan: policies.plan.plan_layer orders the experts (resident first);
3. move: ExpertStore.acquire loads a missing expert into a slot (evicting per policy);
4. compute: the family's expert function on the slot's views, only for active experts;
5. combine: weighted outputs summed in token order, plus shared experts. Experts are
   summed in ascending expert id (as the transformers reference does), never in plan
   order, so the result does not depend on residency, cache policy or prefetch timing
   (bit-identical runs in bf16).

With intra-expert sparsity on, steps 2-5 of the routed experts are `sparse`'s
(runtime/sparsity.py); with hybrid CPU-GPU execution they are `hybrid`'s
(runtime/hybrid.py); shared experts stay dense.

Decode (one token) takes a short path with no sort and no scatter; prefill groups
tokens by expert with one argsort (`group_tokens`). Neither loops over all E experts or over tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch
from torch import nn

from moetier.kernels.experts import ExpertFn
from moetier.kernels.small_rows import small_rows
from moetier.models.families import Family
from moetier.policies.plan import plan_layer
from moetier.types import ExpertKey

RouteHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # layer, ids, weights, logits
LogitsHook = Callable[[int, torch.Tensor], None]  # layer, logits [T, E]
AfterRoute = Callable[["TieredMoE", torch.Tensor, torch.Tensor], None]  # block, x [T, H], ids [T, k]


class Store(Protocol):
    """What a block needs of ExpertStore / DynamicStore."""

    @property
    def index(self) -> Collection[ExpertKey]: ...

    def acquire(self, key: ExpertKey) -> Any: ...

    def release(self, key: ExpertKey) -> None: ...


class TieredMoE(nn.Module):
    def __init__(
        self, family: Family, block: nn.Module, layer: int, num_experts: int, store: Store, expert_fn: ExpertFn
    ) -> None:
        super().__init__()
        self.family, self.layer, self.num_experts = family, layer, num_experts
        self.store, self.expert_fn = store, expert_fn
        self.router_name = family.router_attr
        self.add_module(family.router_attr, getattr(block, family.router_attr))
        for attr in (family.shared_attr, family.shared_gate_attr):
            if attr:
                self.add_module(attr, getattr(block, attr))
        self.route_hooks: list[RouteHook] = []  # trace recorder, precision controller
        self.sparse: Any = None  # runtime.sparsity.SparseExperts: replaces compute
        self.hybrid: Any = None  # runtime.hybrid.HybridExperts: replaces plan + compute (CUDA)
        self.on_logits: LogitsHook | None = None  # router scores to the cache policy (MRS)
        self.after_route: AfterRoute | None = None  # the prefetcher

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (logits [T, E], weights [T, k], ids [T, k])."""
        logits, weights, ids = getattr(self, self.router_name)(x)
        for hook in self.route_hooks:
            hook(self.layer, ids, weights, logits)
        return logits, weights, ids

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        fam = self.family
        if not fam.shared_attr:
            return None
        out = getattr(self, fam.shared_attr)(x)  # [T, H]
        if fam.shared_gate_attr:
            out = torch.sigmoid(getattr(self, fam.shared_gate_attr)(x)) * out
        return out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        logits, weights, ids = self.route(x)
        if self.on_logits is not None:
            self.on_logits(self.layer, logits)
        if self.after_route is not None:
            self.after_route(self, x, ids)
        out = self.experts_forward(x, ids, weights)
        shared = self.shared(x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, weights) if self.family.returns_router_scores else out

    def experts_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> sum_k w * expert(x) as [T, H]."""
        if self.sparse is not None:
            out: torch.Tensor = self.sparse.forward(self, x, ids, weights)
            return out
        if self.hybrid is not None:
            mixed: torch.Tensor = self.hybrid.forward(self, x, ids, weights)
            return mixed
        store, layer, fn = self.store, self.layer, self.expert_fn
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode: k experts, one token each
            id_list = ids[0].tolist()
            w_of = dict(zip(id_list, weights[0].tolist(), strict=True))
            plan = plan_layer(layer, dict.fromkeys(id_list, 1), store.index)
            ys: dict[int, torch.Tensor] = {}
            for task in plan.tasks:
                views = store.acquire(task.key)
                try:
                    ys[task.key.expert] = fn(x, views)  # [1, H]
                finally:
                    store.release(task.key)
            for e in sorted(ys):  # combine in expert order, whatever the residency
                out.add_(ys[e], alpha=w_of[e])  # [1, H] += w * expert(x)
            return out
        active, groups = group_tokens(ids, weights, self.num_experts)
        plan = plan_layer(layer, active, store.index)
        outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for task in plan.tasks:
            e, c = task.key.expert, task.tokens
            tok, w = groups[e]  # [c], [c]
            views = store.acquire(task.key)
            try:
                with small_rows(c, x.dtype, x.device):  # an expert with 1-2 of the call's tokens: native GEMV
                    y = fn(x[tok], views)  # [c, H]
                outs[e] = (tok, (y * w[:, None]).to(out.dtype))
            finally:
                store.release(task.key)
        for e in sorted(outs):  # combine in expert order, whatever the residency (as the reference does)
            out.index_add_(0, *outs[e])
        return out


def group_tokens(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[dict[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """ids/weights [T, k] -> (expert -> tokens, expert -> (token indices [c], weights [c])), both in ascending
    expert id, active experts only: the prefill grouping of TieredMoE and of runtime/hybrid.py."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k], grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    hit = counts.nonzero().flatten()  # [A]
    active = dict(zip(hit.tolist(), counts[hit].tolist(), strict=True))
    token_of = order // k  # [T*k]
    w_sorted = weights.reshape(-1)[order]  # [T*k]
    groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    start = 0
    for e, c in active.items():  # ascending expert id, as argsort grouped them
        groups[e] = (token_of[start : start + c], w_sorted[start : start + c])
        start += c
    return active, groups
