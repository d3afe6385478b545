"""The executor protocol: what runs a MoE layer call's Plan (steps 3-5: move, compute, combine).

A TieredMoE call groups its tokens by expert with its executor (`Executor.group` -> `Grouped`,
tokens per expert in ascending expert id), asks its scheduler for a Plan (`LayerScheduler.plan`),
and hands the plan to the executor (`Executor.execute`), which pins each task's expert where its
domain computes, computes, and combines the weighted outputs into [T, H].

Each executor variant is one file in this package, declared by an `ExecutorSpec` (its name, the
store capabilities it needs with the refusal for each, config checks, how it is built for a
model; runtime/executors/spec.py); runtime/executors/registry.py maps names to specs. Stores declare their capabilities
(`ExpertStore.capabilities`, `DynamicStore.capabilities`, the names below); runtime/wire.py
refuses a combination from them, never from the store's class.

Invariants every executor keeps:
- exactness: with every expert at full precision and sparsity off, the output equals the
  reference block's: outputs are combined in ascending expert id (as transformers does), never in
  plan or completion order, so the result does not depend on residency or domains;
- every acquired expert is released, also when a task fails.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from moetier.errors import ConfigError
from moetier.kernels.stored import for_layer
from moetier.policies.plan import plan_layer
from moetier.types import Domain, ExpertKey, Plan

# store capabilities (declared by store/store.py ExpertStore and store/dynamic.py DynamicStore)
STATIC_PRECISION = "static_precision"  # one precision per store, read from the checkpoint or a quantized tier
PREFETCH = "prefetch"  # background loads into the compute tier (ExpertStore.prefetch)
ROUTE_SCORES = "route_scores"  # a cache policy that may take router scores (ExpertStore.on_route)
DOMAINS = "domains"  # acquire / release per tier (accelerator and host): two compute domains
PRECISION_SWITCHING = "precision_switching"  # hi / lo versions switched in the background (DynamicStore)


def refuse_missing(needs: Mapping[str, str], capabilities: Collection[str]) -> None:
    """ConfigError with the feature's own message for the first needed capability the store lacks."""
    for cap, message in needs.items():
        if cap not in capabilities:
            raise ConfigError(message)


class ExpertStoreLike(Protocol):
    """What a single-domain executor needs of a store."""

    @property
    def index(self) -> Collection[ExpertKey]: ...

    def acquire(self, key: ExpertKey) -> Any: ...

    def release(self, key: ExpertKey) -> None: ...


class Grouped(NamedTuple):
    """One call's tokens grouped by expert: `counts` (expert -> tokens) for the scheduler, `data` in the
    executor's own form for its execute (a NamedTuple: one per layer call)."""

    counts: Mapping[int, int]
    data: Any


class Executor(Protocol):
    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> the call's tokens per expert."""
        ...

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] and the plan of its grouped tokens -> sum_k w * expert(x) as [T, H]."""
        ...


class RoutedExecutor(Protocol):
    """An executor that takes a call's routing as it is (runtime/executors/native.py): it plans inside its bulk
    acquire (the store pins the resident experts first, then reads the others: the default plan), so the block
    skips grouping and the Plan object."""

    def execute_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """x [T, H], ids/weights [T, k] -> sum_k w * expert(x) as [T, H]; None where this call cannot take the
        routed path (the block then groups and plans as usual)."""
        ...


class LayerScheduler(Protocol):
    def plan(self, layer: int, counts: Mapping[int, int]) -> Plan:
        """counts: expert id -> tokens routed to it in this call -> the call's Plan."""
        ...


class ResidentFirst:
    """The default scheduler: every expert on the compute domain, resident experts first
    (policies/plan.plan_layer); with a sparsity target, tasks below the tipping point carry it."""

    def __init__(
        self, store: ExpertStoreLike, domain: Domain = Domain.HOST, sparsity: float = 0.0, tipping: int = 0
    ) -> None:
        self.store, self.domain, self.sparsity, self.tipping = store, domain, sparsity, tipping

    def plan(self, layer: int, counts: Mapping[int, int]) -> Plan:
        return plan_layer(layer, counts, self.store.index, self.domain, self.sparsity, self.tipping)


def group_tokens(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[dict[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """ids/weights [T, k] -> (expert -> tokens, expert -> (token indices [c], weights [c])), both in ascending
    expert id, active experts only: the prefill grouping of the dense and hybrid executors."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k], grouped by expert
    skipped = int((flat < 0).sum())  # pairs a routing override skipped (id -1: no expert), sorted first
    order = order[skipped:]  # [P] the pairs computed
    counts = torch.bincount(flat[order], minlength=num_experts)  # [E]
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


def group_by_expert(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Grouped:
    """ids/weights [T, k] -> Grouped. Decode (T = 1): data is expert -> gate weight of the one token, with
    no sort; else data is expert -> (token indices [c], weights [c]) from `group_tokens`."""
    if ids.shape[0] == 1:  # decode: k experts, one token each
        w_of: dict[int, float] = {}
        for e, w in zip(ids[0].tolist(), weights[0].tolist(), strict=True):  # an expert chosen twice (hash
            if e >= 0:  # -1: a pair a routing override skipped
                w_of[e] = w_of.get(e, 0.0) + w  # routing, e.g. DeepSeek-V4) counts with both gate weights
        return Grouped(dict.fromkeys(w_of, 1), w_of)
    active, groups = group_tokens(ids, weights, num_experts)
    return Grouped(active, groups)


def execute_per_expert(store: ExpertStoreLike, fn: Any, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
    """x [T, H] -> sum_k w * expert(x) as [T, H], one expert at a time with torch: each task's expert is
    acquired in plan order, computed with `fn` and released before the next (one slot is enough); the
    weighted outputs are summed in ascending expert id, as the transformers reference does."""
    out = torch.zeros_like(x)  # [T, H]
    if x.shape[0] == 1:  # decode
        w_of: dict[int, float] = grouped.data
        ys: dict[int, torch.Tensor] = {}
        for task in plan.tasks:  # 1. move + compute, in plan order
            views = for_layer(store.acquire(task.key), task.key.layer)
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
        views = for_layer(store.acquire(task.key), task.key.layer)
        try:
            y = fn(x[tok], views)  # [c, H]
            outs[e] = (tok, (y * w[:, None]).to(out.dtype))
        finally:
            store.release(task.key)
    for e in sorted(outs):  # 2. combine in expert order, whatever the residency (as the reference does)
        out.index_add_(0, *outs[e])
    return out
