"""Sparsity policy over plain numbers: LogHistogram quantiles, table interpolation, the dense/sparse
tipping point, use_sparse, call_sparse, and plan_layer carrying the target on every task of a call below it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moetier.policies.plan import plan_layer
from moetier.policies.sparsity import (
    LOG2_MIN,
    N_BINS,
    TARGETS,
    LogHistogram,
    call_sparse,
    interpolate,
    thresholds_for,
    tipping_point,
    use_sparse,
)
from moetier.types import ExpertKey

FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


def lognormal(n: int, seed: int, sigma: float = 1.0, mean: float = -2.0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(mean, sigma, n)


# --- LogHistogram --------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "sigma"), [(0, 1.0), (1, 2.5), (2, 0.3)])
def test_threshold_matches_numpy_quantile(seed: int, sigma: float) -> None:
    x = lognormal(200_000, seed, sigma)
    hist = LogHistogram()
    hist.add(x[:120_000])  # two adds: counts accumulate
    hist.add(x[120_000:])
    assert hist.total == x.size
    for s in FRACTIONS:
        got, want = hist.threshold(s), float(np.quantile(x, s))
        assert abs(got - want) / want < 0.02, (s, got, want)
        # bin-resolution estimate: the mass below the threshold's bin, so s lies within that bin's mass above it
        below = hist.fraction_below(got)
        in_bin = hist.counts[int(LogHistogram.bin_of(np.array([got]))[0])] / hist.total
        assert below <= s + 1e-9 <= below + in_bin + 2e-9
        assert below <= float(np.mean(x < got)) <= below + in_bin
        assert below == pytest.approx(s, abs=0.02)


def test_threshold_is_monotone_and_table_row() -> None:
    hist = LogHistogram()
    hist.add(lognormal(50_000, 3))
    row = thresholds_for(hist)
    assert len(row) == len(TARGETS) and row[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(row[1:]))


def test_add_counts_equals_add() -> None:
    x = lognormal(10_000, 4)
    a, b = LogHistogram(), LogHistogram()
    a.add(x)
    b.add_counts(np.bincount(LogHistogram.bin_of(x), minlength=N_BINS))
    assert np.array_equal(a.counts, b.counts)
    with pytest.raises(ValueError, match="bins"):
        b.add_counts(np.zeros(10, dtype=np.int64))


def test_zeros_count_below_any_positive_threshold() -> None:
    x = np.concatenate([np.zeros(3000), lognormal(7000, 5)])
    hist = LogHistogram()
    hist.add(x)
    assert LogHistogram.bin_of(np.array([0.0]))[0] == 0
    for t in (2.0**LOG2_MIN, 2.0**LOG2_MIN * 1.01, 1e-6):
        assert hist.fraction_below(t) == pytest.approx(0.3, abs=1e-9)
    # a fraction that only the zeros make up: the threshold skips the zeros and nothing else
    t = hist.threshold(0.2)
    assert 0 < t <= 2.0**LOG2_MIN
    assert float(np.mean(x < t)) == pytest.approx(0.3)
    assert hist.threshold(0.5) == pytest.approx(float(np.quantile(x, 0.5)), rel=0.02)


def test_threshold_zero_and_bad_fractions() -> None:
    hist = LogHistogram()
    assert hist.threshold(0.5) == 0.0  # empty
    assert hist.fraction_below(1.0) == 0.0
    hist.add(lognormal(1000, 6))
    assert hist.threshold(0) == 0.0
    assert hist.fraction_below(0.0) == 0.0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            hist.threshold(bad)


# --- interpolate ---------------------------------------------------------------------------------


def _row() -> list[float]:
    return [0.0] + [0.01 * 1.5**i for i in range(1, len(TARGETS))]


def test_interpolate_exact_at_grid_points() -> None:
    row = _row()
    for s, t in zip(TARGETS, row, strict=True):
        assert interpolate(TARGETS, row, s) == t
    assert interpolate(TARGETS, row, 0.3000000001) == row[6]  # float noise of a grid point


def test_interpolate_monotone_and_log_linear_between() -> None:
    row = _row()
    grid = np.linspace(0.0, 0.95, 400)
    values = [interpolate(TARGETS, row, float(s)) for s in grid]
    assert all(a <= b for a, b in itertools.pairwise(values))
    # log-linear between two positive neighbours: the midpoint is the geometric mean
    assert interpolate(TARGETS, row, 0.525) == pytest.approx(math.sqrt(row[10] * row[11]), rel=1e-12)
    # linear from the 0 at target 0
    assert interpolate(TARGETS, row, 0.025) == pytest.approx(row[1] / 2, rel=1e-12)
    for j in range(len(TARGETS) - 1):
        mid = interpolate(TARGETS, row, (TARGETS[j] + TARGETS[j + 1]) / 2)
        assert row[j] < mid < row[j + 1]


def test_interpolate_errors() -> None:
    row = _row()
    assert interpolate(TARGETS, row, -0.5) == 0.0
    with pytest.raises(ValueError, match="above the table"):
        interpolate(TARGETS, row, 0.995)
    with pytest.raises(ValueError, match="above the table"):
        interpolate(TARGETS[:5], row[:5], 0.3)
    with pytest.raises(ValueError, match="same length"):
        interpolate(TARGETS, row[:-1], 0.5)
    with pytest.raises(ValueError, match="non-empty"):
        interpolate([], [], 0.5)


# --- tipping point -------------------------------------------------------------------------------

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16)


def profile(sparse_wins: set[int]) -> dict[int, tuple[float, float]]:
    """(dense, sparse) seconds: sparse faster at the counts in `sparse_wins`, dense elsewhere."""
    return {c: ((2.0, 1.0) if c in sparse_wins else (1.0, 2.0)) for c in COUNTS}


def test_tipping_point_sparse_then_dense() -> None:
    assert tipping_point(profile({1, 2, 3, 4})) == 6


def test_tipping_point_dense_everywhere() -> None:
    assert tipping_point(profile(set())) == 0


def test_tipping_point_sparse_everywhere() -> None:
    assert tipping_point(profile(set(COUNTS))) == 17


def test_tipping_point_ignores_noise_before_the_suffix() -> None:
    # dense happens to win at 2 (noise), sparse again at 3 and 4: the switch is where dense keeps winning
    assert tipping_point(profile({1, 3, 4})) == 6
    # and a sparse win after dense wins pushes the point past it
    assert tipping_point(profile({1, 2, 3, 4, 12})) == 16


def test_tipping_point_ties_and_margin() -> None:
    tie = {c: (1.0, 1.0) for c in COUNTS}
    assert tipping_point(tie) == 0  # dense at least as fast everywhere
    close = {1: (2.0, 1.0), 2: (1.05, 1.0), 4: (0.9, 1.0)}
    assert tipping_point(close) == 4
    assert tipping_point(close, margin=0.1) == 2  # dense 5% slower at 2 is within the margin
    with pytest.raises(ValueError, match="empty"):
        tipping_point({})


def test_use_sparse() -> None:
    assert [use_sparse(t, 6) for t in range(8)] == [False, True, True, True, True, True, False, False]
    assert not any(use_sparse(t, 0) for t in range(10))
    assert not use_sparse(1, 1)


# --- plan_layer ----------------------------------------------------------------------------------


def test_plan_puts_the_whole_call_on_one_path() -> None:
    """The switch by batch size (paper 4.1): every task of a call whose mean tokens per expert is below the tipping
    point carries the target, whatever its own count; at or above it, none does."""
    counts = {0: 1, 1: 5, 2: 6, 3: 40}  # mean 13
    plan = plan_layer(2, counts, {ExpertKey(2, 3)}, sparsity=0.5, tipping=14)
    assert [t.key.expert for t in plan.tasks] == [3, 0, 1, 2]  # resident first, unchanged by sparsity
    assert {t.key.expert: t.sparsity for t in plan.tasks} == {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}  # 40 >= 14 too
    assert [t.tokens for t in plan.tasks] == [40, 1, 5, 6]
    plan = plan_layer(2, counts, {ExpertKey(2, 3)}, sparsity=0.5, tipping=13)  # mean 13: dense, 1 < 13 too
    assert [t.sparsity for t in plan.tasks] == [0.0] * 4


def test_call_sparse() -> None:
    assert call_sparse([1, 1, 1], 2) and not call_sparse([2, 2], 2)
    assert call_sparse([1, 3], 3)  # mean 2
    assert not call_sparse([], 5) and not call_sparse([0, 0], 5)  # no routed expert
    assert not call_sparse([1], 0) and not call_sparse([1, 1], 1)  # never sparse / dense from 1 token


@pytest.mark.parametrize(("sparsity", "tipping"), [(0.0, 100), (0.5, 0), (0.5, 1)])
def test_plan_without_sparse_tasks(sparsity: float, tipping: int) -> None:
    plan = plan_layer(0, {0: 1, 1: 3}, set(), sparsity=sparsity, tipping=tipping)
    assert [t.sparsity for t in plan.tasks] == [0.0, 0.0]
    assert [t.tokens for t in plan.tasks] == [1, 3]


def test_plan_always_sparse_with_large_tipping() -> None:
    plan = plan_layer(0, {0: 1, 1: 3, 4: 999}, set(), sparsity=0.9, tipping=1000)
    assert [t.sparsity for t in plan.tasks] == [0.9, 0.9, 0.9]
