"""The "simulate" sweep point: one synthetic-trace simulation of the two-domain (GPU + CPU) machine of
moetier.sim, as `moetier simulate --synthetic` runs it, returned as flat result columns.

Parameters (grid keys may be plural): model and profile (required); every scalar field of sim.config.SimConfig
under its own name and default (scheduler, cache_policy, cache_ratio, prefetch, prefetch_depth, prefetch_max,
fill, batch_size, prompt_len, steps, warmup_steps, prefill_admit, seed, precision; their meaning is documented
there), except that the synthetic trace's sizes default as `moetier simulate --synthetic` does (steps 64,
batch_size 1, prompt_len 32); stats (the synthetic trace's statistics, studies.synthetic.preset) and
cpu_tflops (the profile's CPU peak bf16 TFLOPS; refused where the profile prices CPU experts from measured
LUTs at that precision, since the peak would then not be used). Not parameters: prefetch_accuracy (a list,
not a grid scalar) and the timeline window (sweeps draw no timeline). The three-domain machine's parameters
(sim.tri.TriSimConfig's other fields) are refused: this machine has no NDP DIMMs. SimConfig checks every value
of its fields (a ConfigError naming the field); this module restates no check.

Invariants: listed in sweep_grid.POINTS as "simulate"; a point is a pure function of its
parameters (the trace is generated from the seed); `check` validates a point without generating a trace;
every returned column is a number or a string (one Parquet column each).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from moetier.errors import ConfigError
from moetier.policies.costmodel import CostModel, HardwareProfile, load_profile
from moetier.sim import SimConfig, simulate
from moetier.sim.tri import TriSimConfig
from moetier.specs import ModelSpec, load_spec
from moetier.studies.point import REQUIRED, Point
from moetier.studies.synthetic import SynthParams, generate, preset
from moetier.traces import iter_calls

_NOT_SWEPT = ("prefetch_accuracy", "timeline_steps", "timeline_layers")
CONFIG = tuple(f.name for f in fields(SimConfig) if f.name not in _NOT_SWEPT)  # point parameters = SimConfig fields
DEFAULTS: dict[str, Any] = {
    "model": REQUIRED, "profile": REQUIRED, **{f.name: f.default for f in fields(SimConfig) if f.name in CONFIG},
    "steps": 64, "batch_size": 1, "prompt_len": 32,  # the synthetic trace's sizes (SimConfig's None: the trace's)
    "stats": "trimoe", "cpu_tflops": None,
}  # fmt: skip
_TRI = "is a parameter of the three-domain tri point; the two-domain GPU + CPU machine does not use it"
REFUSED = {
    **{f.name: _TRI for f in fields(TriSimConfig) if f.name not in DEFAULTS},
    "ndp_count": "the simulate point models the two-domain GPU + CPU machine, which has no NDP DIMMs "
    "(NDP counts need the three-domain TriMoE point)",
}
LANES, LINKS = ("gpu", "cpu", "pcie", "disk"), ("pcie", "disk")
COLUMNS = (
    "tbt_s", "ttft_s", "throughput_tok_s", "moe_layer_s", "prefill_moe_layer_s", "hit_rate", "decode_hit_rate",
    "accesses", "hits", "total_s", "cache_slots", "evictions", "cache_policy_used",
    *(f"util_{lane}" for lane in LANES), *(f"busy_{lane}_s" for lane in LANES), *(f"bytes_{link}" for link in LINKS),
    "moves_demand", "moves_prefetch", "moves_fill", "prefetch_issued", "prefetch_used", "prefetch_accuracy",
    "prefetch_accuracy_d1", "prefetch_accuracy_d2", "prefetch_accuracy_d3", "gate_dropped_frac",
)  # fmt: skip


def _with_cpu_tflops(hw: HardwareProfile, tflops: Any, precision: str) -> HardwareProfile:
    if isinstance(tflops, bool) or not isinstance(tflops, int | float) or not tflops > 0:
        raise ConfigError(f"cpu_tflops must be a number > 0, got {tflops!r}")
    if hw.cpu.luts.get(precision) and hw.cpu.lut_shape:
        raise ConfigError(f"cpu_tflops: profile {hw.name!r} times {precision} CPU experts from measured LUTs, "
                          f"so a peak TFLOPS would be ignored; use a profile without CPU LUTs")  # fmt: skip
    return replace(hw, cpu=replace(hw.cpu, peak_flops=float(tflops) * 1e12))


def _inputs(p: dict[str, Any]) -> tuple[ModelSpec, HardwareProfile, SimConfig, SynthParams]:
    """(spec, profile, SimConfig, synthetic params) of a point; ConfigError on any bad value."""
    cfg = SimConfig(**{k: p[k] for k in CONFIG})
    spec, hw = load_spec(str(p["model"])), load_profile(str(p["profile"]))
    if p["cpu_tflops"] is not None:
        hw = _with_cpu_tflops(hw, p["cpu_tflops"], cfg.precision)
    synth = preset(spec, batch_size=p["batch_size"], seed=p["seed"], stats=p["stats"])
    return spec, hw, cfg, synth


def check_simulate(p: dict[str, Any]) -> None:
    """Validate one point's parameters (spec, profile, SimConfig, preset) without simulating."""
    spec, hw, cfg, _ = _inputs(p)
    CostModel(hw, spec, cfg.precision)


def simulate_point(p: dict[str, Any]) -> dict[str, Any]:
    """Generate the point's synthetic trace (warm-up + steps decode steps) and simulate it."""
    spec, hw, cfg, synth = _inputs(p)
    trace = generate(synth, p["steps"] + p["warmup_steps"], prompt_len=p["prompt_len"])
    d = simulate(spec, hw, iter_calls(trace), cfg).as_dict()
    out: dict[str, Any] = {c: d[c] for c in COLUMNS[:12]}
    out["cache_policy_used"] = d["cache_policy"]
    out.update({f"util_{lane}": d["utilization"].get(lane, 0.0) for lane in LANES})
    out.update({f"busy_{lane}_s": d["busy_s"].get(lane, 0.0) for lane in LANES})
    out.update({f"bytes_{link}": d["link_bytes"].get(link, 0) for link in LINKS})
    out.update({f"moves_{kind}": d["moves"].get(kind, 0) for kind in ("demand", "prefetch", "fill")})
    out.update({f"prefetch_{k}": d["prefetch"][k] for k in ("issued", "used", "accuracy")})
    by_d = d["prefetch"]["accuracy_by_distance"]
    out.update({f"prefetch_accuracy_d{n}": float(by_d.get(str(n), 0.0)) for n in (1, 2, 3)})
    out["gate_dropped_frac"] = float(d["gating"].get("dropped_frac", 0.0))
    return out


POINT = Point(simulate_point, DEFAULTS, REFUSED, check_simulate, COLUMNS)

__all__ = ["COLUMNS", "CONFIG", "DEFAULTS", "POINT", "REFUSED", "check_simulate", "simulate_point"]
