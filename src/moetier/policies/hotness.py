"""Expert hotness scores fed by the router: how much each expert of each layer is used lately.

`EmaHotness` is DynaExq eq. 2 (paper section 3.2, Algorithm 1 UpdateHotness). For every
token t of a layer, in order, each expert i of that layer is updated:

    S_i <- a * S_i + (1 - a) * g_i(x_t)    if the router selected i for token t
    S_i <- a * S_i                         otherwise (passive decay)

which is S <- a * S + (1 - a) * g_t with g_t the token's gate weights scattered over the E
experts (zero for unselected experts). A call with T tokens is applied in closed form,

    S_new = a^T * S + (1 - a) * sum_t a^(T-1-t) * g_t        # [E]

vectorised with one bincount. Only non-negative powers of a < 1 are formed, so long calls
(thousands of tokens) underflow harmlessly towards 0 and never overflow.

Invariants:
- scores are float64, finite and >= 0; an expert never routed in a layer scores exactly 0;
- splitting a token stream into several `update` calls gives the same scores (up to
  rounding) as one call, and as the naive per-token loop;
- bad input (alpha outside (0, 1), ids out of range, duplicate ids in one token, shape
  mismatch, negative or non-finite weights, unknown layer) raises ValueError naming it.

Other scores (HybriMoE's MRS, plain frequency) belong here as further classes with the
same surface (the `Hotness` protocol); controllers only rely on that protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Hotness(Protocol):
    """What a hotness tracker offers: per-layer scores over the layer's experts, higher = hotter."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def tokens_seen(self) -> int: ...

    def update(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None: ...

    def scores(self, layer: int) -> np.ndarray: ...

    def snapshot(self) -> dict[int, list[float]]: ...


def check_routing(ids: np.ndarray, weights: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate one layer call's routing and return (ids int64 [T, k], weights float64 [T, k]).

    Raises ValueError naming the problem: wrong rank, shape mismatch, id out of [0, E),
    an id repeated within one token, or a negative / non-finite weight. An id of -1 with weight 0 is a pair a
    routing override skipped (policies/routing.py): it is no expert and counts for none.
    """
    ids_a = np.asarray(ids)
    w_a = np.asarray(weights)
    if ids_a.ndim != 2:
        raise ValueError(f"routing ids must have shape [T, k], got shape {ids_a.shape}")
    if w_a.shape != ids_a.shape:
        raise ValueError(f"routing weights shape {w_a.shape} does not match ids shape {ids_a.shape}")
    if ids_a.size and not np.issubdtype(ids_a.dtype, np.integer):
        raise ValueError(f"routing ids must be integers, got dtype {ids_a.dtype}")
    ids_i = ids_a.astype(np.int64, copy=False)  # [T, k]
    w_f = w_a.astype(np.float64, copy=False)  # [T, k]
    if ids_i.size == 0:
        return ids_i, w_f
    skipped = ids_i == -1  # [T, k] pairs a routing override skipped
    lo, hi = int(np.where(skipped, 0, ids_i).min()), int(ids_i.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"routing id {bad} out of range [0, {num_experts})")
    if skipped.any() and (w_f[skipped] != 0).any():
        raise ValueError("a skipped routing pair (id -1) must have weight 0")
    if ids_i.shape[1] > 1:
        srt = np.sort(ids_i, axis=1)  # [T, k]
        dup = np.flatnonzero(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1))
        if dup.size:
            t = int(dup[0])
            raise ValueError(f"token {t} selects an expert twice: ids {ids_i[t].tolist()}")
    if not np.isfinite(w_f).all():
        raise ValueError("routing weights contain NaN or infinity")
    if (w_f < 0).any():
        raise ValueError(f"routing weights must be >= 0, got minimum {float(w_f.min())}")
    return ids_i, w_f


class EmaHotness:
    """DynaExq EMA hotness (eq. 2) for a set of MoE layers with `num_experts` experts each.

    `alpha` is the per-token decay factor a in (0, 1): the score's memory is about
    1 / (1 - a) tokens (half-life ln 0.5 / ln a tokens).
    """

    def __init__(self, layers: Sequence[int], num_experts: int, alpha: float) -> None:
        layer_t = tuple(int(layer) for layer in layers)
        if not layer_t:
            raise ValueError("EmaHotness needs at least one layer")
        if len(set(layer_t)) != len(layer_t):
            raise ValueError(f"layers contain duplicates: {list(layer_t)}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not (math.isfinite(alpha) and 0.0 < alpha < 1.0):
            raise ValueError(f"alpha must lie in the open interval (0, 1), got {alpha}")
        self._layers = layer_t
        self._num_experts = int(num_experts)
        self._alpha = float(alpha)
        self._row = {layer: i for i, layer in enumerate(layer_t)}
        self._scores = np.zeros((len(layer_t), self._num_experts), dtype=np.float64)  # [L, E]
        self._tokens = np.zeros(len(layer_t), dtype=np.int64)  # [L]

    @property
    def layers(self) -> tuple[int, ...]:
        return self._layers

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def tokens_seen(self) -> int:
        """Tokens through the model: the largest per-layer token count (each token passes every layer once)."""
        return int(self._tokens.max())

    def layer_tokens(self, layer: int) -> int:
        """Tokens observed by one layer."""
        return int(self._tokens[self._index(layer)])

    def _index(self, layer: int) -> int:
        try:
            return self._row[layer]
        except KeyError:
            raise ValueError(f"unknown layer {layer}; tracked layers: {list(self._layers)}") from None

    def update(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Apply eq. 2 for the T tokens of one layer call, in token order. ids, weights: [T, k]."""
        row = self._index(layer)
        ids_i, w_f = check_routing(ids, weights, self._num_experts)
        n_tok = ids_i.shape[0]
        if n_tok == 0:
            return
        a = self._alpha
        decay = a ** np.arange(n_tok - 1, -1, -1, dtype=np.float64)  # [T] a^(T-1-t), in (0, 1]
        contrib = (1.0 - a) * decay[:, None] * w_f  # [T, k]
        live = ids_i.ravel() >= 0  # -1: a pair a routing override skipped (weight 0)
        added = np.bincount(ids_i.ravel()[live], weights=contrib.ravel()[live], minlength=self._num_experts)  # [E]
        self._scores[row] = (a**n_tok) * self._scores[row] + added
        self._tokens[row] += n_tok

    def scores(self, layer: int) -> np.ndarray:
        """A copy of one layer's scores, [E] float64."""
        return self._scores[self._index(layer)].copy()

    def snapshot(self) -> dict[int, list[float]]:
        """Plain-data copy of every layer's scores: layer -> [E] floats."""
        return {layer: self._scores[i].tolist() for i, layer in enumerate(self._layers)}

    def load(self, scores: Mapping[int, Sequence[float]]) -> None:
        """Overwrite the scores of the given layers (e.g. from an earlier `snapshot()`); token counts stay."""
        rows: dict[int, np.ndarray] = {}
        for layer, values in scores.items():
            row = self._index(layer)
            arr = np.asarray(values, dtype=np.float64)  # [E]
            if arr.shape != (self._num_experts,):
                raise ValueError(f"layer {layer}: expected {self._num_experts} scores, got shape {arr.shape}")
            if not np.isfinite(arr).all() or (arr < 0).any():
                raise ValueError(f"layer {layer}: scores must be finite and >= 0")
            rows[row] = arr
        for row, arr in rows.items():  # all validated first: a bad layer leaves the tracker untouched
            self._scores[row] = arr
