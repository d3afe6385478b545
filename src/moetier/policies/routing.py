"""Overrides of the router's decision: fewer active experts per token, pruned experts, REAP saliency.

Pure functions over numpy arrays (no torch, no I/O), shared by the engine's two routing sites (the native
step's `_mlp` and TieredMoE's torch path, through runtime/route_override.py) and by tests.

- `reduce_routing` (a user's lever, llama.cpp forks' "smart expert reduction" in spirit): per token, keep at most
  `max_k` of its routed (expert, weight) pairs, the heaviest first, and drop a pair whose *renormalised* weight
  (its weight over the sum of the token's top-k weights) is below `threshold`. The heaviest pair is always kept,
  so every token computes at least one expert. A dropped pair becomes id -1 with weight 0: "no expert", which the
  native MoE half (csrc/step.c) and the torch executors skip, so a dropped expert is never read. With
  `renormalize`, the kept weights are scaled to the sum the token's top-k weights had (1 for routers that
  renormalise their top-k), else they keep their router values (the dropped mass is lost).
- `route_pruned`: the router's top-k recomputed from its logits with pruned experts masked out, i.e. the router
  of a model whose pruned experts were removed (their rows of the router weight deleted): softmax over the
  remaining experts, top-k (ties: lower id first, as the native router), renormalised as the family's router
  renormalises, weights rounded to bf16 where the family's router rounds them.
- `reap_saliency` / `choose_pruned`: REAP's saliency of an expert (the mean, over the tokens routed to it, of its
  gate weight times the L2 norm of its output) and the least salient experts of each layer.

Invariants: `reduce_routing` with threshold 0 and max_k >= k returns its input unchanged (same ids, same weights,
bit for bit); a kept pair keeps its position in the row; every row keeps at least one pair.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

NO_EXPERT = -1  # the id of a pair an override skipped


def reduction_is_noop(threshold: float, max_k: int, top_k: int) -> bool:
    """Whether `reduce_routing(..., threshold, max_k, ...)` leaves a routing of top-k `top_k` unchanged."""
    return threshold <= 0.0 and (max_k <= 0 or max_k >= top_k)


def reduce_routing(
    ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32], threshold: float, max_k: int, renormalize: bool
) -> int:
    """In place: ids [T, k] (int32), weights [T, k] (float32) -> the reduced routing (see the module docstring).
    `max_k` <= 0 means no cap. Returns the number of pairs dropped."""
    t, k = ids.shape
    if t == 0 or reduction_is_noop(threshold, max_k, k):
        return 0
    w = weights.astype(np.float64)  # [T, k]
    live = ids >= 0  # pairs an earlier override (pruning, a trace) left
    w = np.where(live, w, 0.0)
    total = w.sum(axis=1, keepdims=True)  # [T, 1]
    order = np.argsort(-w, axis=1, kind="stable")  # [T, k] heaviest first, ties: earlier position first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(k)[None, :].repeat(t, 0), axis=1)  # [T, k] each pair's rank
    keep = live.copy()
    if 0 < max_k < k:
        keep &= rank < max_k
    if threshold > 0.0:
        share = np.divide(w, total, out=np.zeros_like(w), where=total > 0)  # renormalised weight [T, k]
        keep &= (share >= threshold) | (rank == 0)
    drop = live & ~keep
    n = int(drop.sum())
    if n == 0:
        return 0
    if renormalize:
        kept = np.where(keep, w, 0.0).sum(axis=1, keepdims=True)  # [T, 1]
        scale = np.divide(total, kept, out=np.ones_like(kept), where=kept > 0)
        new = np.where(keep, w * scale, 0.0)
        rows = drop.any(axis=1)  # rows left alone keep their weights bit for bit
        weights[rows] = new[rows].astype(np.float32)
    weights[drop] = 0.0
    ids[drop] = NO_EXPERT
    return n


def route_pruned(
    logits: npt.NDArray[np.float32], pruned: npt.NDArray[np.bool_], top_k: int, router: str, norm_topk: bool
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """Router logits [T, E] (fp32 values) and pruned [E] -> (ids [T, k] int32, weights [T, k] float32) of the
    router without the pruned experts. `router`: the family's native router ("softmax_topk",
    "softmax_topk_renorm", "topk_softmax"); `norm_topk`: whether it renormalises its top-k."""
    x = np.where(pruned[None, :], -np.inf, logits.astype(np.float32))  # [T, E]
    order = np.argsort(-x, axis=1, kind="stable")[:, :top_k]  # [T, k] ties: lower id first
    top = np.take_along_axis(x, order, axis=1)  # [T, k]
    if router == "topk_softmax":  # softmax over the top-k logits
        e = np.exp(top - top[:, :1])
        w = e / e.sum(axis=1, keepdims=True)
    else:  # softmax over the remaining experts, then the top-k of it
        m = x.max(axis=1, keepdims=True)
        p = np.exp(x - m)
        p /= p.sum(axis=1, keepdims=True)
        w = np.take_along_axis(p, order, axis=1)
        if norm_topk or router == "softmax_topk_renorm":
            w = w / w.sum(axis=1, keepdims=True)
    w = w.astype(np.float32)
    if router in ("softmax_topk", "topk_softmax"):  # the family rounds its weights to bf16 (csrc/step.c round_w)
        w = _round_bf16(w)
    return order.astype(np.int32), w


def _round_bf16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """fp32 -> the nearest bf16 value (round to nearest even), as fp32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).astype(np.uint32)
    return r.view(np.float32)


def reap_saliency(weight_norm_sum: npt.NDArray[np.float64], tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """Per expert of one layer: sum over its routed tokens of gate weight x ||expert output||_2 ([E]), and the
    count of those tokens ([E]) -> REAP's saliency, their mean ([E]; 0 for an expert no token routed to)."""
    return np.divide(weight_norm_sum, tokens, out=np.zeros_like(weight_norm_sum), where=tokens > 0)


def choose_pruned(saliency: Mapping[int, npt.NDArray[np.float64]], fraction: float, top_k: int) -> dict[int, list[int]]:
    """Layer -> saliency [E] -> layer -> the round(fraction * E) least salient experts (ascending id; ties: lower
    id pruned first), at most E - top_k of them (a token still finds top_k experts)."""
    out: dict[int, list[int]] = {}
    for layer, s in saliency.items():
        e = len(s)
        n = min(round(fraction * e), e - top_k)
        order = np.argsort(s, kind="stable")[: max(n, 0)]
        out[layer] = sorted(int(i) for i in order)
    return out


__all__ = ["NO_EXPERT", "choose_pruned", "reap_saliency", "reduce_routing", "reduction_is_noop", "route_pruned"]
