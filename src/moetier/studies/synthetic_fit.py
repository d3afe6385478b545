"""Fit the synthetic generator's knobs to a recorded trace (simulated method of moments). numpy only.

Method (docs/traces.md):
1. Shape (layers, E, k, batch, decode steps, prompt length) and the target statistics come from the trace
   (moetier.studies.synthetic_stats): the sorted per-layer share profile, step-to-step reuse, adjacent-layer
   predictability, half-to-half load correlation and the router's top-k probability mass.
2. Popularity: the sorted profile is projected onto the hot/warm/cold class model (least squares on the
   cumulative shares over the class sizes and the in-class Zipf exponent; class shares are the profile's
   sums over the classes).
3. Each round, simulate traces of the recorded shape (same batch, steps and prompt length, a few fixed
   seeds, averaged) and (a) multiply the popularity target by observed / simulated profile (finite traces
   look more skewed than their long-run popularity, more so with strong temporal correlation), then
   (b) bisect temporal on reuse, layer_corr on layer predictability, drift on the half-to-half correlation,
   one knob at a time, each with the others fixed. Three rounds; then sharpness is bisected on the top-k mass
   (a trace without scores keeps the default sharpness).
Statistics are monotone in their knob and the generator gives each knob its own random stream, so a
bisection over fixed seeds is deterministic.

Invariants: the fit is deterministic for a given trace; it keeps the trace's shape (layers, E, k,
batch, MoE layer ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from moetier.errors import TraceError
from moetier.studies.synthetic import SynthParams, routing
from moetier.studies.synthetic_stats import routing_of, stats_and_profile
from moetier.traces import Trace

SPREADS = np.linspace(0.0, 2.0, 17)
ROUNDS = 3
BISECT = 10
POP_STEPS = 1  # popularity corrections per round
SIM_TOKENS = 4000  # replicate small traces until the simulations hold about this many tokens per layer
MAX_REPLICATES = 4


def project(profile: np.ndarray) -> dict[str, float]:
    """Class knobs (hot/warm fractions and shares, spread) whose sorted profile is nearest to `profile`
    ([E], descending, sums to 1): least squares on the cumulative shares (the share of the top n experts,
    for every n), so the head and the tail of the profile count alike."""
    E = len(profile)
    cum = np.concatenate([[0.0], np.cumsum(profile)])  # [E+1]
    best: tuple[float, dict[str, float]] = (np.inf, {})
    zipf = {s: {n: np.arange(1, n + 1, dtype=np.float64) ** -s for n in range(1, E + 1)} for s in SPREADS}
    for s in SPREADS:
        for h in range(0, E // 4 + 1):
            for w in range(1, E - h + 1):
                c = E - h - w
                parts = [
                    sh * zipf[s][n] / zipf[s][n].sum()
                    for n, sh in ((h, cum[h]), (w, cum[h + w] - cum[h]), (c, cum[E] - cum[h + w]))
                    if n
                ]
                model = -np.sort(-np.concatenate(parts))  # [E]
                err = float(((np.cumsum(model) - cum[1:]) ** 2).sum())
                if err < best[0]:
                    best = (err, {"hot_frac": h / E, "warm_frac": w / E, "hot_share": float(cum[h]),
                                  "warm_share": float(cum[h + w] - cum[h]), "spread": float(s)})  # fmt: skip
    return best[1]


def _shape(trace: Trace) -> tuple[dict[str, Any], dict[str, Any], np.ndarray]:
    """(SynthParams shape fields, observed stats, observed sorted profile)."""
    r = routing_of(trace)
    S, B, L, k = r.decode.shape
    if S < 3:
        raise TraceError(f"trace has {S} decode steps; fitting needs at least 3")
    if r.prefill.shape[0] % B:
        raise TraceError(f"trace prefill has {r.prefill.shape[0]} tokens, not a multiple of the batch ({B})")
    meta = trace.metadata
    layers = sorted({int(x) for x in trace.table.column("layer").unique().to_pylist()})
    shape = {
        "num_layers": L, "num_experts": r.num_experts, "top_k": k, "batch_size": B, "moe_layers": tuple(layers),
        "model": str(meta.get("model", "synthetic")), "hidden_size": int(meta.get("hidden_size") or 0),
        "moe_intermediate_size": int(meta.get("moe_intermediate_size") or 0),
    }  # fmt: skip
    obs, profile = stats_and_profile(r)
    obs["prompt_len"] = r.prefill.shape[0] // B
    return shape, obs, profile


class _Sim:
    """Averaged statistics of generated traces of the observed shape over fixed seeds."""

    def __init__(self, obs: dict[str, Any]) -> None:
        self.steps, self.prompt_len = int(obs["decode_steps"]), int(obs["prompt_len"])
        tokens = obs["batch"] * (self.steps + self.prompt_len)
        self.seeds = range(1000, 1000 + int(np.clip(np.ceil(SIM_TOKENS / tokens), 1, MAX_REPLICATES)))

    def __call__(self, p: SynthParams) -> tuple[dict[str, float], np.ndarray]:
        stats, profiles = [], []
        for s in self.seeds:
            st, prof = stats_and_profile(routing(replace(p, seed=s), self.steps, self.prompt_len))
            stats.append(st)
            profiles.append(prof)
        keys = ("reuse", "layer_pred", "drift_corr", "topk_mass")
        return {k: float(np.nanmean([st[k] for st in stats])) for k in keys}, np.mean(profiles, 0)


def _bisect(f: Callable[[float], float], target: float, lo: float, hi: float, increasing: bool) -> float:
    """x in [lo, hi] with f(x) nearest `target` for a monotone f; clamps to an end when out of range."""
    if np.isnan(target):
        return lo
    sign = 1.0 if increasing else -1.0
    if sign * (f(lo) - target) >= 0:
        return lo
    if sign * (f(hi) - target) <= 0:
        return hi
    for _ in range(BISECT):
        mid = 0.5 * (lo + hi)
        if sign * (f(mid) - target) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _classes(p: SynthParams, c: dict[str, float]) -> SynthParams:
    """`p` with the class knobs of `project`."""
    return replace(p, hot_frac=c["hot_frac"], warm_frac=c["warm_frac"], hot_share=c["hot_share"],
                   warm_share=c["warm_share"], spread=c["spread"])  # fmt: skip


def _fit_knob(
    sim: _Sim, p: SynthParams, knob: str, stat: str, target: float, hi: float, increasing: bool = True
) -> float:
    """Bisect one knob in [0, hi] so that the simulated `stat` meets `target`, the other knobs fixed."""
    knobs: dict[str, Any] = {}

    def f(x: float) -> float:
        knobs[knob] = x
        return sim(replace(p, **knobs))[0][stat]

    return _bisect(f, target, 0.0, hi, increasing)


def fit_params(trace: Trace) -> SynthParams:
    """SynthParams reproducing the trace's statistics (module docstring). TraceError for unusable traces."""
    # 1. shape and targets
    shape, obs, profile = _shape(trace)
    sim = _Sim(obs)
    # 2. initial popularity from the observed profile
    target = profile.copy()
    start = SynthParams(**shape, hot_frac=0.0, hot_share=0.0, warm_frac=1.0, warm_share=1.0)  # valid for any E
    p = _classes(start, project(target))  # (the default classes need a hot expert: none of 8 experts is 5%)
    for _ in range(ROUNDS):
        # 3a. correct the popularity for finite-trace bias
        for _ in range(POP_STEPS):
            _, sim_profile = sim(p)
            target = np.clip(target * profile / np.maximum(sim_profile, 1e-9), 1e-6, None)
            target = -np.sort(-target / target.sum())
            p = _classes(p, project(target))
        # 3b. dynamics, one knob at a time
        p = replace(p, temporal=_fit_knob(sim, p, "temporal", "reuse", obs["reuse"], 0.98))
        p = replace(p, layer_corr=_fit_knob(sim, p, "layer_corr", "layer_pred", obs["layer_pred"], 0.98))
        p = replace(p, drift=_fit_knob(sim, p, "drift", "drift_corr", obs["drift_corr"], 1.0, increasing=False))
    if obs["topk_mass"] is not None:  # without scores the sharpness keeps its default
        p = replace(p, sharpness=_fit_knob(sim, p, "sharpness", "topk_mass", obs["topk_mass"], 30.0))
    return p
