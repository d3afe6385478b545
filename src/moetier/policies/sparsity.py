"""Intra-expert activation sparsity decisions over plain numbers (numpy, no torch).

- `LogHistogram`: a streaming histogram of activation magnitudes on a log2 scale (64 bins per
  octave, 2^-40 .. 2^24; zeros and anything below fall in bin 0), so calibration keeps a few
  KiB per layer whatever the text length; `threshold(s)` is the magnitude below which a
  fraction s of the recorded values lie (log-linear inside a bin: relative error < 1.1%).
- `thresholds_for` builds a calibrated table row (targets 0, 0.05, ..., 0.95);
  `interpolate` reads a threshold for any target between grid points.
- `tipping_point` and `use_sparse`: the dense/sparse switch (paper 4.1) from a timing profile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

TARGETS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(20))  # 0 .. 0.95
BINS_PER_OCTAVE = 64
LOG2_MIN, LOG2_MAX = -40, 24
N_BINS = (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE + 1  # bin 0: zero and underflow


class LogHistogram:
    """Counts of |a| values per log2 bin; add counts with `add_counts` (from any backend)."""

    def __init__(self) -> None:
        self.counts = np.zeros(N_BINS, dtype=np.int64)

    @staticmethod
    def bin_of(magnitude: np.ndarray) -> np.ndarray:
        """The bin index of each magnitude (the same rule the torch side uses)."""
        with np.errstate(divide="ignore"):
            lg = np.log2(np.maximum(magnitude.astype(np.float64), 0.0))
        finite = np.isfinite(lg)
        b = np.floor((np.where(finite, lg, LOG2_MIN) - LOG2_MIN) * BINS_PER_OCTAVE).astype(np.int64) + 1
        return np.clip(np.where(finite, b, 0), 0, N_BINS - 1)

    def add(self, magnitude: np.ndarray) -> None:
        self.add_counts(np.bincount(self.bin_of(magnitude.ravel()), minlength=N_BINS))

    def add_counts(self, counts: np.ndarray) -> None:
        if counts.shape != (N_BINS,):
            raise ValueError(f"histogram counts must have {N_BINS} bins, got shape {counts.shape}")
        self.counts += counts.astype(np.int64)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def threshold(self, fraction: float) -> float:
        """Smallest t with P(|a| < t) >= fraction; 0 for fraction 0."""
        if not 0 <= fraction < 1:
            raise ValueError(f"fraction must be in [0, 1), got {fraction}")
        if fraction == 0 or self.total == 0:
            return 0.0
        cum = np.cumsum(self.counts)
        want = fraction * self.total
        b = int(np.searchsorted(cum, want, side="left"))  # first bin whose cumulative count reaches it
        if b == 0:
            return 2.0**LOG2_MIN  # the fraction is all zeros/underflow: skip only those
        before = cum[b - 1]
        inside = (want - before) / max(self.counts[b], 1)
        lo = LOG2_MIN + (b - 1) / BINS_PER_OCTAVE
        return float(2.0 ** (lo + inside / BINS_PER_OCTAVE))

    def fraction_below(self, t: float) -> float:
        """The fraction of recorded values below t (bin-resolution estimate)."""
        if self.total == 0:
            return 0.0
        b = int(self.bin_of(np.array([t]))[0])
        return float(self.counts[:b].sum() / self.total)


def thresholds_for(hist: LogHistogram, targets: Sequence[float] = TARGETS) -> list[float]:
    return [hist.threshold(s) for s in targets]


def interpolate(targets: Sequence[float], thresholds: Sequence[float], target: float) -> float:
    """Threshold for `target` from a table row: exact at grid points, log-linear between them."""
    if len(targets) != len(thresholds) or not targets:
        raise ValueError("targets and thresholds must be non-empty and of the same length")
    if target <= 0:
        return 0.0
    if target > targets[-1] + 1e-9:
        raise ValueError(f"target {target} is above the table's largest target {targets[-1]}")
    j = int(np.searchsorted(np.asarray(targets), target - 1e-9))
    if abs(targets[j] - target) < 1e-9:
        return float(thresholds[j])
    s0, s1, t0, t1 = targets[j - 1], targets[j], thresholds[j - 1], thresholds[j]
    w = (target - s0) / (s1 - s0)
    if t0 <= 0:
        return float(t1 * w)
    return float(math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))))


def tipping_point(profile: Mapping[int, tuple[float, float]], margin: float = 0.0) -> int:
    """profile: tokens per expert -> (dense seconds, sparse seconds). The smallest measured token
    count from which dense is at least as fast as sparse (times (1 - margin)) at it and at every
    larger measured count; one past the largest count if sparse wins everywhere; 0 if never."""
    counts = sorted(profile)
    if not counts:
        raise ValueError("an empty profile has no tipping point")
    tip = counts[-1] + 1
    for c in reversed(counts):
        dense, sparse = profile[c]
        if dense > sparse * (1 + margin):
            break
        tip = c
    return 0 if tip == counts[0] else tip


def use_sparse(tokens: int, tipping: int) -> bool:
    """The gather path for an expert call of `tokens` tokens below the tipping point."""
    return 0 < tokens < tipping
