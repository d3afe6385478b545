"""Routing statistics of a trace: the numbers the synthetic generator is fitted to and judged by.

A trace is viewed as `Routing`: the prefill chunk (step 0 when its row count differs from the batch)
as ids [P*B, L, k] and the decode steps as ids [S, B, L, k] (token index = sequence in the batch), over
the trace's MoE layers in ascending order. Statistics (each a mean over layers, or layer pairs):
- `top10_share`: share of routed (token, expert) assignments taken by the 10% most loaded experts;
  `bottom70_share`: by the 70% least loaded (TriMoE 3.1's "cold" experts); `class_shares` in general.
- `reuse`: step-to-step reuse, |S_t & S_t+1| / k for one sequence and layer over consecutive decode
  steps; `reuse_indep` is what independent draws from the same per-layer loads would give.
- `layer_pred`: adjacent-layer predictability; the top-k of sum_{e in S_l} P(f | e), with P(f | e) the
  trace's own co-activation frequencies of layer l -> l+1, overlaps S_l+1 by this fraction (in-sample;
  compare traces of equal size); `layer_pred_base` predicts the top-k most loaded experts instead.
- `drift_corr`: Pearson correlation of per-expert decode loads in the first and second half of the trace.
- `topk_mass`: mean router probability mass of the top-k experts (None without scores).

Invariants: pure numpy, no torch; every statistic is a deterministic function of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moetier.errors import TraceError
from moetier.traces import Trace, iter_calls


@dataclass(frozen=True)
class Routing:
    """A trace's routing as arrays; see the module docstring."""

    prefill: np.ndarray  # [P*B, L, k] int64 (P*B may be 0)
    decode: np.ndarray  # [S, B, L, k] int64
    num_experts: int
    topk_mass: float | None = None


def routing_of(trace: Trace) -> Routing:
    """Arrange a trace's calls as `Routing`. Raises TraceError when a step lacks a layer or the batch
    changes between decode steps."""
    # 1. group the calls by step
    calls = iter_calls(trace)
    if not calls:
        raise TraceError("trace has no rows")
    E, k = int(trace.metadata["num_experts"]), int(trace.metadata["top_k"])
    layers = sorted({c.layer for c in calls})
    by_step: dict[int, dict[int, np.ndarray]] = {}
    mass: list[float] = []
    for c in calls:
        by_step.setdefault(c.step, {})[c.layer] = c.ids
        if c.scores is not None:
            top = -np.partition(-c.scores, k - 1, axis=1)[:, :k]  # [T, k]
            mass.append(float(top.sum(1).mean()) * len(c.scores))
    steps = sorted(by_step)
    for s in steps:
        if sorted(by_step[s]) != layers:
            raise TraceError(f"trace step {s} has layers {sorted(by_step[s])}, expected {layers}")
    # 2. the batch is the most common row count; a first step of another size is the prefill chunk
    sizes = [len(by_step[s][layers[0]]) for s in steps]
    rest = sizes[1:] or sizes
    batch = max(set(rest), key=rest.count)
    first_is_prefill = len(steps) > 1 and sizes[0] != batch
    pre_steps, dec_steps = (steps[:1], steps[1:]) if first_is_prefill else ([], steps)
    bad = [s for s in dec_steps if len(by_step[s][layers[0]]) != batch]
    if bad:
        raise TraceError(f"trace decode step {bad[0]} has {len(by_step[bad[0]][layers[0]])} tokens, batch is {batch}")
    prefill = (
        np.stack([by_step[pre_steps[0]][la] for la in layers], axis=1) if pre_steps else np.zeros((0, len(layers), k))
    )  # [P*B, L, k]
    decode = np.stack([np.stack([by_step[s][la] for la in layers], axis=1) for s in dec_steps])  # [S, B, L, k]
    rows = sum(len(c.ids) for c in calls)
    return Routing(prefill.astype(np.int64), decode.astype(np.int64), E, sum(mass) / rows if mass else None)


def _loads(r: Routing) -> np.ndarray:
    """Per-layer expert loads over every token: [L, E]."""
    L, k = r.decode.shape[2], r.decode.shape[3]
    ids = np.concatenate([r.prefill.reshape(-1, L, k), r.decode.reshape(-1, L, k)])  # [T, L, k]
    flat = (np.arange(L)[None, :, None] * r.num_experts + ids).ravel()
    return np.bincount(flat, minlength=L * r.num_experts).reshape(L, r.num_experts).astype(np.float64)


def sorted_profile(r: Routing) -> np.ndarray:
    """Per-layer expert shares sorted in descending order, averaged over layers: [E], sums to 1."""
    return _sorted_shares(_loads(r))


def _sorted_shares(loads: np.ndarray) -> np.ndarray:
    """`sorted_profile` from the per-layer loads [L, E]."""
    shares = loads / np.maximum(loads.sum(1, keepdims=True), 1.0)
    return np.asarray(-np.sort(-shares, axis=1).mean(0))


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a & b| per row of two [..., k] id arrays (ids within a row distinct)."""
    return np.asarray((a[..., :, None] == b[..., None, :]).sum((-1, -2)))


def _reuse(r: Routing) -> float:
    S, k = r.decode.shape[0], r.decode.shape[3]
    if S < 2:
        return float("nan")
    total = 0.0
    for a in range(0, S - 1, 64):  # chunks keep the [s, B, L, k, k] comparison small
        b = min(a + 64, S - 1)
        total += float(_overlap(r.decode[a:b], r.decode[a + 1 : b + 1]).sum())
    return total / ((S - 1) * r.decode.shape[1] * r.decode.shape[2] * k)


def _layer_pred(r: Routing) -> tuple[float, float]:
    """(co-activation predictor overlap, popularity predictor overlap), mean over adjacent layer pairs."""
    L, k, E = r.decode.shape[2], r.decode.shape[3], r.num_experts
    if L < 2:
        return float("nan"), float("nan")
    ids = np.concatenate([r.prefill.reshape(-1, L, k), r.decode.reshape(-1, L, k)])  # [T, L, k]
    pred, base = [], []
    for la in range(L - 1):
        a, b = ids[:, la], ids[:, la + 1]  # [T, k] each
        pairs = (a[:, :, None] * E + b[:, None, :]).ravel()
        co = np.bincount(pairs, minlength=E * E).reshape(E, E).astype(np.float64)  # [E, E] l -> l+1
        cond = co / np.maximum(co.sum(1, keepdims=True), 1.0)  # [E, E] P(f | e)
        guess = np.argsort(-cond[a].sum(1), axis=1, kind="stable")[:, :k]  # [T, k]
        pred.append(_overlap(guess, b).mean() / k)
        top = np.argsort(-np.bincount(b.ravel(), minlength=E), kind="stable")[:k]  # [k]
        base.append(_overlap(np.broadcast_to(top, b.shape), b).mean() / k)
    return float(np.mean(pred)), float(np.mean(base))


def _drift_corr(r: Routing) -> float:
    S, L = r.decode.shape[0], r.decode.shape[2]
    if S < 4:
        return float("nan")
    h = S // 2
    corr = []
    for la in range(L):
        x = np.bincount(r.decode[:h, :, la].ravel(), minlength=r.num_experts).astype(np.float64)
        y = np.bincount(r.decode[h:, :, la].ravel(), minlength=r.num_experts).astype(np.float64)
        if x.std() > 0 and y.std() > 0:
            corr.append(float(np.corrcoef(x, y)[0, 1]))
    return float(np.mean(corr)) if corr else float("nan")


def class_shares(profile: np.ndarray, counts: tuple[int, int, int]) -> tuple[float, float, float]:
    """(hot, warm, cold) token shares of a descending profile cut at (n_hot, n_warm, n_cold) experts."""
    h, w, _ = counts
    return float(profile[:h].sum()), float(profile[h : h + w].sum()), float(profile[h + w :].sum())


def stats_of(r: Routing) -> dict[str, Any]:
    """The statistics of the module docstring, as a flat dict of floats (and shape ints)."""
    return stats_and_profile(r)[0]


def stats_and_profile(r: Routing) -> tuple[dict[str, Any], np.ndarray]:
    """(`stats_of(r)`, `sorted_profile(r)`), the expert loads counted once."""
    E = r.num_experts
    S, B, L, k = r.decode.shape
    loads = _loads(r)  # [L, E]
    prof = _sorted_shares(loads)  # [E]
    n10, n70 = max(1, round(0.1 * E)), int(0.7 * E)
    q = loads / np.maximum(loads.sum(1, keepdims=True), 1.0) * k  # [L, E] per-token inclusion probabilities
    pred, pred_base = _layer_pred(r)
    stats = {
        "layers": L, "num_experts": E, "top_k": k, "batch": B, "decode_steps": S,
        "prefill_tokens": int(r.prefill.shape[0]),
        "top10_share": float(prof[:n10].sum()),
        "bottom70_share": float(prof[E - n70 :].sum()) if n70 else 0.0,
        "reuse": _reuse(r),
        "reuse_indep": float((q**2).sum(1).mean() / k),
        "layer_pred": pred,
        "layer_pred_base": pred_base,
        "drift_corr": _drift_corr(r),
        "topk_mass": r.topk_mass,
    }  # fmt: skip
    return stats, prof


def trace_stats(trace: Trace) -> dict[str, Any]:
    """`stats_of(routing_of(trace))`."""
    return stats_of(routing_of(trace))
