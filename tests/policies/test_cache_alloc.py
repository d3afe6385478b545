"""AdapMoE's per-layer cache allocation (policies/cache_alloc.py): the DP against brute-force enumeration, the
budget and per-layer bounds, and the LRU miss curve against an LRU cache replayed at each size."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies import LRUPolicy
from moetier.policies.cache_alloc import allocate_slots, lru_miss_curve
from moetier.sim.residency import FastCache
from moetier.types import ExpertKey


def brute_force(curves: list[np.ndarray], budget: int) -> tuple[float, int]:
    """(fewest total misses, the most slots any allocation with those misses uses) over every allocation."""
    best, most = np.inf, -1
    for sizes in itertools.product(*(range(c.size) for c in curves)):
        if sum(sizes) > budget:
            continue
        m = float(sum(c[s] for c, s in zip(curves, sizes, strict=True)))
        if m < best - 1e-9:
            best, most = m, sum(sizes)
        elif abs(m - best) <= 1e-9:
            most = max(most, sum(sizes))
    return best, most


@pytest.mark.parametrize("monotone", [True, False])
def test_dp_matches_brute_force_on_random_instances(monotone: bool) -> None:
    rng = np.random.default_rng(7 if monotone else 8)
    for _ in range(150):
        n_layers = int(rng.integers(1, 5))
        curves = []
        for _ in range(n_layers):
            c = rng.integers(0, 12, size=int(rng.integers(1, 6))).astype(np.float64)  # sizes 0..E_l, E_l <= 4
            curves.append(np.sort(c)[::-1].copy() if monotone else c)
        budget = int(rng.integers(0, sum(c.size for c in curves) + 2))
        slots = allocate_slots(curves, budget)
        assert len(slots) == n_layers and sum(slots) <= budget
        assert all(0 <= s <= c.size - 1 for s, c in zip(slots, curves, strict=True))
        best, most = brute_force(curves, budget)
        assert sum(c[s] for c, s in zip(curves, slots, strict=True)) == pytest.approx(best)
        assert sum(slots) == most  # of the optimal allocations, one that uses the most slots


def test_budget_used_in_full_and_flat_curves_split_evenly() -> None:
    # non-increasing curves: the whole budget is used (up to L * E); where the curves are flat the split is even
    flat = [np.zeros(9) for _ in range(4)]
    assert allocate_slots(flat, 12) == [3, 3, 3, 3]
    assert allocate_slots(flat, 100) == [8, 8, 8, 8]
    assert allocate_slots(flat, 0) == [0, 0, 0, 0]
    # a layer whose misses fall fast takes the slots first
    steep, shallow = np.array([10.0, 2, 1, 0]), np.array([10.0, 9, 8, 7])
    assert allocate_slots([shallow, steep], 1) == [0, 1]
    a, b = allocate_slots([shallow, steep], 3)
    assert shallow[a] + steep[b] == 10 and a + b == 3
    assert allocate_slots([], 5) == []


def test_dp_is_fast_at_deepseek_like_sizes() -> None:
    rng = np.random.default_rng(0)
    for n_layers, experts in ((26, 64), (60, 160)):
        curves = [np.sort(rng.integers(0, 2000, experts + 1))[::-1] for _ in range(n_layers)]
        budget = round(0.25 * n_layers * experts)
        # CPU time of this process (all its threads), not wall time: other processes on the cores do not count.
        # allocate_slots is numpy on the calling thread.
        t0 = time.process_time()
        slots = allocate_slots(curves, budget)
        assert sum(slots) == budget and max(slots) <= experts
        assert time.process_time() - t0 < 10.0  # 60 x 160 at 25%: well under a second on one core


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="budget"):
        allocate_slots([[1.0, 0.0]], -1)
    with pytest.raises(ConfigError, match="budget"):
        allocate_slots([[1.0, 0.0]], True)
    with pytest.raises(ConfigError, match="layer 1"):
        allocate_slots([[1.0, 0.0], [np.nan, 0.0]], 1)
    with pytest.raises(ConfigError, match="layer 0"):
        allocate_slots([[]], 1)
    with pytest.raises(ConfigError, match="num_experts"):
        lru_miss_curve([[0]], 0)
    with pytest.raises(ConfigError, match="call 1"):
        lru_miss_curve([[0], [1, 1]], 4)
    with pytest.raises(ConfigError, match="initial"):
        lru_miss_curve([[0]], 4, [5])


def lru_misses(calls: list[list[int]], num_experts: int, initial: list[int], slots: int) -> int:
    """Misses of one layer's cache of `slots` (the simulator's FastCache with LRU) holding initial[:slots], the
    first one the most recent; per call its experts are pinned, then touched last-given first (so that the first
    given ends the most recent)."""
    cache = FastCache(slots, LRUPolicy())
    cache.warm(ExpertKey(0, e) for e in reversed(initial[:slots]))
    misses = 0
    for call in calls:
        keys = [ExpertKey(0, e) for e in call]
        cache.pin(keys)
        for k in reversed(keys):
            if not cache.access(k):
                misses += 1
                cache.admit(k)
        cache.unpin(keys)
    return misses


def test_lru_curve_matches_an_lru_cache_at_every_size() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        experts, k = int(rng.integers(4, 12)), int(rng.integers(1, 4))
        calls = [rng.choice(experts, size=k, replace=False, p=rng.dirichlet(np.ones(experts))).tolist()
                 for _ in range(30)]  # fmt: skip
        initial = rng.permutation(experts)[: int(rng.integers(0, experts + 1))].tolist()
        curve = lru_miss_curve(calls, experts, initial)
        assert curve.shape == (experts + 1,) and curve[0] == k * len(calls)
        assert (np.diff(curve) <= 0).all()
        for s in range(k, experts + 1):  # a cache that holds a whole call (smaller ones: the stack's estimate)
            assert curve[s] == lru_misses(calls, experts, initial, s)
