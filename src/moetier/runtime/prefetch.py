"""Cross-layer expert prefetch in the engine (HybriMoE IV-C, IV-D): a route observer.

When PrefetchConfig.enabled (runtime/wire.py adds it to the model's observers, last: after the
recorders and the cache scores), after MoE layer l routes, `Prefetcher.observe`
  1. scores the predictions made earlier for layer l against its actual routing;
  2. applies the routers of the next `depth` MoE layers to layer l's MoE input x (the
     hidden states of consecutive layers are similar through the residual) and takes
     top-k per token -> predicted tokens per expert per future layer;
  3. prices them with the cost model (runtime/pricing.py: fast = the compute domain; link = disk on
     a CPU machine, PCIe on a GPU one; cached = resident or in flight) and lets
     policies.prefetch.choose_prefetch pick by simulated makespan impact, within the link
     time the next layers give (minus the loads still queued);
  4. hands the choice to `store.prefetch`, protecting this call's experts and every
     predicted expert already resident; the store loads them in the background.

Invariants: prediction never changes the forward's results (routers are pure functions of
x; their outputs are discarded); the forward never waits for a prefetch it does not use;
statistics: predicted/correct per (layer call, expert) pair, overall (union over distances)
and per distance. The store must declare the "prefetch" capability (`NEEDS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moetier.config import PrefetchConfig
from moetier.policies.costmodel import token_counts
from moetier.policies.prefetch import PrefetchStats, choose_prefetch
from moetier.runtime.executors.base import PREFETCH
from moetier.runtime.moe_block import TieredMoE
from moetier.runtime.observers import Route, Stage
from moetier.runtime.pricing import Pricing
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

NEEDS = {
    PREFETCH: "prefetch needs a static precision (full, int8, int4, int2); dynamic keeps every expert resident already"
}


class Prefetcher:
    """The prefetch route observer of one engine (see the module docstring)."""

    stage = Stage.PREFETCH

    def __init__(self, blocks: Sequence[TieredMoE], store: ExpertStore, pricing: Pricing, cfg: PrefetchConfig) -> None:
        self.blocks, self.store, self.pricing, self.cfg = list(blocks), store, pricing, cfg
        self.position = {b.layer: i for i, b in enumerate(self.blocks)}
        self.stats = PrefetchStats()
        self.by_distance = {d: PrefetchStats() for d in range(1, cfg.depth + 1)}
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
                self.by_distance[d].record_prediction(keys, actual)
        # 2. predict the next `depth` MoE layers from this layer's input
        i = self.position[layer]
        ahead = self.blocks[i + 1 : i + 1 + self.cfg.depth]
        if not ahead:
            return
        counts: dict[int, dict[int, int]] = {}
        with torch.inference_mode():
            for d, nxt in enumerate(ahead, start=1):
                _, _, pred = nxt.route(x)  # [T, k] top-k of layer l+d's router
                c = counts[nxt.layer] = token_counts(pred.tolist())
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
        """PrefetchStats (accuracy, issued, used) plus the store's outcome counters and per-distance accuracy."""
        st = self.store.prefetch_stats()
        self.stats.used = st["used"]
        out: dict[str, Any] = dict(self.stats.as_dict())
        out.update({k: st[k] for k in ("wasted", "failed", "inflight", "waits", "wait_s", "errors")})
        out["depth"] = self.cfg.depth
        out["link_budget_s"] = self.budget_s
        out["by_distance"] = {d: s.as_dict() for d, s in self.by_distance.items()}
        return out
