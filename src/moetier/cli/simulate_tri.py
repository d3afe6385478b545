"""`moetier simulate --scheduler trimoe|klotski|ktransformers-plus|monde|gpu-ndp`: the three-domain (GPU + AMX
CPU + DIMM-NDP) branch of `moetier simulate`, running moetier.sim.tri instead of the two-domain simulator.

cli_simulate.simulate_cmd dispatches here when the scheduler is one of sim.tri.SYSTEMS. Thin: flags ->
TriSimConfig, trace or synthetic calls -> simulate_tri -> a rich table or, with --json, one JSON line (the
TriSimResult's fields plus moe_step_s, the config and the source).

Invariants (as cli_simulate): a flag of the other simulator, given on the command line, is one line
`error: ...` naming every such flag (exit 2), checked before any trace work; the JSON line is the
TriSimResult's fields, flattened only as dataclasses.asdict does (busy, flop_util, experts, predictor,
migration stay objects).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier.cli.tables import metric_table
from moetier.errors import ConfigError

_TRI = "Three-domain simulation (trimoe, klotski, ktransformers-plus, monde, gpu-ndp)"
NdpCountOpt = Annotated[int, typer.Option("--ndp-count", min=1, rich_help_panel=_TRI,
                        help="NDP DIMMs (three-domain schedulers).")]  # fmt: skip
CpuScaleOpt = Annotated[float, typer.Option("--cpu-tflops-scale", rich_help_panel=_TRI,
                        help="AMX CPU TFLOPS relative to the profile's (three-domain schedulers).")]  # fmt: skip
HbmOpt = Annotated[float, typer.Option("--hbm-ratio", rich_help_panel=_TRI,
                   help="Fraction in [0, 1] of each layer's routed experts HBM holds (three-domain).")]  # fmt: skip
NoRefineOpt = Annotated[bool, typer.Option("--no-refinement", rich_help_panel=_TRI,
                        help="Skip the bottleneck-aware refinement (greedy start only; trimoe, gpu-ndp).")]  # fmt: skip
NoRelayoutOpt = Annotated[bool, typer.Option("--no-relayout", rich_help_panel=_TRI,
                          help="No relayout / cold rebalancing over the DIMM-Link (trimoe, gpu-ndp).")]  # fmt: skip
DriftOpt = Annotated[float | None, typer.Option("--drift", min=0.0, rich_help_panel=_TRI,
                     help="Synthetic trace: popularity rank swaps per layer per step (preset: 0.02).")]  # fmt: skip
ContentionOpt = Annotated[str | None, typer.Option("--contention", rich_help_panel=_TRI,
                          help="Eq. 6 contention reading: array (default) or channel (docs/trimoe.md).")]  # fmt: skip

# Parameters (simulate_cmd's names) that only one simulator uses; --spec, --trace, --synthetic, --steps,
# --seed, --batch-size, --profile and --json are shared.
TRI_ONLY = ("ndp_count", "cpu_tflops_scale", "hbm_ratio", "no_refinement", "no_relayout", "drift", "contention")
TWO_ONLY = (
    "prompt_len", "cache_policy", "cache_ratio", "prefetch", "prefetch_depth", "prefetch_accuracy", "precision",
    "stats", "warmup_steps", "prefill_admit", "timeline", "timeline_steps", "timeline_layers",
)  # fmt: skip


def is_tri(scheduler: str) -> bool:
    """Whether `scheduler` names a three-domain system (sim.tri.SYSTEMS)."""
    from moetier.sim.tri import SYSTEMS

    return scheduler in SYSTEMS


def check_flags(ctx: typer.Context, tri: bool) -> None:
    """ConfigError naming every flag given on the command line that the chosen simulator cannot use."""
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.opts}
    sources = {n: getattr(ctx.get_parameter_source(n), "name", "DEFAULT") for n in flags}  # typer may vendor click
    given = {n for n, src in sources.items() if src not in ("DEFAULT", "DEFAULT_MAP")}
    bad = [flags[n] for n in (TWO_ONLY if tri else TRI_ONLY) if n in given]
    if bad:
        which = "the three-domain schedulers (trimoe, klotski, ktransformers-plus, monde, gpu-ndp)" if tri else (
            "the two-domain schedulers (hybrimoe, ktransformers, llamacpp, gpu-lru, fiddler)")  # fmt: skip
        raise ConfigError(f"{', '.join(bad)} cannot be used with {which}")


def _tri_calls(spec_name: str | None, trace: Path | None, synthetic: bool, cfg: Any,
               steps: int | None, batch: int | None) -> tuple[Any, list[Any], str]:  # fmt: skip
    """(spec, decode calls, source): synthetic (sim.tri.synthetic_calls) or a trace's first `steps` decode steps."""
    from moetier.cli.simulate import _calls, source_spec
    from moetier.sim.tri import synthetic_calls

    spec = source_spec(spec_name, trace, synthetic)
    if spec is not None:
        return spec, synthetic_calls(spec, cfg), f"synthetic {spec.name} preset (trimoe statistics), seed {cfg.seed}"
    if batch is not None:
        raise ConfigError("--batch-size applies to --synthetic only (a trace's calls keep their own tokens)")
    spec, calls, source = _calls(spec_name, trace, False, None, 0, None, None)
    decode = [c for c in calls if c.step > 0]  # step 0 is the prefill chunk
    kept = sorted({c.step for c in decode})[: steps or None]
    if not kept:
        raise ConfigError(f"{trace}: no decode steps (step > 0) to replay")
    if steps is not None and len(kept) < steps:
        raise ConfigError(f"{trace}: --steps {steps} but the trace holds {len(kept)} decode steps")
    last = kept[-1]
    return spec, [c for c in decode if c.step <= last], source


def tri_table(d: dict[str, Any], source: str) -> Table:
    """Metric / value rows of one three-domain simulation (the --json payload)."""
    title = (f"{d['model']} on {d['profile']}: {d['scheduler']}, {d['ndp_count']} NDP DIMMs, CPU x"
             f"{d['cpu_tflops_scale']:g}, HBM {d['hbm_ratio']:g}")  # fmt: skip
    pred, mig = d["predictor"], d["migration"]
    rows = [
        ("MoE time per step", f"{d['moe_step_s'] * 1e3:.3f} ms ({d['steps']} steps, {d['calls']} calls)"),
        ("step time", f"{d['step_s'] * 1e3:.3f} ms (batch {d['batch']:g})"),
        ("throughput", f"{d['throughput_tok_s']:.1f} tok/s"),
        ("greedy-start MoE / step", f"{d['greedy_moe_s'] / d['steps'] * 1e3:.3f} ms ({d['moves']} refinement moves)"),
    ]
    rows += [(f"busy {k}", f"{100 * v:.1f}%") for k, v in d["busy"].items()]
    rows += [(f"FLOP utilisation {k}", f"{100 * v:.2f}%") for k, v in d["flop_util"].items()]
    rows += [(f"experts on {k}", str(v)) for k, v in d["experts"].items()]
    rows.append(("predictor accuracy", f"{100 * pred['accuracy']:.1f}% (hot recall {100 * pred['hot_recall']:.1f}%)"))
    rows.append(("prefetch / relayout / migrate", f"{mig['prefetch']} / {mig['relayout']} / {mig['migrate']}"))
    rows.append(("link time / total time", f"{100 * mig['link_frac']:.2f}%"))
    return metric_table(title, rows, source)


def run_tri(
    *, scheduler: str, profile: str | None, spec: str | None, trace: Path | None, synthetic: bool,
    steps: int | None, seed: int, batch_size: int | None, ndp_count: int, cpu_tflops_scale: float,
    hbm_ratio: float, no_refinement: bool, no_relayout: bool, drift: float | None = None,
    contention: str | None = None,
) -> tuple[dict[str, Any], str]:  # fmt: skip
    """Flags -> (the JSON payload, the source line) of one three-domain simulation."""
    from moetier.sim.ndp import load_ndp
    from moetier.sim.tri import TriSimConfig, simulate_tri

    base = TriSimConfig()
    cfg = TriSimConfig(
        scheduler=scheduler, n_dimms=ndp_count, cpu_scale=cpu_tflops_scale, hbm_ratio=hbm_ratio,
        batch_size=batch_size or base.batch_size, steps=steps or base.steps, seed=seed,
        refinement=not no_refinement, relayout=not no_relayout, profile=profile or base.profile, drift=drift,
        contention=contention,
    )  # fmt: skip
    if drift is not None and not synthetic:
        raise ConfigError("--drift applies to --synthetic traces only")
    load_ndp(cfg.profile)  # an unknown profile fails before any trace work
    model, calls, source = _tri_calls(spec, trace, synthetic, cfg, steps, batch_size)
    result = simulate_tri(model, calls, cfg)
    payload = asdict(result)
    payload.update(moe_step_s=result.moe_s / result.steps, profile=cfg.profile, ndp_count=cfg.n_dimms,
                   cpu_tflops_scale=cfg.cpu_scale, hbm_ratio=cfg.hbm_ratio, refinement=cfg.refinement,
                   relayout=cfg.relayout, seed=cfg.seed, source=source, drift=cfg.drift,
                   contention=cfg.contention or "array")  # fmt: skip
    return payload, source


__all__ = ["TRI_ONLY", "TWO_ONLY", "check_flags", "is_tri", "run_tri", "tri_table"]
