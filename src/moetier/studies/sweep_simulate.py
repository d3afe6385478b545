"""The "simulate" sweep point: one synthetic-trace simulation of the two-domain (GPU + CPU) machine of
moetier.sim, as `moetier simulate --synthetic` runs it, returned as flat result columns.

Parameters (grid keys may be plural): model and profile (required), scheduler, cache_policy, cache_ratio,
prefetch, prefetch_depth, fill, precision, warmup_steps, steps, batch_size, prompt_len, seed, stats, and
cpu_tflops (the profile's CPU peak bf16 TFLOPS; refused where the profile prices CPU experts from measured
LUTs at that precision, since the peak would then not be used). ndp_count is refused: this machine has no
NDP DIMMs (the three-domain TriMoE machine is another point).

Invariants: registered in sweep.POINTS as "simulate" on import; a point is a pure function of its
parameters (the trace is generated from the seed); `check` validates a point without generating a trace;
every returned column is a number or a string (one Parquet column each).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moetier.errors import ConfigError
from moetier.studies.sweep import REQUIRED, Point, register_point

DEFAULTS: dict[str, Any] = {
    "model": REQUIRED, "profile": REQUIRED, "scheduler": "hybrimoe", "cache_policy": None, "cache_ratio": 0.25,
    "prefetch": False, "prefetch_depth": 3, "fill": False, "precision": "full", "warmup_steps": 0, "steps": 64,
    "batch_size": 1, "prompt_len": 32, "seed": 0, "stats": "trimoe", "cpu_tflops": None,
}  # fmt: skip
REFUSED = {
    "ndp_count": "the simulate point models the two-domain GPU + CPU machine, which has no NDP DIMMs "
    "(NDP counts need the three-domain TriMoE point)",
}
LANES, LINKS = ("gpu", "cpu", "pcie", "disk"), ("pcie", "disk")
COLUMNS = (
    "tbt_s", "ttft_s", "throughput_tok_s", "moe_layer_s", "prefill_moe_layer_s", "hit_rate", "decode_hit_rate",
    "accesses", "hits", "total_s", "cache_slots", "evictions", "cache_policy_used",
    *(f"util_{lane}" for lane in LANES), *(f"busy_{lane}_s" for lane in LANES), *(f"bytes_{link}" for link in LINKS),
    "moves_demand", "moves_prefetch", "moves_fill", "prefetch_issued", "prefetch_used", "prefetch_accuracy",
)  # fmt: skip


def _with_cpu_tflops(hw: Any, tflops: Any, precision: str) -> Any:
    if isinstance(tflops, bool) or not isinstance(tflops, int | float) or not tflops > 0:
        raise ConfigError(f"cpu_tflops must be a number > 0, got {tflops!r}")
    if hw.cpu.luts.get(precision) and hw.cpu.lut_shape:
        raise ConfigError(f"cpu_tflops: profile {hw.name!r} times {precision} CPU experts from measured LUTs, "
                          f"so a peak TFLOPS would be ignored; use a profile without CPU LUTs")  # fmt: skip
    return replace(hw, cpu=replace(hw.cpu, peak_flops=float(tflops) * 1e12))


def _inputs(p: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(spec, profile, SimConfig, synthetic params) of a point; ConfigError on any bad value."""
    from moetier.policies.costmodel import load_profile
    from moetier.policies.schedulers import make_scheduler
    from moetier.sim import SimConfig
    from moetier.specs import load_spec
    from moetier.studies.synthetic import preset

    for name in REFUSED:
        if p.get(name) is not None:
            raise ConfigError(f"{name}: {REFUSED[name]}")
    for name in ("steps", "batch_size", "prefetch_depth"):
        if isinstance(p[name], bool) or not isinstance(p[name], int) or p[name] < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {p[name]!r}")
    if isinstance(p["prompt_len"], bool) or not isinstance(p["prompt_len"], int) or p["prompt_len"] < 0:
        raise ConfigError(f"prompt_len must be an integer >= 0, got {p['prompt_len']!r}")
    make_scheduler(p["scheduler"])
    spec, hw = load_spec(str(p["model"])), load_profile(str(p["profile"]))
    if p["cpu_tflops"] is not None:
        hw = _with_cpu_tflops(hw, p["cpu_tflops"], p["precision"])
    cfg = SimConfig(
        scheduler=p["scheduler"], cache_policy=p["cache_policy"], cache_ratio=p["cache_ratio"],
        prefetch=p["prefetch"], prefetch_depth=p["prefetch_depth"], fill=p["fill"], batch_size=p["batch_size"],
        prompt_len=p["prompt_len"], seed=p["seed"], precision=p["precision"], warmup_steps=p["warmup_steps"],
    )  # fmt: skip
    synth = preset(spec, batch_size=p["batch_size"], seed=p["seed"], stats=p["stats"])
    return spec, hw, cfg, synth


def check_simulate(p: dict[str, Any]) -> None:
    """Validate one point's parameters (spec, profile, scheduler, SimConfig, preset) without simulating."""
    from moetier.policies.costmodel import CostModel

    spec, hw, cfg, _ = _inputs(p)
    CostModel(hw, spec, cfg.precision)


def simulate_point(p: dict[str, Any]) -> dict[str, Any]:
    """Generate the point's synthetic trace (warm-up + steps decode steps) and simulate it."""
    from moetier.sim import simulate
    from moetier.studies.synthetic import generate
    from moetier.traces import iter_calls

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
    return out


register_point("simulate", Point(simulate_point, DEFAULTS, REFUSED, check_simulate, COLUMNS))

__all__ = ["COLUMNS", "DEFAULTS", "REFUSED", "check_simulate", "simulate_point"]
