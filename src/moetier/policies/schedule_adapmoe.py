"""AdapMoE (Zhong et al., ICCAD 2024; HybriMoE's "SOTA for GPU-centric MoE scheduling" baseline, VI-A3).

HybriMoE's baseline is AdapMoE as HybriMoE describes it: "minimizing on-demand loading overhead through adaptive
prefetching and caching" (VI-A3), with an LRU cache (Table I) and no CPU computation. That is this file's
`adapmoe` (the default comparison): on-demand loading, distance-1 prefetch, per-layer LRU caches sized by the DP;
**no adaptive gating**, so every routed expert is computed and the model's output is the reference's. AdapMoE's
own adaptive gating, which drops routed experts and so changes the model's output, is the labelled variant
`adapmoe-gated` (policies/schedule_adapmoe_gated.py), reported beside it; the gating helpers live here.

What the paper says it does (arXiv 2408.10284, abstract and README of PKU-SEC-Lab/AdapMoE):
- "a sensitivity-based strategy to adjust the number of activated experts dynamically": a token whose
  router is confident uses fewer experts. Its code (src/custom_layers.py) does this at decode with one
  token: with Mixtral's top-2, "if routing_weights[0][1] < self.threshold" (the renormalised weight of the
  second expert under a per-layer threshold set from a Hessian/Fisher sensitivity study), only the top-1
  expert is computed. The paper reports "reducing the average number of activated experts by 25%";
- "Adaptive Expert Prefetching: Leverages activation similarities across layers to prefetch experts":
  the next layer's gate applied to the current hidden state, top-k, prefetched at decode (distance 1);
- "Dynamic Cache Allocation: Optimizes GPU cache allocation across layers using a DP-based formulation";
  experts are GPU-only: a miss is loaded on demand (HybriMoE Table I: no CPU computation, LRU cache).

What this file models:
- the schedule: GPU only; cached experts first, misses moved on demand, heaviest first, then computed on
  the GPU (gpu-lru's `moved_timeline`); moved experts are admitted into an LRU cache;
- adaptive gating, in the `adapmoe-gated` variant only (it declares `gates`; the caller applies it to decode
  calls: sim/run.py): `gated_counts` keeps, per token, the top-1 expert and every other routed expert whose
  renormalised weight is at least the threshold; `fit_gate_threshold` sets one threshold so that a fraction
  `drop` (SimConfig.gate_drop, default AdapMoE's 25%) of the routed experts of a calibration window (the
  warm-up) is dropped;
- prefetch: the caller's prefetcher at distance 1 (benchmarks/hybrid_sim.py runs it with prefetch_depth 1);
- dynamic cache allocation (`cache_alloc = "dp"`, applied by the caller: sim/run.py): one LRU cache per MoE
  layer instead of one global cache, sized by policies/cache_alloc.py: each layer's misses as a function of
  its cache size are measured on the calibration window (the warm-up, from the warm cache; gated like the
  decode calls in the gated variant), and an exact DP (a knapsack over layers, as AdapMoE's src/dp.py)
  splits the slot budget to minimise their sum. SimConfig.cache_alloc "global" restores the single global LRU cache.

Simplifications (each named; the first two and the last concern the gated variant only): one threshold for all
layers instead of per-layer sensitivity thresholds (the paper's Hessian study needs the model); for top-k > 2
(Qwen2, DeepSeek) the top-2 rule is generalised to "drop any non-top-1 expert under the threshold" (AdapMoE
was built for Mixtral's top-2); the DP's cost per layer is the LRU misses measured on the warm-up window,
where AdapMoE's code uses an analytic expected load per token (uniform routing over Mixtral's 8 experts,
weighted by a profiled per-layer prefetch accuracy and top-1 share): the measured curve keeps the routing's
skew and works for any E and top-k, but a miss the prefetch would cover still counts (the sizes are solved
once, before the replay, as AdapMoE's run.py solves them once at start); the simulator predicts with its own
predictor (sim/predict.py), not the next gate on the hidden state; gating never changes the model's output
here (the paper measures its accuracy cost; a trace replay cannot).

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); nothing runs on `cpu`;
`gated_counts` keeps at least one expert per token and never adds one; a token whose weights are all at
least the threshold keeps all its experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moetier.errors import ConfigError
from moetier.policies.schedule_base import LayerScheduler, moved_timeline


def _weights(ids: object, weights: object) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(ids, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    if a.ndim == 1:
        a, w = a[None, :], w[None, :]
    if a.shape != w.shape or a.ndim != 2:
        raise ConfigError(f"adaptive gating: ids {a.shape} and weights {w.shape} must both be [T, k]")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ConfigError("adaptive gating: weights must be finite and >= 0")
    return a, w


def _renormalised(w: np.ndarray) -> np.ndarray:
    """Weights [T, k] per token divided by their sum, columns sorted descending."""
    s = w.sum(1, keepdims=True)
    s[s == 0] = 1.0
    return -np.sort(-w / s, axis=1)  # [T, k]


def gated_counts(ids: object, weights: object, threshold: float) -> dict[int, int]:
    """{expert: tokens} after adaptive gating: per token the top-1 expert (largest weight) and each other
    expert whose renormalised weight is >= threshold."""
    a, w = _weights(ids, weights)
    if a.size == 0:
        return {}
    wn = w / np.where(w.sum(1, keepdims=True) > 0, w.sum(1, keepdims=True), 1.0)  # [T, k]
    top = np.argmax(wn, axis=1)  # [T]
    keep = wn >= threshold  # [T, k]
    keep[np.arange(a.shape[0]), top] = True
    bc = np.bincount(a[keep], minlength=1)
    nz = np.flatnonzero(bc)
    return dict(zip(nz.tolist(), bc[nz].tolist(), strict=True))


def fit_gate_threshold(weights: Sequence[object], drop: float) -> float:
    """The threshold that drops a fraction `drop` of all routed experts in `weights` (a list of [T, k] arrays):
    a quantile of the non-top-1 renormalised weights (0.0 when drop is 0 or there are none)."""
    if not 0.0 <= drop < 1.0:
        raise ConfigError(f"adaptive gating: drop must be in [0, 1), got {drop}")
    rest = [_renormalised(np.atleast_2d(np.asarray(w, dtype=np.float64)))[:, 1:].ravel() for w in weights]
    vals = np.concatenate(rest) if rest else np.zeros(0)
    if drop == 0.0 or vals.size == 0:
        return 0.0
    k = 1 + vals.size / sum(np.atleast_2d(np.asarray(w)).shape[0] for w in weights)  # experts per token
    q = min(1.0, drop * k / (k - 1))  # share of the non-top-1 experts to drop
    return float(np.quantile(vals, q, method="higher")) if q < 1.0 else float(np.inf)


class AdapMoEScheduler(LayerScheduler):
    name = "adapmoe"
    admits = True
    placement = "frequency"
    cache_policy = "lru"  # HybriMoE Table I
    gates = False  # HybriMoE VI-A3: "adaptive prefetching and caching"; gating is adapmoe-gated's
    cache_alloc = "dp"  # the caller sizes one cache per MoE layer with policies/cache_alloc.py (sim/run.py)

    plan = staticmethod(moved_timeline)


__all__ = ["AdapMoEScheduler", "fit_gate_threshold", "gated_counts"]
