"""A torch-free expert predictor that learns online from the routing it has seen (trace-side prefetch).

HybriMoE (IV-C) and AdapMoE predict the next layers' experts by applying those layers' routers to the
current hidden state; a trace replay has no hidden states. This predictor uses only the routing: for
each MoE layer position p and distance d (1..depth) it counts, per token, how often expert j was routed
at position p + d of the same step after expert i at position p (cross-layer transitions), and, per
position, how often j followed i at the same position one step later for the same token (temporal
transitions). A prediction for position p + d, from the experts just routed at p, scores every expert j:

    score[t, j] = mean_{i in a_t} Pc[p, d](j | i) + mean_{i in prev_t} Pt[p + d](j | i) + 0.05 * marg[p + d](j)

where a_t are token t's experts at p, prev_t its experts at p + d in the previous step (when that step
had the same number of rows), P(j | i) = (count(i -> j) + marg(j)) / (count(i) + 1) (one pseudo-count
spread by the layer's routing frequency, so an unseen row is the frequency prior), and marg the layer's
routing frequency (add-one smoothed). Each token's top-k scores is its prediction (ties to the lower id).

API (the simulator, benchmarks and the cache study use the same calls):
- `feed(layer, ids)`: one MoE layer call, ids [T, k] (one row per token, the router's top-k); calls
  arrive in layer order within a step; a layer at or before the last fed one starts a new step. It
  learns the transitions that end at this call and scores the predictions made for it;
- `predict(layer, distance)` -> [T, k] predicted ids for the MoE layer `distance` positions after
  `layer`, for the tokens last fed at `layer` (empty [T, 0] when that is past the last MoE layer);
  `predict_counts(layer, distance)` -> {expert: tokens} of the same prediction;
- `reset_stats()` zeroes the accuracy counters (after a warm-up); `stats()` -> {distance: {"predicted",
  "correct", "accuracy"}}: per-token precision of every prediction whose target call has been fed
  (correct = predicted experts the token then routed).

Invariants: deterministic; learns only from calls already fed (a prediction never sees its target);
a prediction holds min(k, E) distinct experts per token; with no history it predicts the most frequent
experts so far (lowest ids first when nothing was seen).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moetier.errors import ConfigError

MARGINAL_WEIGHT = 0.05  # the frequency prior's weight: breaks ties among transition scores


class RouteHistoryPredictor:
    """Cross-layer and temporal transition counts over MoE layer positions (see the module docstring)."""

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int, depth: int = 3) -> None:
        self.layers = [int(x) for x in layers]
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"RouteHistoryPredictor: layers must be distinct and non-empty, got {list(layers)}")
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ConfigError(f"RouteHistoryPredictor: need 1 <= top_k <= num_experts, got {top_k}, {num_experts}")
        if depth < 1:
            raise ConfigError(f"RouteHistoryPredictor: depth must be >= 1, got {depth}")
        self.pos = {layer: p for p, layer in enumerate(self.layers)}
        L, E = len(self.layers), num_experts
        self.E, self.k, self.depth = E, top_k, depth
        self.cross = np.zeros((L, depth, E, E))  # [p, d-1, i, j] counts i at p -> j at p + d, same token, same step
        self.temporal = np.zeros((L, E, E))  # [p, i, j] counts i at p -> j at p one step later, same token
        self.freq = np.zeros((L, E))  # [p, j] routings of j at p
        self.current: dict[int, np.ndarray] = {}  # position -> ids [T, k] fed in the current step
        self.previous: dict[int, np.ndarray] = {}  # position -> ids [T, k] of the previous step
        self.last_pos = -1
        self.pending: dict[int, list[tuple[int, np.ndarray]]] = {}  # target position -> (distance, pred [T, k])
        self.predicted = np.zeros(depth + 1, dtype=np.int64)  # per distance (index 0 unused)
        self.correct = np.zeros(depth + 1, dtype=np.int64)

    # 1. Learning ---------------------------------------------------------------------------------------------------
    def _ids(self, layer: int, ids: object) -> tuple[int, np.ndarray]:
        if layer not in self.pos:
            raise ConfigError(f"RouteHistoryPredictor: layer {layer} is not one of its MoE layers {self.layers[:4]}...")
        a = np.asarray(ids, dtype=np.int64)
        if a.ndim == 1:
            a = a[None, :]  # [1, k]
        if a.ndim != 2 or (a.size and (a.min() < 0 or a.max() >= self.E)):
            raise ConfigError(f"RouteHistoryPredictor: ids must be [T, k] expert ids in [0, {self.E}), "
                              f"got shape {a.shape}")  # fmt: skip
        return self.pos[layer], a

    @staticmethod
    def _count(m: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """m[i, j] += 1 for every (i in a_t, j in b_t), t over rows."""
        rows = np.broadcast_to(a[:, :, None], (a.shape[0], a.shape[1], b.shape[1]))  # [T, ka, kb]
        cols = np.broadcast_to(b[:, None, :], rows.shape)  # [T, ka, kb]
        np.add.at(m, (rows.ravel(), cols.ravel()), 1.0)

    def feed(self, layer: int, ids: object) -> None:
        """One layer call's routing, ids [T, k] (or [k] for one token)."""
        p, a = self._ids(layer, ids)
        if p <= self.last_pos:  # a new step
            self.previous, self.current = self.current, {}
            self.pending = {}  # predictions never cross into the next step
        self.last_pos = p
        # score the predictions made for this call
        for d, pred in self.pending.pop(p, []):
            if pred.shape[0] != a.shape[0] or pred.shape[1] == 0:
                continue
            hit = (pred[:, :, None] == a[:, None, :]).any(-1)  # [T, kp]
            self.predicted[d] += pred.size
            self.correct[d] += int(hit.sum())
        # learn the transitions that end here
        for d in range(1, self.depth + 1):
            src = self.current.get(p - d)
            if src is not None and src.shape[0] == a.shape[0]:
                self._count(self.cross[p - d, d - 1], src, a)
        prev = self.previous.get(p)
        if prev is not None and prev.shape[0] == a.shape[0]:
            self._count(self.temporal[p], prev, a)
        np.add.at(self.freq[p], a.ravel(), 1.0)
        self.current[p] = a

    # 2. Prediction -------------------------------------------------------------------------------------------------
    def _cond(self, m: np.ndarray, a: np.ndarray, marg: np.ndarray) -> np.ndarray:
        """mean over a token's experts i of P(j | i), rows [T, E]."""
        c = m[a]  # [T, k, E]
        p = (c + marg) / (c.sum(-1, keepdims=True) + 1.0)  # [T, k, E]
        return p.mean(1)  # [T, E]

    def scores(self, layer: int, distance: int) -> np.ndarray:
        """The [T, E] scores of the module docstring for position(layer) + distance ([T, 0] past the end)."""
        if layer not in self.pos:
            raise ConfigError(f"RouteHistoryPredictor: layer {layer} is not one of its MoE layers")
        if not 1 <= distance <= self.depth:
            raise ConfigError(f"RouteHistoryPredictor: distance must be in 1..{self.depth}, got {distance}")
        p = self.pos[layer]
        a = self.current.get(p)
        if a is None:
            raise ConfigError(f"RouteHistoryPredictor: layer {layer} was not fed in the current step")
        q = p + distance
        if q >= len(self.layers):
            return np.zeros((a.shape[0], 0))
        marg = (self.freq[q] + 1.0) / (self.freq[q].sum() + self.E)  # [E]
        s = self._cond(self.cross[p, distance - 1], a, marg) + MARGINAL_WEIGHT * marg  # [T, E]
        prev = self.previous.get(q)
        if prev is not None and prev.shape[0] == a.shape[0]:
            s += self._cond(self.temporal[q], prev, marg)
        return s

    def predict(self, layer: int, distance: int) -> np.ndarray:
        """Predicted ids [T, k] for the MoE layer `distance` positions after `layer` (recorded for stats)."""
        s = self.scores(layer, distance)
        if s.shape[1] == 0:
            return np.zeros((s.shape[0], 0), dtype=np.int64)
        pred = np.argsort(-s, axis=1, kind="stable")[:, : self.k]  # [T, k]
        self.pending.setdefault(self.pos[layer] + distance, []).append((distance, pred))
        return pred

    def predict_counts(self, layer: int, distance: int) -> dict[int, int]:
        """{expert: predicted tokens} of `predict` (empty past the last MoE layer)."""
        pred = self.predict(layer, distance)
        bc = np.bincount(pred.ravel(), minlength=1)
        nz = np.flatnonzero(bc)
        return dict(zip(nz.tolist(), bc[nz].tolist(), strict=True))

    def reset_stats(self) -> None:
        """Forget the accuracy counters (not what was learned): e.g. after a warm-up."""
        self.predicted[:] = 0
        self.correct[:] = 0

    def stats(self) -> dict[int, dict[str, float]]:
        """Per distance: predicted (token, expert) pairs, correct ones, and their ratio."""
        return {
            d: {"predicted": int(self.predicted[d]), "correct": int(self.correct[d]),
                "accuracy": float(self.correct[d] / self.predicted[d]) if self.predicted[d] else 0.0}
            for d in range(1, self.depth + 1)
        }  # fmt: skip


__all__ = ["MARGINAL_WEIGHT", "RouteHistoryPredictor"]
