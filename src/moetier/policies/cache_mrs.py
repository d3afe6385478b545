"""Minus Recent Score (MRS) eviction, HybriMoE section IV-D, eq. 3.

Every expert of a layer carries a priority S. Each call of that layer updates all of them:

    S <- alpha * TopP(s) + (1 - alpha) * S          # [E]

where s is the router's probability vector of the call (`on_route`, summed over the call's
tokens) and TopP keeps its p largest entries and zeroes the rest (the paper: reuse probability
is flat below the top scores; p = 2 * top_k by default). The victim is the candidate with the
lowest S; ties go to the least recently used (insert or access) candidate. A key is an
(layer, expert) pair (`ExpertKey`); a layer never routed has S = 0.

`normalize=True` divides s by its sum before TopP, so a prefill chunk of T tokens (whose
probability sum is T) updates S as much as one decode token instead of T times as much.

Choice of alpha = 0.05 (benchmarks/cache_hits.py: cold cache, all calls incl. prefill, one global
cache; 4 recorded bundled-model traces of 200 tokens, 1000-step synthetic presets; hit rate of MRS
minus LRU's, in points, at cache ratio 0.25 / 0.5):

    alpha               0.02         0.05         0.1          0.2          0.5          1.0
    bundled (LRU 45.0)  +10.5/+4.0   +10.1/+4.2   +9.8/+4.0    +8.8/+3.3    +6.9/+1.5    +1.3/+0.4
    qwen2-57b (72.1)    +9.5/-0.0    +10.1/+0.1   +10.3/+0.1   +9.6/+0.1    +6.6/+0.1    +2.0/+0.0
    dsv2-lite (71.7)    +10.1/-0.0   +10.7/+0.0   +10.6/+0.0   +9.0/+0.0    +5.6/+0.1    +1.7/+0.0
    mixtral (34.3)      -1.4/+7.1    -1.3/+7.2    -1.8/+6.7    -2.2/+6.2    -2.3/+6.2    -1.5/+4.1

A long memory wins on these traces (their expert popularity does not drift); 0.05 is within
0.5 points of the best alpha everywhere. With drifting popularity a larger alpha would be due;
measure with `moetier replay --alpha`.

Why MRS loses to LRU on synthetic Mixtral at 0.25 (measured, scratch replays of the same preset
trace, 1000 steps; no change to eq. 3 fixes it, so none is made):
- The cache is one global pool of 64 slots for 32 layers x 2 experts per call. A per-layer split
  (2 slots each) is degenerate: every call needs both slots, so every policy holds exactly the last
  call's experts and ties LRU (34.3). Whatever MRS gains or loses comes from letting some layers
  keep more than 2 experts between calls at the expense of others.
- What S can know is popularity plus the current scores. Knowing the future counts, the best static
  pick (each layer's 2 most used experts) hits 30.8%; the best 64 over all layers 31.0%. The preset's
  skew is mild (per-layer access shares 16.3% .. 9.5%, uniform 12.5%), while the last step's experts
  come back with probability 0.345 (others 0.218): recency beats popularity, which LRU keeps
  exactly. Reuse by score rank of the last step: 0.374, 0.315 (selected), 0.284, 0.256, ... 0.154.
- The generator knob that decides it is the AR(1) temporal correlation of the routing (0.19 in
  every preset, fitted on the bundled model, not on Mixtral). MRS minus LRU at 0.25 for temporal
  0 / 0.05 / 0.1 / 0.15 / 0.19 / 0.4: +4.7 / +3.2 / +1.8 / +0.1 / -1.3 / -8.7 (LRU 27.4 / 29.1 /
  30.9 / 32.8 / 34.3 / 43.1). The paper's Mixtral LRU of 30.2% sits near temporal 0.1; with a bit
  more skew as well (temporal 0.05, warm share 0.72 instead of 0.62) LRU 32.5 -> MRS 38.0 at 0.25
  and 80.6 -> 85.4 at 0.75, close to Fig. 9 (30.2 -> 36.2, 80.6 -> 83.3).
- Not the cause: score sharpness (1.0 / 4.0 instead of 1.87: -1.2 / -1.7), per-layer
  normalisation of S (S / its layer's max at victim time: -1.8; alpha 1: -1.9), p (2 / 4 / 8:
  -1.6 / -1.3 / -1.3), alpha 1 (S = last scores: -1.5), drift 0 (-1.6), layer correlation 0 (-1.9).
- A recency term (S + beta for the experts of each layer's latest call, a departure from eq. 3)
  at most ties LRU here (beta 1: +0.0, 0.1: -0.3, 0.01: -1.1) and costs 1.5 points on synthetic
  Qwen2 / DeepSeek-V2-Lite at beta >= 0.03 (+8.5..8.6 / +9.3 instead of +10.1 / +10.7), so it is not
  offered.

Invariants: S is float64, finite and >= 0; the victim is always one of the candidates, the
resident candidate with the smallest (S, last use). Victim search is vectorised over the
resident experts (numpy), one argmin per eviction.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Any, cast

import numpy as np
from numpy.typing import ArrayLike

from moetier.errors import ConfigError
from moetier.types import ExpertKey

ALPHA_DEFAULT = 0.05


class MRSPolicy:
    def __init__(
        self, top_k: int | None = None, alpha: float | None = None, top_p: int | None = None, normalize: bool = False
    ) -> None:
        alpha = ALPHA_DEFAULT if alpha is None else float(alpha)
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ConfigError(f"MRS alpha must lie in (0, 1], got {alpha}")
        if top_k is not None and top_k < 1:
            raise ConfigError(f"MRS top_k must be >= 1, got {top_k}")
        if top_p is not None and top_p < 1:
            raise ConfigError(f"MRS top_p (experts kept per call) must be >= 1, got {top_p}")
        self.alpha = alpha
        self.top_p = top_p if top_p is not None else (2 * top_k if top_k is not None else None)  # None: keep all
        self.normalize = normalize
        self._row: dict[int, int] = {}  # layer -> row of the arrays below
        self._layers: list[int] = []  # row -> layer
        self._score = np.zeros((0, 0), dtype=np.float64)  # [L, E] priority S
        self._last = np.zeros((0, 0), dtype=np.int64)  # [L, E] tick of last insert/access
        self._resident = np.zeros((0, 0), dtype=bool)  # [L, E]
        self._tick = 0

    @property
    def options(self) -> dict[str, Any]:
        """The knobs in effect (for reports)."""
        return {"alpha": self.alpha, "top_p": self.top_p, "normalize": self.normalize}

    # -- storage ------------------------------------------------------------------
    def _ensure(self, layer: int, experts: int) -> int:
        """Row of `layer`, growing the arrays to hold it and `experts` columns."""
        known = self._row.get(layer)
        n_rows, n_cols = self._score.shape
        if known is not None and experts <= n_cols:
            return known
        rows, cols = n_rows + (1 if known is None else 0), max(n_cols, experts)
        for name, dtype in (("_score", np.float64), ("_last", np.int64), ("_resident", bool)):
            new = np.zeros((rows, cols), dtype=dtype)  # [L', E']
            new[:n_rows, :n_cols] = getattr(self, name)
            setattr(self, name, new)
        if known is not None:
            return known
        self._row[layer] = n_rows
        self._layers.append(layer)
        return n_rows

    def _index(self, key: Hashable) -> tuple[int, int]:
        layer, expert = _pair(key)
        return self._ensure(layer, expert + 1), expert

    def score(self, key: Hashable) -> float:
        """Current priority S of `key` (0 for a layer or expert never routed)."""
        layer, expert = _pair(key)
        row = self._row.get(layer)
        if row is None or expert >= self._score.shape[1]:
            return 0.0
        return float(self._score[row, expert])

    # -- protocol -----------------------------------------------------------------
    def on_route(self, layer: int, scores: ArrayLike) -> None:
        s = np.asarray(scores, dtype=np.float64)  # [E]
        if s.ndim != 1 or s.size == 0:
            raise ValueError(f"layer {layer}: router scores must be a non-empty vector [E], got shape {s.shape}")
        if not np.isfinite(s).all() or (s < 0).any():
            raise ValueError(f"layer {layer}: router scores must be finite and >= 0")
        if self.normalize:
            total = s.sum()
            if total > 0:
                s = s / total
        n = s.size
        if self.top_p is not None and self.top_p < n:
            keep = np.argpartition(s, n - self.top_p)[n - self.top_p :]  # [p] indices of the p largest
            top = np.zeros(n, dtype=np.float64)  # [E]
            top[keep] = s[keep]
            s = top
        row = self._ensure(int(layer), n)
        cur = self._score[row, :n]  # [E] view
        cur *= 1.0 - self.alpha
        cur += self.alpha * s

    def _touch(self, key: Hashable) -> tuple[int, int]:
        row, expert = self._index(key)
        self._tick += 1
        self._last[row, expert] = self._tick
        return row, expert

    def on_insert(self, key: Hashable) -> None:
        row, expert = self._touch(key)
        self._resident[row, expert] = True

    def on_access(self, key: Hashable) -> None:
        self._touch(key)

    def on_evict(self, key: Hashable) -> None:
        layer, expert = _pair(key)
        row = self._row.get(layer)
        if row is not None and expert < self._resident.shape[1]:
            self._resident[row, expert] = False

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        allowed: Any = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        if not allowed:
            raise ValueError("victim() needs at least one candidate")
        n_cols = self._score.shape[1]
        flat = np.where(self._resident, self._score, np.inf).ravel()  # [L*E] S of residents, inf elsewhere
        while True:
            i = int(np.argmin(flat))
            low = flat[i]
            if low == np.inf:
                raise ValueError(f"none of the candidates {sorted(map(str, allowed))[:4]} is tracked by the policy")
            tied = np.flatnonzero(flat == low)  # [n] indices sharing the lowest S
            keys = [ExpertKey(self._layers[j // n_cols], j % n_cols) for j in tied.tolist()]
            ok = [(int(self._last.flat[j]), key) for j, key in zip(tied.tolist(), keys, strict=True) if key in allowed]
            if ok:
                return min(ok)[1]  # least recently used among the tied candidates
            flat[tied] = np.inf  # resident but not a candidate (pinned / in the current call)


def _pair(key: Hashable) -> tuple[int, int]:
    """(layer, expert) of a key; ValueError for anything else or a negative expert id."""
    try:
        layer, expert = cast(tuple[Any, Any], key)
        pair = int(layer), int(expert)
    except (TypeError, ValueError):
        raise ValueError(f"MRS keys are (layer, expert) pairs, got {key!r}") from None
    if pair[1] < 0:
        raise ValueError(f"MRS key {key!r}: negative expert id")
    return pair
