"""The "tri" sweep point: one synthetic-trace decode simulation of the three-domain (GPU + AMX CPU + DIMM-NDP)
TriMoE machine of moetier.sim.tri, as `moetier simulate-tri --synthetic` runs it, returned as flat result
columns; and `synthetic_calls`, the decode calls both of them replay.

Parameters (grid keys may be plural): model (required), then every field of sim.tri.TriSimConfig under its own
name and default (scheduler, ndp_count, cpu_tflops_scale, hbm_ratio, batch_size, steps, seed, refinement,
relayout, context, profile, max_iters, regime, drift, step_noise, contention, dimm_link, kv_home, prefill_tokens,
output_len, warmup_steps, cpu_profile; their meaning is documented there). warmup_steps = W generates W more decode
steps before the `steps` replayed ones: the untimed profiling window the offline layout, every system's HBM set and
the predictor start from (the study's sweep files use W = WARMUP_STEPS; the default 0 is the first-call
placement). The two-domain machine's parameters (sim.config.SimConfig's other fields, stats, cpu_tflops) are
refused with the reason.
TriSimConfig checks every value (a ConfigError naming the field); this module restates no check.

Invariants: listed in sweep_grid.POINTS as "tri"; a point is a pure function of its parameters (the
calls come from `synthetic_calls` with the seed); `check` validates a point without generating calls;
every returned column is a number (one Parquet column each, the same type on every row).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from moetier.sim.config import SimConfig
from moetier.sim.ndp import load_ndp
from moetier.sim.tri import TriSimConfig, simulate_tri
from moetier.specs import ModelSpec, load_spec
from moetier.studies import synthetic
from moetier.studies.point import REQUIRED, Point
from moetier.traces import Call, iter_calls

CONFIG = tuple(f.name for f in fields(TriSimConfig))  # the point parameters that are TriSimConfig fields
DEFAULTS: dict[str, Any] = {"model": REQUIRED, **{f.name: f.default for f in fields(TriSimConfig)}}
_TWO = "is a parameter of the two-domain simulate point; the three-domain machine does not use it"
REFUSED = {
    **{name: _TWO for name in (*(f.name for f in fields(SimConfig)), "stats") if name not in DEFAULTS},
    "cache_ratio": "the three-domain machine sizes HBM per layer: use hbm_ratio",
    "cpu_tflops": "the three-domain machine scales the profile's AMX CPU: use cpu_tflops_scale (1.0 = the profile's)",
}  # fmt: skip
DOMAINS = ("gpu", "cpu", "ndp")
PREDICTOR = ("accuracy", "hot_precision", "hot_recall", "change_accuracy", "rel_error", "decisions",
             "decision_accuracy")  # fmt: skip
STEP_UTIL = ("busy_gpu", "compute_gpu", "busy_cpu", "compute_cpu", "compute_ndp")
MIGRATION_COUNTS = ("prefetch", "relayout", "migrate")
MIGRATION_TIMES = ("pcie_s", "dimm_link_s", "pcie_bytes", "dimm_link_bytes", "window_s", "link_frac", "moves_max",
                   "moves_mean", "move_s")  # fmt: skip
KV = ("bytes", "pcie_s", "exposed_s")
COLUMNS = (
    "moe_step_s", "step_s", "throughput_tok_s", "moe_s", "greedy_moe_s", "dense_s", "batch", "calls", "routed",
    "moves", "prefill_s", "e2e_tok_s", *(f"step_{k}" for k in STEP_UTIL),
    *(f"busy_{d}" for d in (*DOMAINS, "dimm")), *(f"flop_util_{d}" for d in DOMAINS),
    *(f"compute_{d}" for d in DOMAINS),
    *(f"experts_{d}" for d in DOMAINS), *(f"predictor_{k}" for k in PREDICTOR),
    *(f"migration_{k}" for k in (*MIGRATION_COUNTS, *MIGRATION_TIMES)), *(f"kv_{k}" for k in KV),
)  # fmt: skip


WARMUP_STEPS = 16  # the profiling window the study and `moetier simulate-tri` use (docs/trimoe.md)


def synthetic_calls(spec: ModelSpec, config: TriSimConfig) -> list[Call]:
    """Decode calls of a TriMoE-3.1 synthetic trace (synthetic.preset) at config.batch_size for
    config.warmup_steps + config.steps steps (the first warmup_steps are simulate_tri's profiling window), in
    the trace regime config.trace_regime() gives (sim.tri.REGIMES: its drift rank swaps per layer per step, the
    preset's when None, and its step_noise, stationary batch-shared noise per step; the preset's shares kept)."""
    p = synthetic.preset(spec, batch_size=config.batch_size, seed=config.seed)
    drift, noise = config.trace_regime()
    if drift is not None:
        p = replace(p, drift=float(drift))
    if noise:
        p = replace(p, step_noise=float(noise))
    return iter_calls(synthetic.generate(p, config.warmup_steps + config.steps, with_scores=False))


def check_tri(p: dict[str, Any]) -> None:
    """Validate one point's parameters (TriSimConfig, spec, the profile's NDP section) without simulating."""
    cfg = TriSimConfig(**{k: p[k] for k in CONFIG})
    load_spec(str(p["model"]))
    load_ndp(cfg.profile)


def tri_point(p: dict[str, Any]) -> dict[str, Any]:
    """Generate the point's synthetic decode calls (batch_size x steps) and simulate them on the TriMoE machine."""
    cfg = TriSimConfig(**{k: p[k] for k in CONFIG})
    spec = load_spec(str(p["model"]))
    r = simulate_tri(spec, synthetic_calls(spec, cfg), cfg)
    out: dict[str, Any] = {
        "moe_step_s": r.moe_s / r.steps, "step_s": r.step_s, "throughput_tok_s": r.throughput_tok_s,
        "moe_s": r.moe_s, "greedy_moe_s": r.greedy_moe_s, "dense_s": r.dense_s, "batch": float(r.batch),
        "calls": r.calls, "routed": r.routed, "moves": r.moves,
    }  # fmt: skip
    out.update(prefill_s=float(r.prefill_s), e2e_tok_s=float(r.e2e_tok_s))
    out.update({f"step_{k}": float(r.step_util[k]) for k in STEP_UTIL})
    out.update({f"busy_{d}": float(r.busy[d]) for d in (*DOMAINS, "dimm")})
    out.update({f"flop_util_{d}": float(r.flop_util[d]) for d in DOMAINS})
    out.update({f"compute_{d}": float(r.compute[d]) for d in DOMAINS})
    out.update({f"experts_{d}": int(r.experts[d]) for d in DOMAINS})
    out.update({f"predictor_{k}": float(r.predictor[k]) for k in PREDICTOR})
    out.update({f"migration_{k}": int(r.migration[k]) for k in MIGRATION_COUNTS})
    out.update({f"migration_{k}": float(r.migration[k]) for k in MIGRATION_TIMES})
    out.update({f"kv_{k}": float(r.kv[k]) for k in KV})
    return out


POINT = Point(tri_point, DEFAULTS, REFUSED, check_tri, COLUMNS)

__all__ = ["COLUMNS", "CONFIG", "DEFAULTS", "POINT", "REFUSED", "WARMUP_STEPS", "check_tri", "synthetic_calls",
           "tri_point"]  # fmt: skip
