"""Per-layer expert cache allocation (AdapMoE's "Dynamic Cache Allocation", arXiv 2408.10284): how many of a
total number of fast-tier slots each MoE layer's own cache gets, chosen to minimise the expected loads.

Two pure functions:
- `lru_miss_curve`: one layer's misses as a function of its cache size, s = 0..E, measured on a calibration
  window (the simulator's warm-up) for an LRU cache of that layer alone. LRU is a stack algorithm, so one pass
  gives every size: at each call, an expert whose depth in the layer's recency stack is d (0 = most recent;
  never seen = infinite) hits every cache of more than d slots. The stack works at call granularity (the
  caches in the simulator pin a call's experts, so a call never evicts its own experts): depths are read
  before the call, then the call's experts move to the top, the first one given becoming the most recent.
  The stack starts from `initial` (the warm cache's placement order, first = most recent), so a cache of s slots
  starts with the first s experts of that order, as the simulator's does. The curve is exact for an LRU cache of
  at least a call's experts holding initial[:s] with initial[0] the most recent; the simulator warms its cache
  hottest first, which LRU ranks the other way round (the hottest the oldest), so there it is an estimate until
  each warm expert is first touched or evicted. A cache smaller than one call cannot keep the whole call (the
  simulator admits the heaviest misses until every slot is pinned); the stack estimates that case too.
- `allocate_slots`: the slots per layer minimising the summed misses under a total budget, an exact DP
  (a knapsack over layers: best[j] = the fewest misses of the layers so far with exactly j slots;
  O(L * S * E) for L layers, S slots, E experts per layer). Among optimal allocations it takes one that uses
  the most slots (spare slots still help outside the calibration window) and, of those, the most even one
  (the smallest sum of squared slots: a flat stretch of the curves, where the window shows no gain, is split
  evenly instead of going to the first layers); ties beyond that are broken deterministically.

What AdapMoE's own code does (src/dp.py of PKU-SEC-Lab/AdapMoE, read, not copied): the same DP over layers,
but on an analytic cost per layer, the expected on-demand loads per token of Mixtral (8 experts, top-2)
assuming uniformly random routing (a hit with probability size/8), weighted by a per-layer prefetch accuracy
and the share of tokens its gating leaves with one expert, both profiled offline and hard-coded. Here the
curve is measured instead: any E and top-k, the routing's real skew, and, in the simulator, the gating
applied to the calibration window. Not modelled: the prefetch weighting (a load the prefetch covers still
counts as a miss here).

Invariants: `allocate_slots` returns one integer per layer with 0 <= slots[l] <= len(misses[l]) - 1 and
sum(slots) <= budget, and no other such allocation has fewer summed misses; `lru_miss_curve` is
non-increasing in s, its value at s = 0 is the number of accesses. Bad input raises ConfigError naming it.
No torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moetier.errors import ConfigError

CACHE_ALLOCS = ("dp", "global")  # SimConfig.cache_alloc: per-layer caches sized by `allocate_slots`, or one cache


def lru_miss_curve(calls: Sequence[Sequence[int]], num_experts: int, initial: Sequence[int] = ()) -> np.ndarray:
    """Misses [E + 1] of one layer's LRU cache of s = 0..E slots over `calls` (each the distinct experts of one
    call, most recent first), starting from a cache warmed in the order `initial` (the module docstring)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigError(f"lru_miss_curve: num_experts must be an int >= 1, got {num_experts!r}")
    stack = [int(e) for e in initial]
    if len(set(stack)) != len(stack) or any(not 0 <= e < num_experts for e in stack):
        raise ConfigError(f"lru_miss_curve: initial must be distinct experts in [0, {num_experts}), got {stack[:8]}")
    depth_hist = np.zeros(num_experts + 1, dtype=np.int64)  # [E + 1]: index E = never seen (misses at every size)
    for n, call in enumerate(calls):
        experts = [int(e) for e in call]
        if len(set(experts)) != len(experts) or any(not 0 <= e < num_experts for e in experts):
            raise ConfigError(f"lru_miss_curve: call {n} must hold distinct experts in [0, {num_experts}), "
                              f"got {experts[:8]}")  # fmt: skip
        # 1. depths before the call; 2. the call's experts to the top, the first one most recent
        for e in experts:
            depth_hist[stack.index(e) if e in stack else num_experts] += 1
        now = set(experts)
        stack = experts + [e for e in stack if e not in now]
    # misses(s) = accesses at depth >= s
    return np.cumsum(depth_hist[::-1])[::-1].copy()  # [E + 1]


def allocate_slots(misses: Sequence[Sequence[float] | np.ndarray], budget: int) -> list[int]:
    """Slots per layer minimising sum(misses[l][slots[l]]) with sum(slots) <= budget and
    0 <= slots[l] <= len(misses[l]) - 1 (misses[l][s]: layer l's misses with s slots)."""
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget < 0:
        raise ConfigError(f"allocate_slots: budget must be an int >= 0, got {budget!r}")
    curves = [np.asarray(m, dtype=np.float64) for m in misses]
    for n, c in enumerate(curves):
        if c.ndim != 1 or c.size == 0 or not np.isfinite(c).all():
            raise ConfigError(f"allocate_slots: layer {n}'s misses must be a non-empty list of finite numbers "
                              f"(one per cache size 0, 1, ...), got shape {c.shape}")  # fmt: skip
    if not curves:
        return []
    cap = min(int(budget), sum(c.size - 1 for c in curves))
    tol = 1e-9 * max(1.0, sum(float(np.abs(c).max()) for c in curves))  # equal misses, up to rounding
    # 1. forward: best[j] = fewest misses of the layers so far holding exactly j slots; among those, spread[j]
    #    = the smallest sum of squared slots (ties go to the most even split, not to the first layers)
    best = np.full(cap + 1, np.inf)  # [cap + 1]
    best[0] = 0.0
    spread = np.zeros(cap + 1)  # [cap + 1]
    choice = np.zeros((len(curves), cap + 1), dtype=np.int64)  # [L, cap + 1]: layer l's slots at total j
    for n, c in enumerate(curves):
        new, new2 = np.full(cap + 1, np.inf), np.zeros(cap + 1)  # [cap + 1] each
        for s in range(min(c.size - 1, cap) + 1):
            cand = best[: cap + 1 - s] + c[s]  # [cap + 1 - s]: layer n holds s, the others j - s
            cand2 = spread[: cap + 1 - s] + s * s
            better = (cand < new[s:] - tol) | ((cand <= new[s:] + tol) & (cand2 < new2[s:]))
            new[s:][better], new2[s:][better] = cand[better], cand2[better]
            choice[n, s:][better] = s
        best, spread = new, new2
    # 2. the total: fewest misses, then the most slots
    j = int(np.flatnonzero(best <= float(best.min()) + tol)[-1])
    # 3. backward: each layer's share of the chosen total
    slots = [0] * len(curves)
    for n in range(len(curves) - 1, -1, -1):
        slots[n] = int(choice[n, j])
        j -= slots[n]
    return slots


__all__ = ["CACHE_ALLOCS", "allocate_slots", "lru_miss_curve"]
