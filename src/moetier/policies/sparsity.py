"""Intra-expert activation sparsity decisions over plain numbers (numpy, no torch).

- `LogHistogram`: a streaming histogram of activation magnitudes on a log2 scale (64 bins per
  octave, 2^-40 .. 2^24; zeros and anything below fall in bin 0), so calibration keeps a few
  KiB per layer whatever the text length; `threshold(s)` is the magnitude below which a
  fraction s of the recorded values lie (log-linear inside a bin: relative error < 1.1%).
- `thresholds_for` builds a calibrated table row (targets 0, 0.05, ..., 0.95, 0.96, ..., 0.99);
  `interpolate` reads a threshold for any target between grid points.
- `routed_target` turns a total activation sparsity target (the paper's Table 2: shared experts'
  neurons counted, as active) into the fraction of routed neurons to skip; `total_sparsity` counts
  it back from (token, neuron) pairs.
- `tipping_point`, `use_sparse` and `call_sparse`: the dense/sparse switch (paper 4.1) from a timing profile, one
  path per layer call;
  `roofline_profile` prices both paths of one expert call from a hardware profile's compute section
  (for a device this process cannot time, e.g. a GPU named by --profile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from moetier.errors import ConfigError
from moetier.policies.hwprofile import ComputeProfile

# 0 .. 0.95 in steps of 0.05, then 0.96 .. 0.99: a total target near the paper's 87% on a model with shared
# experts needs about 0.98 of the routed neurons skipped (its Table 2)
TARGETS: tuple[float, ...] = (*(round(0.05 * i, 2) for i in range(20)), 0.96, 0.97, 0.98, 0.99)
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


def use_sparse(tokens: float, tipping: int) -> bool:
    """The gather path for an expert call of `tokens` tokens (a call's mean, `call_sparse`) below the tipping point."""
    return 0 < tokens < tipping


def call_sparse(token_counts: Iterable[int], tipping: int) -> bool:
    """The gather path for a whole layer call, the paper's switch by batch size (4.1): the call's mean tokens per
    routed expert below the tipping point (`use_sparse` of the mean). One path a call, never a mix: on the AVX-512
    benchmark model at 64 tokens a call split by each expert's own count took 9.9 ms, against 8.1-8.3 ms for all of
    it on either path (docs/sparsity.md)."""
    counts = [c for c in token_counts if c > 0]
    return bool(counts) and use_sparse(sum(counts) / len(counts), tipping)


def routed_target(target: float, scope: str, routed: int, shared: int, max_routed: float = TARGETS[-1]) -> float:
    """The fraction of routed neurons to skip for `target`. `routed`: routed neurons per token (k * I),
    `shared`: shared-expert neurons per token (S, 0 without shared experts). Scope "routed": the target
    itself. Scope "total" (the paper, 4.2.2: "threshold-based masking is applied to routed experts,
    yielding a model-specific routed expert sparsity that translates to the desired total activation
    sparsity when shared experts are accounted for"): target * (routed + shared) / routed, since the shared
    neurons always run. ConfigError when that exceeds `max_routed` (the table's largest target)."""
    if scope not in ("total", "routed"):
        raise ConfigError(f"sparsity scope must be 'total' or 'routed', got {scope!r}")
    if routed <= 0 or shared < 0:
        raise ConfigError(f"routed neurons per token must be > 0 and shared >= 0, got {routed} and {shared}")
    if scope == "routed" or shared == 0 or target <= 0:
        return target
    r = target * (routed + shared) / routed
    if r > max_routed + 1e-9:
        top = max_routed * routed / (routed + shared)
        raise ConfigError(
            f"total activation sparsity {target} needs {r:.3f} of the routed neurons skipped ({shared} shared "
            f"neurons per token always run beside {routed} routed), above the table's {max_routed}; the largest "
            f"total target for this model is {top:.3f} (or use --sparsity-scope routed)"
        )
    return min(r, max_routed)


def total_sparsity(skipped: int, routed_pairs: int, shared_pairs: int) -> float:
    """Skipped (token, neuron) pairs over all computed ones, shared experts' (always active) included."""
    denom = routed_pairs + shared_pairs
    return skipped / denom if denom else 0.0


def roofline_profile(
    gpu: ComputeProfile, hidden: int, inter: int, weight_bytes: float, routed: float,
    counts: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """tokens per expert -> (dense s, sparse s) of one SwiGLU expert call, priced on a compute profile's
    roofline (peak_flops * eff(n), mem_bw; its fixed overhead_s cancels: both paths launch three kernels).
    `routed` is the fraction of routed neurons skipped.
    - dense: gate, up and down read once (3*H*I weights) against 6*H*I*n FLOPs at eff(n);
    - sparse, as the paper's kernel (4.1, Fig. 5c): the gate projection dense (H*I weights, 2*H*I*n FLOPs
      at eff(n)), then each token gathers its own active up and down rows and runs a matrix-vector
      product: n * 2*H*I*(1 - routed) weights read and 4*H*I*(1 - routed)*n FLOPs at eff(1), since
      gathered rows form no tile across tokens. Reuse of rows shared by several tokens (caches) is not
      counted, so the sparse side is priced high and the switch errs towards the exact dense path."""
    if not 0 <= routed < 1:
        raise ValueError(f"routed sparsity must be in [0, 1), got {routed}")
    hi = hidden * inter
    out: dict[int, tuple[float, float]] = {}
    for n in counts:
        flops = gpu.peak_flops * gpu.eff(n)
        dense = max(3 * hi * weight_bytes / gpu.mem_bw, 6 * hi * n / flops)
        gate = max(hi * weight_bytes / gpu.mem_bw, 2 * hi * n / flops)
        live = hi * (1 - routed) * n
        gathered = max(2 * live * weight_bytes / gpu.mem_bw, 4 * live / (gpu.peak_flops * gpu.eff(1)))
        out[n] = (dense, gate + gathered)
    return out
