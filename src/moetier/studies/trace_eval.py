"""Expert caches and expert predictors on a routing trace, each beside a shuffled null and simple baselines.

What people who evaluate expert caches on real models report, computed on any trace in the project's schema
(`moetier.traces`; recorded, synthetic or third-party). numpy only; no torch.

- **Shuffled null** (`shuffle_tokens`): per MoE layer, the rows (top-k ids with their weights and scores)
  of all the layer's calls are permuted by a seeded random permutation of that layer's own, then put back
  into the same call sizes. Per-(layer, expert) counts are preserved exactly; step-to-step (temporal) and
  layer-to-layer (same token) correlation are destroyed. A policy or predictor that beats its null exploits
  correlation; one that only matches it exploits popularity alone.
- **Cache baselines** (hit rate = hits / accesses, an access being one unique expert of one layer call, as
  `moetier.sim.cache_replay`): `prev_token_hits` -- each layer's cache is exactly the experts its previous
  call used (size k per layer at batch 1; the first call of a layer misses); `most_frequent_hits` -- each
  layer's cache is the `slots` experts with the highest running count of routed tokens before the call
  (ties to the lower id; an expert never routed is not cached).
- **TriMoE's load predictor** (`load_predictor_stats`): `policies.predictor.LoadPredictor` (eq. 8 EMA, a
  = 0.3, FractionRule classes: top 5% hot, next 25% warm) fed each call's loads in trace order; its
  `PredictorStats` (class accuracy, hot precision / recall, ...). Baselines through the same scoring:
  `alpha=1` predicts the previous call's classes, `running_count_stats` the classes of the running counts
  (most-frequent-so-far). With 8 experts FractionRule has no hot class (floor(0.05 * 8) = 0), so hot
  recall is 0 by construction.
- **Next-layer expert prediction** (`next_layer_accuracy`): for token t at layer l, guess the top-k of layer
  l + d (d = 1..3) from what is known then (token t's routing up to layer l, all earlier tokens' routing);
  accuracy = mean |guess & actual| / k over tokens t >= 1 and layers l with l + d a MoE layer. Predictors
  (`NEXT_LAYER`): `prev-token` (the experts token t-1 used at layer l+d), `most-frequent` (the k experts of
  layer l+d with the highest running count), `co-activation` (online: the top-k of sum over e in S_l(t) of
  the counts of (e at l, f at l+d) over earlier tokens, ties broken by the running count). Extra
  predictors (e.g. a trace-side history predictor) plug in as `NextLayerPredictor` callables.

Token streams (`token_rows`): the rows of each layer in trace order stacked as [N, L, k]; this needs every
layer to hold the same number of rows (a batch-1 stream, or equal batches), which is a TraceError otherwise.
At batch > 1 the "previous token" of the stream is the previous row, not the same sequence's previous step.

Invariants: deterministic for a given seed; the null keeps every call's size, step and layer; counts are
integers and hits <= accesses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moetier.errors import ConfigError, TraceError
from moetier.policies.predictor import FractionRule, LoadPredictor, PredictorStats
from moetier.traces import Call


@dataclass(frozen=True)
class BaselineHits:
    """Hit counts of a cache baseline; `slots_per_layer` is the mean number of experts it held per call."""

    name: str
    hits: int
    accesses: int
    slots_per_layer: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


# -- the shuffled null -------------------------------------------------------------------------------------
def shuffle_tokens(calls: Sequence[Call], seed: int) -> list[Call]:
    """The calls with each layer's rows permuted among that layer's calls (module docstring)."""
    by_layer: dict[int, list[int]] = {}
    for i, c in enumerate(calls):
        by_layer.setdefault(int(c.layer), []).append(i)
    out: list[Call | None] = [None] * len(calls)
    for layer, idx in sorted(by_layer.items()):
        rng = np.random.default_rng([int(seed), layer])
        ids = np.concatenate([np.asarray(calls[i].ids) for i in idx])  # [R, k]
        w = np.concatenate([np.asarray(calls[i].weights) for i in idx])  # [R, k]
        has_s = all(calls[i].scores is not None for i in idx)
        s = np.concatenate([np.asarray(calls[i].scores) for i in idx]) if has_s else None  # [R, E]
        perm = rng.permutation(len(ids))  # [R]
        ids, w = ids[perm], w[perm]
        s = None if s is None else s[perm]
        at = 0
        for i in idx:
            n = len(calls[i].ids)
            c = calls[i]
            out[i] = Call(c.step, c.layer, ids[at : at + n], w[at : at + n], None if s is None else s[at : at + n])
            at += n
    return [c for c in out if c is not None]


def expert_counts(calls: Sequence[Call], num_experts: int) -> dict[int, np.ndarray]:
    """Routed tokens per expert of each layer: layer -> [E] int64."""
    out: dict[int, np.ndarray] = {}
    for c in calls:
        ids = np.asarray(c.ids).ravel()
        _check_ids(ids, num_experts, c)
        cnt = out.setdefault(int(c.layer), np.zeros(num_experts, dtype=np.int64))
        cnt += np.bincount(ids, minlength=num_experts)
    return out


def _check_ids(ids: np.ndarray, num_experts: int, c: Call) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise TraceError(f"step {c.step} layer {c.layer}: expert id out of range [0, {num_experts})")


# -- cache baselines ---------------------------------------------------------------------------------------
def prev_token_hits(calls: Sequence[Call], num_experts: int) -> BaselineHits:
    """Each layer caches exactly the experts of its previous call."""
    last: dict[int, set[int]] = {}
    hits = acc = held = held_n = 0
    for c in calls:
        ids = np.asarray(c.ids)
        _check_ids(ids, num_experts, c)
        now = set(ids.ravel().tolist())
        prev = last.get(int(c.layer), set())
        hits += len(now & prev)
        acc += len(now)
        held += len(prev)
        held_n += 1
        last[int(c.layer)] = now
    return BaselineHits("prev-token", hits, acc, held / held_n if held_n else 0.0)


def most_frequent_hits(calls: Sequence[Call], num_experts: int, slots: int) -> BaselineHits:
    """Each layer caches the `slots` experts with the highest running token count before the call."""
    if slots < 1:
        raise ConfigError(f"most-frequent baseline needs >= 1 slot per layer, got {slots}")
    counts: dict[int, np.ndarray] = {}
    order = np.arange(num_experts)
    hits = acc = held = 0
    for c in calls:
        ids = np.asarray(c.ids).ravel()
        _check_ids(ids, num_experts, c)
        cnt = counts.setdefault(int(c.layer), np.zeros(num_experts, dtype=np.int64))
        top = np.lexsort((order, -cnt))[:slots]  # [slots] by count desc, ties to the lower id
        cached = top[cnt[top] > 0]
        now = np.unique(ids)
        hits += int(np.isin(now, cached).sum())
        acc += len(now)
        held += len(cached)
        cnt += np.bincount(ids, minlength=num_experts)
    return BaselineHits(f"most-frequent@{slots}", hits, acc, held / len(calls) if calls else 0.0)


# -- TriMoE's load predictor and its baselines -------------------------------------------------------------
def load_predictor_stats(
    calls: Sequence[Call], layers: Sequence[int], num_experts: int, alpha: float = 0.3
) -> dict[str, float]:
    """`LoadPredictor` (eq. 8, FractionRule) fed every call in order; its PredictorStats as a dict."""
    pred = LoadPredictor(layers, num_experts, alpha=alpha)
    for c in calls:
        pred.update_routing(int(c.layer), np.asarray(c.ids))
    return pred.stats.as_dict()


def running_count_stats(calls: Sequence[Call], layers: Sequence[int], num_experts: int) -> dict[str, float]:
    """Most-frequent-so-far as a load predictor: the classes of each layer's running counts, scored by
    `PredictorStats` exactly as `LoadPredictor` scores its EMA (a layer's first call unscored)."""
    rule = FractionRule()
    stats = PredictorStats()
    counts = {int(x): np.zeros(num_experts, dtype=np.float64) for x in layers}  # [E] per layer
    seen = dict.fromkeys(counts, 0)  # calls of the layer so far
    last_cls: dict[int, np.ndarray] = {}  # the layer's last actual classes [E]
    for c in calls:
        layer = int(c.layer)
        if layer not in counts:
            raise ConfigError(f"unknown layer {layer}; tracked layers: {sorted(counts)}")
        ids = np.asarray(c.ids).ravel()
        _check_ids(ids, num_experts, c)
        f = np.bincount(ids, minlength=num_experts).astype(np.float64)  # [E]
        actual = rule.classify(f)
        if seen[layer]:  # the running mean load is the prediction; its classes are the running counts'
            mean = counts[layer] / seen[layer]
            stats.record(mean, rule.classify(mean), f, actual, last_cls[layer])
        counts[layer] += f
        seen[layer] += 1
        last_cls[layer] = actual
    return stats.as_dict()


# -- next-layer expert prediction --------------------------------------------------------------------------
def token_rows(calls: Sequence[Call], layers: Sequence[int] | None = None) -> np.ndarray:
    """The token stream [N, L, k]: each layer's rows in trace order, layers ascending (module docstring)."""
    layer_ids = sorted({int(c.layer) for c in calls}) if layers is None else sorted(int(x) for x in layers)
    rows: dict[int, list[np.ndarray]] = {x: [] for x in layer_ids}
    for c in calls:
        if int(c.layer) not in rows:
            raise TraceError(f"call of layer {c.layer} outside the MoE layers {layer_ids[:8]}")
        rows[int(c.layer)].append(np.asarray(c.ids))
    stacked = [np.concatenate(rows[x]) if rows[x] else np.zeros((0, 0), dtype=np.int64) for x in layer_ids]
    sizes = {len(a) for a in stacked}
    if len(sizes) != 1:
        raise TraceError(f"layers hold different numbers of token rows ({sorted(sizes)[:4]}); no token stream")
    return np.stack(stacked, axis=1).astype(np.int64)  # [N, L, k]


# A predictor of layer l+d's experts: (stream [N, L, k], d, num_experts) -> guesses [N, L-d, k] for tokens
# 0..N-1 at source layers 0..L-d-1, using only token t's rows at layers <= l and earlier tokens' rows.
NextLayerPredictor = Callable[[np.ndarray, int, int], np.ndarray]


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of each row of [..., E], ties to the lower index (stable)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def predict_prev_token(x: np.ndarray, d: int, num_experts: int) -> np.ndarray:
    """Token t-1's experts at layer l+d (token 0: its own layer-l ids, never scored)."""
    guess = np.empty_like(x[:, d:])  # [N, L-d, k]
    guess[1:] = x[:-1, d:]
    guess[:1] = x[:1, : x.shape[1] - d]
    return guess


def _running_counts(x: np.ndarray, num_experts: int) -> np.ndarray:
    """counts[t, l, e]: routed tokens of expert e at layer l over tokens < t: [N, L, E]."""
    N, L, _ = x.shape
    onehot = np.zeros((N, L, num_experts), dtype=np.int32)
    np.add.at(onehot, (np.arange(N)[:, None, None], np.arange(L)[None, :, None], x), 1)
    return np.concatenate([np.zeros((1, L, num_experts), np.int32), np.cumsum(onehot, axis=0)[:-1]])


def predict_most_frequent(x: np.ndarray, d: int, num_experts: int) -> np.ndarray:
    """The k experts of layer l+d with the highest running count over earlier tokens."""
    k = x.shape[2]
    return _topk(_running_counts(x, num_experts)[:, d:].astype(np.float64), k)  # [N, L-d, k]


def predict_coactivation(x: np.ndarray, d: int, num_experts: int) -> np.ndarray:
    """Online co-activation counts (e at l, f at l+d) over earlier tokens, summed over token t's experts at
    l; ties broken by layer l+d's running count."""
    N, L, k = x.shape
    E, P = num_experts, L - d
    co = np.zeros((P, E, E), dtype=np.float64)  # [L-d, E, E]
    freq = np.zeros((P, E), dtype=np.float64)  # [L-d, E] running counts of layer l+d
    guess = np.empty((N, P, k), dtype=np.int64)
    li = np.arange(P)[:, None]  # [L-d, 1]
    src, dst = x[:, :P], x[:, d:]  # [N, L-d, k]
    for t in range(N):
        score = co[li, src[t]].sum(1) + freq / (freq.sum(1, keepdims=True) + 1.0)  # [L-d, E]; tie-break < 1
        guess[t] = _topk(score, k)
        co[li[:, :, None], src[t][:, :, None], dst[t][:, None, :]] += 1.0  # every (e, f) pair of token t
        np.add.at(freq, (li, dst[t]), 1.0)
    return guess


NEXT_LAYER: dict[str, NextLayerPredictor] = {
    "prev-token": predict_prev_token,
    "most-frequent": predict_most_frequent,
    "co-activation": predict_coactivation,
}


def next_layer_accuracy(
    x: np.ndarray, predictor: NextLayerPredictor, num_experts: int, distances: Sequence[int] = (1, 2, 3)
) -> dict[int, float]:
    """Mean |guess & actual| / k over tokens t >= 1 and source layers, per distance (module docstring)."""
    N, L, k = x.shape
    out: dict[int, float] = {}
    for d in distances:
        if not 1 <= d < L or N < 2:
            continue
        guess = np.asarray(predictor(x, d, num_experts))
        if guess.shape != (N, L - d, k):
            raise ConfigError(f"next-layer predictor gave shape {guess.shape}, expected {(N, L - d, k)}")
        actual = x[1:, d:]  # [N-1, L-d, k]
        both = (guess[1:, :, :, None] == actual[:, :, None, :]).any(-1).sum(-1)  # [N-1, L-d] distinct guesses
        out[d] = float(both.mean() / k)
    return out
