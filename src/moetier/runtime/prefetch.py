"""Cross-layer expert prefetch in the engine (HybriMoE IV-C, IV-D): a route observer.

When PrefetchConfig.enabled (runtime/wire.py adds it to the model's observers, last: after the
recorders and the cache scores), after MoE layer l routes, `Prefetcher.observe`
  1. scores the predictions made earlier for layer l against its actual routing;
  2. predicts the experts of the next `depth` MoE layers with the predictor PrefetchConfig.predictor
     names (`PREDICTORS`) -> predicted tokens per expert per future layer:
     - "gate" (`GatePredictor`, HybriMoE IV-C): applies their routers to layer l's MoE input x (the
       hidden states of consecutive layers are similar through the residual) and takes top-k per token;
     - "history" (`HistoryPredictor`): the simulator's torch-free predictor (policies/route_history.py),
       fed every layer call's top-k ids, learning online from the routing seen so far;
  3. prices them with the cost model (runtime/pricing.py: fast = the compute domain; link = disk on
     a CPU machine, PCIe on a GPU one; cached = resident or in flight) and lets
     policies.prefetch.choose_prefetch pick by simulated makespan impact, within the link
     time the next layers give (minus the loads still queued);
  4. hands the choice to `store.prefetch`, protecting this call's experts and every
     predicted expert already resident; the store loads them in the background.

Blocks: the prefetcher reads only what both block kinds share (runtime/moe_block.py `_Tiered`: the layer and
E, `PrefetchBlock`), so it runs on a family row's TieredMoE and on the seam's TieredExperts alike; the
store to prefetch into and the pricing are the engine's, given by the wiring. A predictor declares whether
it applies the next layers' routers (`needs_router`): "gate" does, and the seam has none (the router stays
in transformers' own block), so runtime/wire.py refuses it there before any pool is allocated; "history"
needs only the routed ids, which the seam's block sees at its step 2.

Invariants: prediction never changes the forward's results (routers are pure functions of
x and their outputs are discarded; the history predictor reads the ids, it does not write them);
the forward never waits for a prefetch it does not use; every predictor sees every MoE layer call,
in order; statistics: predicted/correct per (layer call, expert) pair, overall (union over
distances) and per distance, the same for every predictor (`by_distance`, and `accuracy_by_distance`
as the simulator reports it); the history predictor adds its own per-token precision per distance.
The store must declare the "prefetch" capability (`NEEDS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, cast

import numpy as np
import torch

from moetier.config import PrefetchConfig
from moetier.policies.costmodel import token_counts
from moetier.policies.prefetch import PrefetchStats, choose_prefetch
from moetier.policies.route_history import RouteHistoryPredictor
from moetier.runtime.executors.base import PREFETCH
from moetier.runtime.moe_block import TieredMoE
from moetier.runtime.observers import Route, Stage
from moetier.runtime.pricing import Pricing
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

NEEDS = {
    PREFETCH: "prefetch needs a static precision (full, int8, int4, int2); dynamic keeps every expert resident already"
}


class PrefetchBlock(Protocol):
    """What the prefetcher and its predictors read of a MoE block: what both block kinds share (moe_block.py
    `_Tiered`, read-only here)."""

    @property
    def layer(self) -> int: ...

    @property
    def num_experts(self) -> int: ...


class Predictor(Protocol):
    """Predicts the experts of the next MoE layers from one layer call's route. Made from (the MoE blocks in layer
    order, top-k, depth); `needs_router`: it applies the next layers' routers, which only a family row's own block
    (TieredMoE) holds (runtime/wire.py refuses such a predictor on the seam)."""

    needs_router: ClassVar[bool]

    def __init__(self, blocks: Sequence[PrefetchBlock], top_k: int, depth: int) -> None: ...

    def predict(self, route: Route, ahead: Sequence[PrefetchBlock]) -> list[dict[int, int]]:
        """{expert: predicted tokens} for each block of `ahead` (distance 1, 2, ...). Called for every MoE layer
        call in layer order, `ahead` empty past the last one."""
        ...

    def summary(self) -> dict[str, Any]:
        """The predictor's own statistics, for the prefetch summary (may be empty)."""
        ...


class GatePredictor:
    """HybriMoE IV-C: the next layers' routers applied to this layer's input x [T, H]; top-k per token. Stateless:
    the routers are the blocks' own."""

    needs_router: ClassVar[bool] = True

    def __init__(self, blocks: Sequence[PrefetchBlock], top_k: int, depth: int) -> None:
        # needs_router: the wiring gives this predictor a family row's blocks only (TieredMoE, with its router)
        self.routers = {b.layer: cast(TieredMoE, b).route for b in blocks}

    def predict(self, route: Route, ahead: Sequence[PrefetchBlock]) -> list[dict[int, int]]:
        out: list[dict[int, int]] = []
        with torch.inference_mode():
            for nxt in ahead:
                _, _, pred = self.routers[nxt.layer](route.x)  # [T, k] top-k of the router of layer l + d
                out.append(token_counts(pred.tolist()))
        return out

    def summary(self) -> dict[str, Any]:
        return {}


class HistoryPredictor:
    """The simulator's predictor (policies/route_history.py), fed each layer call's top-k ids (online). Reads the
    routed ids only, so it runs on the seam too."""

    needs_router: ClassVar[bool] = False

    def __init__(self, blocks: Sequence[PrefetchBlock], top_k: int, depth: int) -> None:
        self.model = RouteHistoryPredictor([b.layer for b in blocks], blocks[0].num_experts, top_k, depth)

    def predict(self, route: Route, ahead: Sequence[PrefetchBlock]) -> list[dict[int, int]]:
        ids = route.ids.cpu().numpy()  # [T, k]
        if (ids < 0).any():  # pairs a routing override skipped (-1): a row's kept expert in their place
            ids = np.where(ids < 0, ids.max(axis=1, keepdims=True), ids)
        self.model.feed(route.layer, ids)
        return [self.model.predict_counts(route.layer, d) for d in range(1, len(ahead) + 1)]

    def summary(self) -> dict[str, Any]:
        """Per distance: the predictor's per-token precision (predicted, correct, accuracy), as the simulator's."""
        return {"history": self.model.stats()}


# PrefetchConfig.predictor (config.PREFETCH_PREDICTORS) -> its class
PREDICTORS: dict[str, type[Predictor]] = {"gate": GatePredictor, "history": HistoryPredictor}


class Prefetcher:
    """The prefetch route observer of one engine (see the module docstring)."""

    stage = Stage.PREFETCH

    def __init__(
        self, blocks: Sequence[PrefetchBlock], store: ExpertStore, pricing: Pricing, cfg: PrefetchConfig, top_k: int
    ) -> None:
        self.blocks, self.store, self.pricing, self.cfg = list(blocks), store, pricing, cfg
        self.position = {b.layer: i for i, b in enumerate(self.blocks)}
        self.predictor = PREDICTORS[cfg.predictor](self.blocks, top_k, cfg.depth)
        self.stats = PrefetchStats()  # overall, and per distance (its by_distance: the simulator's counters)
        self._pending: dict[int, dict[int, set[ExpertKey]]] = {}  # target layer -> distance -> predicted keys
        self.budget_s = 0.0  # link seconds offered to choose_prefetch, summed
        self.chosen = 0

    def observe(self, route: Route) -> None:
        """After layer `route.layer` routed x [T, H] to ids [T, k]: score, predict, price, choose, issue."""
        layer, x, ids = route.layer, route.x, route.ids
        here_counts = token_counts(ids.tolist())  # expert -> tokens of this call
        actual = {ExpertKey(layer, e) for e in here_counts}
        # 1. score earlier predictions for this layer
        made = self._pending.pop(layer, None)
        if made:
            self.stats.record_prediction(set().union(*made.values()), actual)
            for d, keys in made.items():
                self.stats.record_distance(d, keys, actual)
        # 2. predict the next `depth` MoE layers (every call reaches the predictor: history learns from it)
        i = self.position[layer]
        ahead = self.blocks[i + 1 : i + 1 + self.cfg.depth]
        predicted = self.predictor.predict(route, ahead)
        if not ahead:
            return
        counts: dict[int, dict[int, int]] = {}
        for d, (nxt, c) in enumerate(zip(ahead, predicted, strict=True), start=1):
            counts[nxt.layer] = c
            self._pending.setdefault(nxt.layer, {})[d] = {ExpertKey(nxt.layer, e) for e in c}
        # 3. price with the current residency (in-flight counts as cached) and choose
        p = self.pricing
        cached = self.store.cached_keys()
        here = p.cost.work(layer, here_counts, cached, p.fast, p.slow, p.link)
        tokens = int(x.shape[0])
        layer_s = p.scheduler.schedule(here).makespan + p.cost.dense_s(p.fast, tokens, 0)
        backlog = len(self.store.inflight()) * p.cost.move_s(p.link, p.cost.expert_nbytes)
        budget = max(0.0, len(ahead) * layer_s - backlog)
        self.budget_s += budget
        if budget <= 0:
            return
        future = {lay: p.cost.work(lay, c, cached, p.fast, p.slow, p.link) for lay, c in counts.items()}
        chosen = choose_prefetch(future, p.scheduler, budget, self.cfg.max_experts)
        if not chosen:
            return
        # 4. issue; never evict what this call or the predicted window still needs
        protect = actual | {k for lay, c in counts.items() for k in (ExpertKey(lay, e) for e in c) if k in cached}
        issued = self.store.prefetch(chosen, protect)
        self.chosen += len(chosen)
        self.stats.issued += len(issued)

    def summary(self) -> dict[str, Any]:
        """PrefetchStats (accuracy, issued, used, accuracy_by_distance) plus the store's outcome counters, the
        predictor's name, per-distance accuracy (`by_distance`) and the predictor's own statistics."""
        st = self.store.prefetch_stats()
        self.stats.used = st["used"]
        out: dict[str, Any] = dict(self.stats.as_dict())
        out.update({k: st[k] for k in ("wasted", "failed", "inflight", "waits", "wait_s", "errors")})
        out["depth"] = self.cfg.depth
        out["predictor"] = self.cfg.predictor
        out["link_budget_s"] = self.budget_s
        out["by_distance"] = {  # every distance 1..depth, from the one set of per-distance counters
            d: {"predicted": n, "correct": c, "accuracy": c / n if n else 0.0}
            for d in range(1, self.cfg.depth + 1)
            for n, c in [self.stats.by_distance.get(d, [0, 0])]
        }
        out.update(self.predictor.summary())
        return out
