"""TieredMoE: the MoE block a family row's block is swapped for; TieredExperts: the experts module swapped
into transformers' own block for a family run through the seam (models/seam.py), which runs steps 2-4 only.

One call runs the pipeline once, and this file says all of it:
1. route: the family's own router module (kept from the reference block) gives top-k ids and
   weights per token (and the router logits); then the model's routing override, if any (Pipeline.override,
   runtime/route_override.py: a followed trace, pruned experts, fewer experts per token; a skipped pair is id -1);
2. observe: the model's route observers (runtime/observers.py: trace recorder, precision
   controller, cache scores, prefetcher) see the call's routing, before any expert is touched;
3. plan: the executor groups the tokens by expert, the scheduler turns the counts into a Plan
   (tasks in run order, the domain of each);
4. move + compute + combine: the executor pins each task's expert where its domain computes,
   computes and sums the weighted outputs in ascending expert id (runtime/executors/); a family whose
   gate weight scales the expert's input (Llama-4, Family.scaled_input) hands the executor each
   (token, choice) as a row of its own, scaled, with weight 1, and sums a token's rows;
5. shared experts (dense, from the reference block) are added.

The scheduler, the executor and the observers are one `Pipeline`, given once by the wiring
(runtime/wire.py) with `attach`; nothing else decides what a call runs.

Faults: an expert whose read fails (store: ExpertReadError naming file and expert) fails the call with
that same exception, its `rows` set to the flattened rows of the call's input routed to that expert
(row r of [B, T, H] is b * T + t), so a batching caller can fail only the sequences that needed it;
nothing of the call is kept (the store registered nothing half-written). After non-finite logits the
engine asks each block `find_nonfinite()`: it checks the experts its last call routed to, off the hot
path (a block keeps a reference to its last call's ids [T, k], nothing more).

Invariants: the output does not depend on the plan's order, the residency or the domains (the
executors combine in expert order), so with full-precision experts and sparsity off it equals
the reference block's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from moetier.errors import ExpertReadError, MoetierError
from moetier.kernels.experts import ExpertFn
from moetier.kernels.qformat import QExpertViews
from moetier.kernels.stored import StoredExpertViews, for_layer
from moetier.models.families import Family
from moetier.runtime.executors.base import Executor, ExpertStoreLike, LayerScheduler, RoutedExecutor
from moetier.runtime.observers import ObserverList, Route
from moetier.runtime.route_override import RouteOverride
from moetier.store.pool import SlotViews
from moetier.types import ExpertKey


class BlockStore(ExpertStoreLike, Protocol):
    """What a block needs of its store beyond an executor's: where an expert is read from (error messages)."""

    def locate(self, key: ExpertKey, piece: str | None = None) -> str: ...


@dataclass(frozen=True)
class Pipeline:
    """What one block's calls run: its scheduler, its executor, the model's route observers."""

    scheduler: LayerScheduler
    executor: Executor
    observers: ObserverList
    routed: RoutedExecutor | None = None  # the executor again where it takes routing as is (plans in its acquire)
    override: RouteOverride | None = None  # the model's routing override (runtime/route_override.py), or None


class _Tiered(nn.Module):
    """What both block kinds share: the layer, its store and expert function, the pipeline, steps 3-4."""

    def __init__(self, layer: int, num_experts: int, store: BlockStore, expert_fn: ExpertFn) -> None:
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.store, self.expert_fn = store, expert_fn  # what the wiring builds this layer's executor on
        self.pipeline: Pipeline | None = None  # set once by the wiring (runtime/wire.py)
        self.last_ids: torch.Tensor | None = None  # [T, k] of the last call (find_nonfinite reads it)

    def attach(self, pipeline: Pipeline) -> Pipeline | None:
        """Give this block its pipeline; returns the previous one (calibration swaps it for a while)."""
        previous, self.pipeline = self.pipeline, pipeline
        return previous

    def experts_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> sum_k w * expert(x) as [T, H]: steps 3-4 of `forward` alone.
        3. the executor groups the tokens by expert and the scheduler plans the counts;
        4. the executor moves, computes and combines the plan's experts.
        An executor that takes routing as is (Pipeline.routed) does 3-4 in one: its bulk acquire pins the call's
        resident experts first, then reads the others (the default scheduler's plan)."""
        p = self._pipeline()
        self.last_ids = ids
        try:
            if p.routed is not None:  # the executor plans inside its bulk acquire (resident first)
                out = p.routed.execute_routed(x, ids, weights)
                if out is not None:
                    return out
            grouped = p.executor.group(ids, weights)
            plan = p.scheduler.plan(self.layer, grouped.counts)
            return p.executor.execute(x, plan, grouped)
        except ExpertReadError as exc:  # the same exception, told which rows needed the expert
            if not exc.rows and isinstance(exc.key, ExpertKey) and exc.key.layer == self.layer:
                exc.rows = routed_rows(ids, exc.key.expert)
            raise

    def find_nonfinite(self) -> str | None:
        """The first expert the last call routed to (ascending id) whose weights hold NaN or Inf, as a message
        naming its file, tensor and piece; None when all are finite (or none could be read). Off the hot path:
        the engine calls it only after a step's logits were not finite."""
        if self.last_ids is None:
            return None
        for e in sorted(set(self.last_ids.reshape(-1).tolist()) - {-1}):  # -1: a pair an override skipped
            key = ExpertKey(self.layer, int(e))
            try:
                views = self.store.acquire(key)
            except MoetierError:  # unreadable now: no verdict on it
                continue
            try:
                bad = nonfinite_piece(for_layer(views, self.layer))
            finally:
                self.store.release(key)
            if bad is not None:
                piece, count = bad
                where = self.store.locate(key, _PIECE_OF.get(piece, piece))
                return f"{where}: expert {e} of layer {self.layer} has {count} non-finite value(s) in its {piece}"
        return None

    def _pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise MoetierError(f"MoE layer {self.layer} has no pipeline: open models with moetier.load")
        return self.pipeline


def override_routing(
    override: RouteOverride, layer: int, ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids / weights [T, k] (and the router logits [T, E]) of one call -> the overridden (ids, weights, logits the
    observers see: the pruned experts masked, None when a trace replaced the routing); ids of skipped pairs -1."""
    ids_np = ids.detach().cpu().numpy().astype(np.int32)  # [T, k] copies: the override writes in place
    w_np = weights.detach().float().cpu().numpy().copy()  # [T, k]
    lg = logits.detach().float().cpu().numpy() if override.needs_logits(layer) and logits is not None else None
    override.apply(layer, ids_np, w_np, lg)
    new_ids = torch.from_numpy(ids_np).to(device=ids.device, dtype=ids.dtype)
    new_w = torch.from_numpy(w_np).to(device=weights.device, dtype=weights.dtype)
    seen = None if override.replaces_logits(layer) else override.mask_logits(layer, logits)
    return new_ids, new_w, seen


def routed_rows(ids: torch.Tensor, expert: int) -> tuple[int, ...]:
    """ids [T, k] -> the rows (ascending) that routed to `expert`."""
    return tuple(int(r) for r in (ids == expert).any(-1).nonzero().flatten().tolist())


_PIECE_OF = {"w13": "gate", "w2": "down", "b13": "gate_bias", "b2": "down_bias"}  # matrix -> a piece it holds


def nonfinite_piece(views: Any) -> tuple[str, int] | None:
    """(piece, count of NaN / Inf values) of the first non-finite part of one expert's slot, or None: the float
    pieces of a full-precision slot, the scales and biases of a quantised one, the decoded matrices and biases
    of a stored-form one."""
    parts: list[tuple[str, torch.Tensor | None]]
    if isinstance(views, SlotViews):
        parts = list(views.pieces.items())
    elif isinstance(views, QExpertViews):
        parts = [("w13", views.w13.scale), ("w2", views.w2.scale), ("b13", views.b13), ("b2", views.b2)]
        parts += [(n, w.zero) for n, w in (("w13", views.w13), ("w2", views.w2)) if w.zero is not None]
    elif isinstance(views, StoredExpertViews):
        parts = [("w13", views.w13.decode(torch.float32)), ("w2", views.w2.decode(torch.float32))]
        parts += [("b13", views.b13), ("b2", views.b2)]
    else:
        return None
    for name, t in parts:
        if t is not None and t.is_floating_point():
            n = int((~torch.isfinite(t)).sum().item())
            if n:
                return name, n
    return None


class TieredMoE(_Tiered):
    """A family row's MoE block: its router and shared experts kept, the experts ours."""

    def __init__(
        self, family: Family, block: nn.Module, layer: int, num_experts: int, store: BlockStore,
        expert_fn: ExpertFn,
    ) -> None:  # fmt: skip
        super().__init__(layer, num_experts, store, expert_fn)
        self.family = family
        self.router_name = family.router_attr
        self.add_module(family.router_attr, getattr(block, family.router_attr))
        for attr in (family.shared_attr, family.shared_gate_attr):
            if attr:
                self.add_module(attr, getattr(block, attr))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (logits [T, E], weights [T, k], ids [T, k]): the router alone, no observer."""
        router = getattr(self, self.router_name)
        if self.family.scaled_input:  # Llama-4: (scores [T, E], zero outside the top k; logits [T, E])
            scores, logits = router(x)
            ids = torch.topk(logits, router.top_k, dim=1).indices  # the router's own top-k of the same logits
            return logits, scores.gather(1, ids), ids
        logits, weights, ids = router(x)
        return logits, weights, ids

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [T, H] -> the shared experts' output [T, H] (gated where the family gates it), or None."""
        fam = self.family
        if not fam.shared_attr:
            return None
        out = getattr(self, fam.shared_attr)(x)  # [T, H]
        if fam.shared_gate_attr:
            out = torch.sigmoid(getattr(self, fam.shared_gate_attr)(x)) * out
        return out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [..., H] -> the block's output [..., H] (and the gate weights, for families returning them)."""
        p = self._pipeline()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        # 1. route
        logits, weights, ids = self.route(x)  # [T, E], [T, k], [T, k]
        # 1b. the routing override (a followed trace, pruned experts, fewer experts per token), if any
        seen_logits: torch.Tensor | None = logits
        if p.override is not None:
            ids, weights, seen_logits = override_routing(p.override, self.layer, ids, weights, logits)
        # 2. observe, before any expert is touched
        if p.observers:
            route = Route(self.layer, x, ids, weights, seen_logits, self.family.scoring, self.num_experts)
            for obs in p.observers:
                obs.observe(route)
        # 3. plan, 4. move + compute + combine
        if self.family.scaled_input:
            out = self.experts_on_scaled_input(x, ids, weights)
        else:
            out = self.experts_forward(x, ids, weights)  # [T, H]
        # 5. shared experts
        shared = self.shared(x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, weights) if self.family.returns_router_scores else out


    def experts_on_scaled_input(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Llama-4 (Family.scaled_input): sum_k expert_k(w_k * x) as [T, H]. Each (token, choice) is a row of its
        own, its input scaled by its weight, combined with weight 1 (exact), then the k rows of a token summed, as
        the reference sums its experts' outputs (an unchosen expert's output there is exactly zero)."""
        t, k = ids.shape
        xs = (x.unsqueeze(1) * weights.unsqueeze(-1)).reshape(t * k, x.shape[-1])  # [T*k, H], row t*k + j
        ones = torch.ones((t * k, 1), dtype=weights.dtype, device=weights.device)
        try:
            out = self.experts_forward(xs, ids.reshape(t * k, 1), ones)  # [T*k, H]
        except ExpertReadError as exc:  # rows of the expanded input -> the call's rows
            exc.rows = tuple(sorted({r // k for r in exc.rows}))
            raise
        return out.reshape(t, k, -1).sum(dim=1)


class TieredExperts(_Tiered):
    """The seam (models/seam.py): stands in for a family's experts module inside transformers' own MoE block,
    which has routed already; steps 1 and 5 are the family's code, this runs 2-4."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: object, **kwargs: object) -> torch.Tensor:  # fmt: skip
        """hidden_states [T, H], top_k_index / top_k_weights [T, k] -> sum_k w * expert(x) as [T, H]."""
        p = self._pipeline()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        ids = top_k_index.reshape(x.shape[0], -1)  # [T, k]
        weights = top_k_weights.reshape(x.shape[0], -1)  # [T, k]
        if p.override is not None:  # a followed trace, fewer experts per token (pruning needs our router: refused)
            ids, weights, _ = override_routing(p.override, self.layer, ids, weights, None)
        # 2. observe, before any expert is touched (no router logits: the router is the family's own code)
        if p.observers:
            route = Route(self.layer, x, ids, weights, None, "softmax", self.num_experts)
            for obs in p.observers:
                obs.observe(route)
        # 3. plan, 4. move + compute + combine
        out = self.experts_forward(x, ids, weights)  # [T, H]
        return out.reshape(hidden_states.shape)
