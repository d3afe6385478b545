"""The "tri" sweep point: one synthetic-trace decode simulation of the three-domain (GPU + AMX CPU + DIMM-NDP)
TriMoE machine of moetier.sim.tri, as `moetier simulate --scheduler trimoe ... --synthetic` runs it, returned as
flat result columns.

Parameters (grid keys may be plural): model (required), scheduler (trimoe, klotski, ktransformers-plus, monde,
gpu-ndp), batch_size, steps, seed, ndp_count (NDP DIMMs), cpu_tflops_scale (AMX CPU TFLOPS relative to the
profile's, paper 5.4.2), hbm_ratio (fraction of each layer's routed experts HBM holds), refinement, relayout,
profile (default h100-8470, TriMoE's Table 1 machine), context (KV tokens per sequence), drift (popularity
rank swaps per layer per step of the synthetic trace; default: the preset's) and contention (eq. 6 reading,
"array" or "channel"; default: the profile's). The two-domain
point's parameters are refused with the reason (cache_ratio: use hbm_ratio; cpu_tflops: use cpu_tflops_scale).

Invariants: registered in sweep.POINTS as "tri" on import; a point is a pure function of its parameters (the
calls come from sim.tri.synthetic_calls with the seed); `check` validates a point without generating calls;
every returned column is a number (one Parquet column each, the same type on every row).
"""

from __future__ import annotations

from typing import Any

from moetier.errors import ConfigError
from moetier.studies.sweep import REQUIRED, Point, register_point

DEFAULTS: dict[str, Any] = {
    "model": REQUIRED, "scheduler": "trimoe", "batch_size": 512, "steps": 8, "seed": 0, "ndp_count": 16,
    "cpu_tflops_scale": 1.0, "hbm_ratio": 0.1, "refinement": True, "relayout": True, "profile": "h100-8470",
    "context": 1024, "drift": None, "contention": None,
}  # fmt: skip
_TWO = "is a parameter of the two-domain simulate point; the three-domain machine does not use it"
REFUSED = {
    "cache_ratio": "the three-domain machine sizes HBM per layer: use hbm_ratio",
    "cpu_tflops": "the three-domain machine scales the profile's AMX CPU: use cpu_tflops_scale (1.0 = the profile's)",
    **{name: _TWO for name in ("cache_policy", "prefetch", "prefetch_depth", "fill", "precision", "warmup_steps",
                               "prompt_len", "stats")},
}  # fmt: skip
DOMAINS = ("gpu", "cpu", "ndp")
PREDICTOR = ("accuracy", "hot_precision", "hot_recall", "change_accuracy", "rel_error")
MIGRATION_COUNTS = ("prefetch", "relayout", "migrate")
MIGRATION_TIMES = ("pcie_s", "dimm_link_s", "pcie_bytes", "dimm_link_bytes", "window_s", "link_frac")
COLUMNS = (
    "moe_step_s", "step_s", "throughput_tok_s", "moe_s", "greedy_moe_s", "dense_s", "batch", "calls", "routed",
    "moves", *(f"busy_{d}" for d in (*DOMAINS, "dimm")), *(f"flop_util_{d}" for d in DOMAINS),
    *(f"compute_{d}" for d in DOMAINS),
    *(f"experts_{d}" for d in DOMAINS), *(f"predictor_{k}" for k in PREDICTOR),
    *(f"migration_{k}" for k in (*MIGRATION_COUNTS, *MIGRATION_TIMES)),
)  # fmt: skip


def _config(p: dict[str, Any]) -> Any:
    """(TriSimConfig) of a point; ConfigError on any bad value."""
    from moetier.sim.tri import TriSimConfig

    for name in REFUSED:
        if p.get(name) is not None:
            raise ConfigError(f"{name}: {REFUSED[name]}")
    for name in ("refinement", "relayout"):
        if not isinstance(p[name], bool):
            raise ConfigError(f"{name} must be true or false, got {p[name]!r}")
    scale = p["cpu_tflops_scale"]
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ConfigError(f"cpu_tflops_scale must be a number > 0, got {scale!r}")
    return TriSimConfig(  # checks drift and contention itself
        drift=p["drift"], contention=p["contention"], scheduler=str(p["scheduler"]),
        n_dimms=p["ndp_count"], cpu_scale=float(scale), hbm_ratio=p["hbm_ratio"],
        batch_size=p["batch_size"], steps=p["steps"], seed=p["seed"], refinement=p["refinement"],
        relayout=p["relayout"], context=p["context"], profile=str(p["profile"]),
    )  # fmt: skip


def check_tri(p: dict[str, Any]) -> None:
    """Validate one point's parameters (TriSimConfig, spec, the profile's NDP section) without simulating."""
    from moetier.sim.ndp import load_ndp
    from moetier.specs import load_spec

    cfg = _config(p)
    load_spec(str(p["model"]))
    load_ndp(cfg.profile)


def tri_point(p: dict[str, Any]) -> dict[str, Any]:
    """Generate the point's synthetic decode calls (batch_size x steps) and simulate them on the TriMoE machine."""
    from moetier.sim.tri import simulate_tri, synthetic_calls
    from moetier.specs import load_spec

    cfg = _config(p)
    spec = load_spec(str(p["model"]))
    r = simulate_tri(spec, synthetic_calls(spec, cfg), cfg)
    out: dict[str, Any] = {
        "moe_step_s": r.moe_s / r.steps, "step_s": r.step_s, "throughput_tok_s": r.throughput_tok_s,
        "moe_s": r.moe_s, "greedy_moe_s": r.greedy_moe_s, "dense_s": r.dense_s, "batch": float(r.batch),
        "calls": r.calls, "routed": r.routed, "moves": r.moves,
    }  # fmt: skip
    out.update({f"busy_{d}": float(r.busy[d]) for d in (*DOMAINS, "dimm")})
    out.update({f"flop_util_{d}": float(r.flop_util[d]) for d in DOMAINS})
    out.update({f"compute_{d}": float(r.compute[d]) for d in DOMAINS})
    out.update({f"experts_{d}": int(r.experts[d]) for d in DOMAINS})
    out.update({f"predictor_{k}": float(r.predictor[k]) for k in PREDICTOR})
    out.update({f"migration_{k}": int(r.migration[k]) for k in MIGRATION_COUNTS})
    out.update({f"migration_{k}": float(r.migration[k]) for k in MIGRATION_TIMES})
    return out


register_point("tri", Point(tri_point, DEFAULTS, REFUSED, check_tri, COLUMNS))

__all__ = ["COLUMNS", "DEFAULTS", "REFUSED", "check_tri", "tri_point"]
