"""Synthetic routing traces: a small generative model of MoE routing (its knobs, popularity and routing) and
presets for published models (TriMoE 3.1's hot/warm/cold statistics). numpy only; no torch.

The model (docs/traces.md). Each sequence b of the batch walks positions n = 0 .. P+S-1 (P prompt
tokens in the prefill chunk, then S decode steps). At MoE layer l its router logits are
    logit[n, b, l, e] = base[rank[n, l, e]] + dev[n, b, l, e]
- popularity: `base` [E] is calibrated (Monte Carlo) so that with dev ~ N(0, 1) expert of popularity
  rank r is among the top-k with probability k * share[r]; `share` comes from the hot/warm/cold class
  sizes and token shares, spread inside each class like Zipf with exponent `spread`. Each layer gives the
  ranks to its experts by its own random permutation `rank[., l, .]`.
- drift: at each decode step, each layer swaps the ranks of two random experts `drift` times (Poisson);
  the share profile is kept, which expert holds which share wanders.
- step noise (stationary popularity, noisy calls): each position adds to every sequence's logits one
  batch-shared offset per layer and expert, N(0, step_noise^2), drawn anew per position (no memory); `base`
  is then scaled by sqrt(1 + step_noise^2), so a token's logits are a scaled copy of the step_noise = 0
  model and the long-run shares are kept (step_noise = 0 leaves generation bit-for-bit unchanged).
- temporal correlation: dev is an AR(1) process over positions with coefficient `temporal` and
  stationary variance 1, independent per sequence.
- layer correlation: dev[., l, f] = layer_corr * dev[., l-1, pi_l[f]] + sqrt(1 - layer_corr^2) * own[., l, f]
  where pi_l[f] is the expert of layer l-1 that had f's popularity rank at the start (a fixed mapping:
  a token's leaning towards the rank-r expert carries to the next layer's rank-r expert); still AR(1)
  with variance 1.
The experts are the top-k logits in descending order; scores = softmax(sharpness * logit) over all E
experts; weights = the top-k scores renormalised. So experts are always the top-k of the scores.
Rows follow the engine's trace layout: step 0 is the prefill chunk (when prompt_len > 0; token = b * P + p),
then one step per decode position (token = b); within a step, layers ascending, tokens ascending.
The fit to a recorded trace is studies/synthetic_fit.py's (it imports this module), the statistics
studies/synthetic_stats.py's.
Invariants: generation is a pure function of (params, steps, prompt_len); each knob draws from its own
random stream, so changing one knob keeps the others' randomness (fit relies on this). `shares` is [E],
descending, sums to 1, and k * share <= MAX_SELECT for every expert; `base_logits` is [E], mean 0,
read-only, and a pure function of the rounded shares and k (cached; the calibration noise has a fixed seed).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from moetier.errors import ConfigError
from moetier.specs import load_spec
from moetier.studies.synthetic_stats import Routing
from moetier.traces import SCHEMA, SCHEMA_VERSION, Trace, write_table

MAX_SELECT = 0.97  # cap on an expert's per-token selection probability k * share
CALIB_VALUES = 1 << 18  # noise values (samples x experts) of the calibration


@dataclass(frozen=True)
class SynthParams:
    """Knobs of the generator (see the module docstring). Fractions are of the experts of one layer,
    shares of its routed (token, expert) assignments; cold takes what hot and warm leave."""

    num_layers: int = 4
    num_experts: int = 32
    top_k: int = 4
    hot_frac: float = 0.05
    warm_frac: float = 0.25
    hot_share: float = 0.22
    warm_share: float = 0.70
    spread: float = 0.15  # Zipf exponent of the shares inside each class (0 = equal)
    temporal: float = 0.19  # AR(1) coefficient of a sequence's routing deviation across positions
    layer_corr: float = 0.93  # weight of the previous layer's deviation, through a fixed expert mapping
    drift: float = 0.0  # expected rank swaps per layer per decode step
    step_noise: float = 0.0  # sd of a batch-shared logit offset per position, layer and expert (shares kept)
    sharpness: float = 1.87  # scores = softmax(sharpness * logits)
    batch_size: int = 1
    seed: int = 0
    moe_layers: tuple[int, ...] = ()  # layer ids written to the trace; () = 0 .. num_layers-1
    model: str = "synthetic"
    hidden_size: int = 0  # trace metadata only
    moe_intermediate_size: int = 0  # trace metadata only

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.moe_layers or tuple(range(self.num_layers))

    @property
    def class_counts(self) -> tuple[int, int, int]:
        """(hot, warm, cold) numbers of experts."""
        h, w = round(self.hot_frac * self.num_experts), round(self.warm_frac * self.num_experts)
        return h, w, self.num_experts - h - w


def _validate(p: SynthParams) -> None:
    ints = {"num_layers": p.num_layers, "num_experts": p.num_experts, "top_k": p.top_k, "batch_size": p.batch_size}
    for name, n in ints.items():
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"SynthParams.{name} must be a positive integer, got {n!r}")
    if p.top_k >= p.num_experts:
        raise ConfigError(f"SynthParams.top_k ({p.top_k}) must be below num_experts ({p.num_experts})")
    unit = {"hot_frac": p.hot_frac, "warm_frac": p.warm_frac, "hot_share": p.hot_share, "warm_share": p.warm_share}
    for name, v in {**unit, "temporal": p.temporal, "layer_corr": p.layer_corr}.items():
        if not 0.0 <= v <= 1.0 or math.isnan(v):
            raise ConfigError(f"SynthParams.{name} must be in [0, 1], got {v}")
    if p.temporal >= 1.0 or p.layer_corr >= 1.0:
        raise ConfigError("SynthParams.temporal and layer_corr must be below 1 (1 would freeze the routing)")
    if p.hot_share + p.warm_share > 1.0 + 1e-9:
        raise ConfigError(f"SynthParams: hot_share + warm_share = {p.hot_share + p.warm_share:.3f} exceeds 1")
    for name, v in {"spread": p.spread, "drift": p.drift, "sharpness": p.sharpness, "step_noise": p.step_noise}.items():
        if not v >= 0.0 or math.isinf(v):
            raise ConfigError(f"SynthParams.{name} must be a finite number >= 0, got {v}")
    h, w, c = p.class_counts
    if c < 0:
        raise ConfigError(f"SynthParams: hot_frac + warm_frac = {p.hot_frac + p.warm_frac:.3f} leaves no room")
    for name, size, share in zip(
        ("hot", "warm", "cold"), (h, w, c), (p.hot_share, p.warm_share, 1 - p.hot_share - p.warm_share), strict=True
    ):
        if size == 0 and share > 1e-6:
            raise ConfigError(f"SynthParams: {name} class has 0 of {p.num_experts} experts but token share {share:.3f}")
    if p.moe_layers and len(p.moe_layers) != p.num_layers:
        raise ConfigError(f"SynthParams.moe_layers has {len(p.moe_layers)} ids for num_layers={p.num_layers}")


# -- popularity ------------------------------------------------------------------------------------
# Per-rank token shares from the hot/warm/cold classes, and the router logit offsets calibrated so that the
# top-k of (offset + N(0, 1) noise) selects each rank with probability k * share.
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


# -- generation ------------------------------------------------------------------------------------
@dataclass
class _Out:
    ids: np.ndarray  # [R, k] int32
    scores: np.ndarray | None  # [R, E] float32
    top: np.ndarray  # [R, k] float32 top-k scores (descending)


def _route(p: SynthParams, steps: int, prompt_len: int, keep_scores: bool) -> _Out:
    """Rows in trace order (see module docstring)."""
    # 1. shapes, random streams, and fixed structure (popularity ranks per layer, layer maps)
    L, E, k, B, P = p.num_layers, p.num_experts, p.top_k, p.batch_size, prompt_len
    N, R = P + steps, L * B * (P + steps)
    # spawn(4): the first three children are those of spawn(3), so step_noise leaves the other streams as they were
    r_struct, r_dev, r_drift, r_step = (np.random.default_rng(s) for s in np.random.SeedSequence(p.seed).spawn(4))
    base = base_logits(p).astype(np.float32)  # [E]
    if p.step_noise > 0:
        base = base * np.float32(math.sqrt(1.0 + p.step_noise * p.step_noise))
    rank = np.stack([r_struct.permutation(E) for _ in range(L)])  # [L, E] popularity rank of each expert
    holder = np.argsort(rank, axis=1)  # [L, E] expert holding each rank
    pi = np.stack([holder[la - 1][rank[la]] for la in range(L)])  # [L, E] partner at l-1: same initial rank
    rho, lam = p.temporal, p.layer_corr
    ids = np.empty((R, k), np.int32)
    scores = np.empty((R, E), np.float32) if keep_scores else None
    topw = np.empty((R, k), np.float32)
    state = r_dev.standard_normal((B, L, E), dtype=np.float32)  # [B, L, E] AR(1) state, stationary
    chunk = max(1, (1 << 21) // (B * L * E))
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        # 2. AR(1) deviations over positions, then mixed along the layers
        innov = r_dev.standard_normal((n1 - n0, B, L, E), dtype=np.float32)  # [C, B, L, E]
        dev = np.empty_like(innov)
        for c in range(n1 - n0):
            state = rho * state + math.sqrt(1 - rho * rho) * innov[c] if n0 + c else state
            dev[c] = state
        for la in range(1, L):
            dev[:, :, la] = lam * dev[:, :, la - 1][..., pi[la]] + math.sqrt(1 - lam * lam) * dev[:, :, la]
        # 3. popularity ranks per position (drift swaps at decode steps)
        ranks = np.empty((n1 - n0, L, E), np.int64)  # [C, L, E]
        for c in range(n1 - n0):
            if n0 + c > P and p.drift > 0:
                swaps = r_drift.poisson(p.drift, L)  # [L]
                for li in np.flatnonzero(swaps).tolist():
                    for _ in range(int(swaps[li])):
                        i, j = r_drift.choice(E, 2, replace=False)
                        rank[li, [i, j]] = rank[li, [j, i]]
            ranks[c] = rank
        logits = base[ranks][:, None] + dev  # [C, B, L, E]
        if p.step_noise > 0:  # one offset per position, layer and expert, shared by the batch
            logits += np.float32(p.step_noise) * r_step.standard_normal((n1 - n0, 1, L, E), dtype=np.float32)
        # 4. top-k in descending order, scores, top-k mass
        top = np.argpartition(-logits, k - 1, axis=-1)[..., :k]  # [C, B, L, k]
        order = np.argsort(-np.take_along_axis(logits, top, -1), axis=-1)
        top = np.take_along_axis(top, order, -1)
        z = p.sharpness * (logits - logits.max(-1, keepdims=True))
        np.exp(z, out=z)
        z /= z.sum(-1, keepdims=True)  # [C, B, L, E] scores
        # 5. scatter into trace row order
        rows = _rows(np.arange(n0, n1), B, L, P)  # [C, B, L]
        ids[rows] = top
        topw[rows] = np.take_along_axis(z, top, -1)
        if scores is not None:
            scores[rows] = z
    return _Out(ids, scores, topw)


def _rows(pos: np.ndarray, B: int, L: int, P: int) -> np.ndarray:
    """Trace row of (position, sequence, layer): [C, B, L]. Prefill rows: layer-major, token = b*P + p;
    decode step s rows: after the prefill, L*B per step, layer-major, token = b."""
    n, b, la = pos[:, None, None], np.arange(B)[None, :, None], np.arange(L)[None, None, :]
    pre = la * (P * B) + b * P + n
    dec = L * P * B + (n - P) * (L * B) + la * B + b
    return np.where(n < P, pre, dec)


def routing(p: SynthParams, steps: int, prompt_len: int = 0) -> Routing:
    """The routing of `generate` as arrays (no Arrow table, no full scores): what `fit` simulates."""
    _check_shape(steps, prompt_len)
    out = _route(p, steps, prompt_len, keep_scores=False)
    L, B, k, P = p.num_layers, p.batch_size, p.top_k, prompt_len
    n_pre = L * P * B
    pre = out.ids[:n_pre].reshape(L, P * B, k).transpose(1, 0, 2)  # [P*B, L, k]
    dec = out.ids[n_pre:].reshape(steps, L, B, k).transpose(0, 2, 1, 3)  # [S, B, L, k]
    return Routing(pre.astype(np.int64), dec.astype(np.int64), p.num_experts, float(out.top.sum(1).mean()))


def _check_shape(steps: int, prompt_len: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(prompt_len, int) or prompt_len < 0:
        raise ConfigError(f"prompt_len must be an integer >= 0, got {prompt_len!r}")


def generate(p: SynthParams, steps: int, prompt_len: int = 0, *, with_scores: bool = True) -> Trace:
    """A synthetic trace in the project's schema: `steps` decode steps of batch_size tokens, preceded by a
    prefill chunk (step 0) of prompt_len tokens per sequence when prompt_len > 0. Scores (all E router
    probabilities) are included unless with_scores=False (then the column is null)."""
    # 1. routing
    _check_shape(steps, prompt_len)
    L, E, k, B, P = p.num_layers, p.num_experts, p.top_k, p.batch_size, prompt_len
    R = L * B * (P + steps)
    if with_scores and R * E >= 2**31:
        raise ConfigError(f"{R} rows x {E} scores exceed the Parquet list limit; use fewer steps or no scores")
    out = _route(p, steps, prompt_len, keep_scores=with_scores)
    # 2. step, token, layer columns in trace row order
    lay = np.asarray(p.layer_ids, np.int16)
    first = 1 if P else 0
    step = np.concatenate(
        [np.zeros(L * P * B, np.int32), np.repeat(np.arange(first, first + steps, dtype=np.int32), L * B)]
    )
    token = np.concatenate(
        [np.tile(np.arange(P * B, dtype=np.int32), L), np.tile(np.arange(B, dtype=np.int32), L * steps)]
    )
    layer = np.concatenate([np.repeat(lay, P * B), np.tile(np.repeat(lay, B), steps)])
    # 3. list columns (weights = top-k scores renormalised)
    weights = (out.top / out.top.sum(1, keepdims=True)).astype(np.float32)  # [R, k]
    scores = pa.nulls(R, SCHEMA.field("scores").type) if out.scores is None else _lists(out.scores, pa.float32())
    cols = {
        "step": pa.array(step), "token": pa.array(token), "layer": pa.array(layer),
        "experts": _lists(out.ids, pa.int32()), "weights": _lists(weights, pa.float32()), "scores": scores,
    }  # fmt: skip
    meta = {
        "model": p.model, "num_experts": E, "top_k": k, "hidden_size": p.hidden_size,
        "moe_intermediate_size": p.moe_intermediate_size, "dtype": "bfloat16", "family": "synthetic",
        "num_layers": max(p.layer_ids) + 1, "moe_layers": list(p.layer_ids), "schema_version": SCHEMA_VERSION,
        "synthetic": {**asdict(p), "moe_layers": list(p.layer_ids), "steps": steps, "prompt_len": P},
    }  # fmt: skip
    table = pa.table(cols, schema=SCHEMA).replace_schema_metadata({b"moetier": json.dumps(meta).encode()})
    return Trace(table=table, metadata=meta)


def _lists(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """[R, w] array -> Arrow list array of R rows of w values."""
    R, w = values.shape
    offsets = pa.array(np.arange(0, R * w + 1, w, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=typ))


def save(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write a trace (its metadata included) as Parquet; `moetier.traces.load` reads it back."""
    return write_table(trace.table, trace.metadata, path)


def params_dict(p: SynthParams) -> dict[str, Any]:
    """The knobs as a JSON-able dict (`moe_layers` a list); `params_from_dict` reads it back."""
    return {**asdict(p), "moe_layers": list(p.moe_layers)}


def params_from_dict(d: Any) -> SynthParams:
    """SynthParams from `params_dict`'s output (e.g. a fitted-parameters JSON file); ConfigError naming an
    unknown or mistyped knob."""
    if not isinstance(d, dict):
        raise ConfigError(f"synthetic parameters must be a JSON object, got {type(d).__name__}")
    fields = set(SynthParams.__dataclass_fields__)
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"unknown synthetic parameter(s) {', '.join(unknown)}")
    try:
        kw = {**d, **({"moe_layers": tuple(int(x) for x in d["moe_layers"])} if "moe_layers" in d else {})}
        return SynthParams(**kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad synthetic parameters: {exc}") from exc


def save_params(p: SynthParams, path: str | os.PathLike[str]) -> Path:
    """Write the knobs as JSON (creating the parent folder)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(params_dict(p), indent=1) + "\n", encoding="utf-8")
    return out


def load_params(path: str | os.PathLike[str]) -> SynthParams:
    """Knobs written by `save_params`; ConfigError naming the file when it is missing or not valid JSON."""
    src = Path(path)
    try:
        raw = json.loads(src.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{src}: cannot read synthetic parameters ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{src}: not a JSON file of synthetic parameters ({exc})") from exc
    try:
        return params_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{src}: {exc}") from exc


# -- presets ---------------------------------------------------------------------------------------
# Routing dynamics of every preset: the mean of the knobs fitted to the bundled model's three recorded
# traces (data/traces; benchmarks/synth_fit.py prints them); no published model gives these numbers.
PRESET_DYNAMICS = {"temporal": 0.19, "layer_corr": 0.93, "sharpness": 1.87, "drift": 0.02}
TRIMOE = {"cold_frac": 0.71, "hot_frac": 0.05, "hot_share": 0.22, "warm_share": 0.70}  # TriMoE 3.1
SMALL_E = 16  # below this many experts the TriMoE classes cannot apply (see preset)


# stats="hybrimoe": class shares moved towards uniform (with_skew), s fitted by bisection so that a global LRU
# cache of 25% of all routed experts (sim.cache_replay, 256 decode steps, batch 1, seed 0) hits as in HybriMoE
# Fig. 9 (Mixtral 30.2%, DeepSeek 47.7%, Qwen2 45.0%); benchmarks/hybrid_sim.py --fit-stats reproduces it.
# Got: Qwen2 45.1% (s 0.67), DeepSeek 47.8% (s 0.717), Mixtral 31.8% at s = 0 (uniform: the dynamics alone).
HYBRIMOE_SKEW = {"mixtral-8x7b": 0.0, "qwen2-57b-a14b": 0.67, "deepseek-v2-lite": 0.717}
HYBRIMOE_LRU25 = {"mixtral-8x7b": 0.302, "qwen2-57b-a14b": 0.450, "deepseek-v2-lite": 0.477}  # paper Fig. 9
STATS = ("trimoe", "hybrimoe")


def with_skew(p: SynthParams, s: float) -> SynthParams:
    """`p` with its hot and warm token shares moved a fraction `s` of the way from uniform popularity
    (share = class size) to their own values (s = 1: unchanged, s = 0: uniform); spread re-derived."""
    if not 0.0 <= s <= 1.0:
        raise ConfigError(f"skew fraction must be in [0, 1], got {s}")
    hs = p.hot_frac + s * (p.hot_share - p.hot_frac)
    ws = p.warm_frac + s * (p.warm_share - p.warm_frac)
    return replace(p, hot_share=hs, warm_share=ws, spread=ordered_spread(p.class_counts, (hs, ws)))


def preset(spec: Any, *, batch_size: int = 1, seed: int = 0, stats: str = "trimoe") -> SynthParams:
    """Generator knobs for a published model. `spec`: a moetier.specs.ModelSpec (uses name, moe_layers,
    num_experts, top_k, hidden, moe_inter) or a spec name for moetier.specs.load_spec.
    stats="trimoe" (default), with >= 16 experts: TriMoE 3.1's classes -- cold = ceil(71% of E) experts with
    8% of tokens, hot = max(1, round(5% of E)) with 22%, warm (the rest, 22-25% of E) with 70%; inside each
    class shares fall off like Zipf with the steepest exponent (<= 0.5) that keeps the classes ordered. Fewer
    experts (Mixtral's 8, top-2): those classes would route 92% of tokens to 2 experts, so the preset assumes
    a mild skew instead (half the experts take 62% of tokens, no hot class).
    stats="hybrimoe": the same classes made less skewed (`with_skew`, HYBRIMOE_SKEW) to match HybriMoE's
    published LRU hit rates at a 25% cache; only for mixtral-8x7b, qwen2-57b-a14b, deepseek-v2-lite."""
    if stats not in STATS:
        raise ConfigError(f"unknown preset statistics {stats!r}; expected one of {', '.join(STATS)}")
    if isinstance(spec, str):
        spec = load_spec(spec)
    E, k, layers = int(spec.num_experts), int(spec.top_k), tuple(int(x) for x in spec.moe_layers)
    if E >= SMALL_E:
        n_cold = math.ceil(TRIMOE["cold_frac"] * E)
        n_hot = max(1, round(TRIMOE["hot_frac"] * E))
        counts = (n_hot, E - n_cold - n_hot, n_cold)
        hw = (TRIMOE["hot_share"], TRIMOE["warm_share"])
    else:
        counts, hw = (0, E // 2, E - E // 2), (0.0, 0.62)
    classes = {"hot_frac": counts[0] / E, "warm_frac": counts[1] / E, "hot_share": hw[0], "warm_share": hw[1],
               "spread": ordered_spread(counts, hw)}  # fmt: skip
    params = SynthParams(
        num_layers=len(layers), num_experts=E, top_k=k, batch_size=batch_size, seed=seed, moe_layers=layers,
        model=str(spec.name), hidden_size=int(getattr(spec, "hidden", 0)),
        moe_intermediate_size=int(getattr(spec, "moe_inter", 0)), **classes, **PRESET_DYNAMICS,
    )  # fmt: skip
    if stats == "hybrimoe":
        if str(spec.name) not in HYBRIMOE_SKEW:
            raise ConfigError(f"stats='hybrimoe' is fitted only for {', '.join(HYBRIMOE_SKEW)}, not {spec.name!r}")
        return with_skew(params, HYBRIMOE_SKEW[str(spec.name)])
    return params
