"""Popularity of the synthetic routing model (moetier/synthetic.py): the per-rank token shares from the
hot/warm/cold classes, and the router logit offsets calibrated so that the top-k of (offset + N(0, 1)
noise) selects each rank with probability k * share. numpy only.

Invariants: `shares` is [E], descending, sums to 1, and k * share <= MAX_SELECT for every expert;
`base_logits` is [E], mean 0, read-only, and a pure function of the rounded shares and k (cached;
the calibration noise has a fixed seed), so generation stays a pure function of its parameters.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moetier.studies.synthetic import SynthParams

MAX_SELECT = 0.97  # cap on an expert's per-token selection probability k * share
CALIB_VALUES = 1 << 18  # noise values (samples x experts) of the calibration


def shares(p: SynthParams) -> np.ndarray:
    """Per-expert token shares, classes hot, warm, cold, sorted descending: [E], sums to 1, each
    k * share <= MAX_SELECT (excess moved proportionally onto the experts below the cap)."""
    parts = _class_parts(p.class_counts, (p.hot_share, p.warm_share), p.spread)
    out = -np.sort(-np.concatenate(parts))  # [E] descending (a class's head may pass the class above)
    out = out / out.sum()
    cap = MAX_SELECT / p.top_k
    for _ in range(p.num_experts):
        over = out > cap
        if not over.any():
            break
        excess = float((out[over] - cap).sum())
        out[over] = cap
        free = ~over & (out < cap)
        out[free] += excess * out[free] / out[free].sum()
    return out


def _phi(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz-Stegun 7.1.26 for erf, |error| < 1.5e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    return np.asarray(0.5 * (1.0 + np.sign(x) * (1.0 - poly * np.exp(-z * z))))


def _phi_inv(q: np.ndarray) -> np.ndarray:
    """Inverse of _phi by bisection (vectorised), for q in (0, 1)."""
    lo, hi = np.full(q.shape, -9.0), np.full(q.shape, 9.0)
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        below = _phi(mid) < q
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def _class_parts(counts: tuple[int, int, int], hw_shares: tuple[float, float], spread: float) -> list[np.ndarray]:
    """Shares of the hot, warm and cold experts (classes with no experts left out), Zipf inside each."""
    parts = []
    for n, s in zip(counts, (*hw_shares, max(0.0, 1.0 - sum(hw_shares))), strict=True):
        if n:
            z = np.arange(1, n + 1, dtype=np.float64) ** -spread  # [n]
            parts.append(s * z / z.sum())
    return parts


def ordered_spread(counts: tuple[int, int, int], hw_shares: tuple[float, float], top: float = 0.5) -> float:
    """The largest in-class Zipf exponent in {top, top - 0.05, ..., 0} that keeps every hot expert above
    every warm one and every warm above every cold one (so the class shares are those of the sorted profile)."""
    for spread in np.arange(top, -1e-9, -0.05):
        parts = _class_parts(counts, hw_shares, float(spread))
        if all(a.min() >= b.max() for a, b in itertools.pairwise(parts)):
            return round(float(spread), 2)
    return 0.0


@lru_cache(maxsize=64)
def _calibrate(select: tuple[float, ...], k: int) -> np.ndarray:
    """Logit offsets [E] such that the top-k of (base + N(0, 1) noise) includes expert e with probability
    select[e]. Each expert's inclusion probability is estimated smoothly over fixed noise samples (given
    the others, e is in the top-k iff its noise exceeds the k-th largest other value: a normal tail), and
    base moves in probit units until every estimate is within 0.5% of its target."""
    target = np.asarray(select)  # [E]
    E = len(target)
    eps = np.random.default_rng(20240607).standard_normal((max(1024, CALIB_VALUES // E), E))  # [M, E]
    goal = _phi_inv(target)
    base = goal.copy()
    for _ in range(100):
        v = base + eps  # [M, E]
        part = np.partition(-v, [k - 1, k], axis=1)  # [M, E]
        tk, tk1 = -part[:, k - 1 : k], -part[:, k : k + 1]  # [M, 1] k-th and (k+1)-th largest
        other = np.where(v >= tk, tk1, tk)  # [M, E] k-th largest of the other experts
        got = (1.0 - _phi(other - base)).mean(0)  # [E]; sums to k up to sampling noise
        got = np.clip(got * (k / got.sum()), 1e-12, 1 - 1e-12)
        if np.abs(got / target - 1).max() < 0.005:
            break
        base = base + 0.9 * (goal - _phi_inv(got))
    base = base - base.mean()
    base.setflags(write=False)
    return base


def base_logits(p: SynthParams) -> np.ndarray:
    """Calibrated logit offset of each popularity rank: [E], descending in share."""
    return _calibrate(tuple(np.round(shares(p) * p.top_k, 6).tolist()), p.top_k)


__all__ = ["CALIB_VALUES", "MAX_SELECT", "base_logits", "ordered_spread", "shares"]
