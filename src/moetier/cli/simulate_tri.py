"""`moetier simulate-tri`: replay decode calls (a recorded trace's decode steps, or synthetic for a spec) on the
three-domain (GPU + AMX CPU + DIMM-NDP) TriMoE machine (moetier.sim.tri) under one of its schedulers
(policies.schedulers.TRI_SCHEDULERS: trimoe, klotski, ktransformers-plus, monde, gpu-ndp). The two-domain
machine is `moetier simulate` (simulate.py).

Registered on the main app by cli/app.py (`register(app)`). Thin: flags -> TriSimConfig (which checks them),
trace or synthetic calls (sim_inputs.py, studies.sweep_tri.synthetic_calls) -> simulate_tri -> a rich table
or, with --json, one JSON line (the TriSimResult's fields plus moe_step_s, the config and the source).

Invariants (as cli/app.py): bad input is one line `error: ...` on stderr and exit 2, checked before any
trace work where it can be; the JSON line is the TriSimResult's fields, flattened only as dataclasses.asdict
does (busy, flop_util, compute, step_util, experts, predictor, migration stay objects).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier import traces
from moetier.cli.console import consoles, emit_json, register_command, user_errors
from moetier.cli.options import JsonOut
from moetier.cli.sim_inputs import PANEL, SeedOpt, SpecOpt, SyntheticOpt, TraceOpt, source_spec, trace_calls
from moetier.cli.tables import metric_table
from moetier.errors import ConfigError
from moetier.policies.schedulers import TRI_SCHEDULERS
from moetier.report.record import SimRunDirOpt, write_simulation
from moetier.sim.ndp import load_ndp
from moetier.sim.tri import DIMM_LINK, KV_HOMES, REGIMES, TriSimConfig, machine_profile, simulate_tri
from moetier.specs import ModelSpec
from moetier.studies.sweep_tri import WARMUP_STEPS, synthetic_calls

_TRI = "Three-domain machine"
_BASE = TriSimConfig()
SchedOpt = Annotated[str, typer.Option("--scheduler", rich_help_panel=PANEL,
                     help=f"{', '.join(TRI_SCHEDULERS)} (policies.schedulers.TRI_SCHEDULERS).")]  # fmt: skip
ProfileOpt = Annotated[str, typer.Option("--profile", rich_help_panel=PANEL,
                       help="Hardware profile with an NDP section: a profile name or a profile "
                            ".json.")]  # fmt: skip
StepsOpt = Annotated[int | None, typer.Option("--steps", min=1, rich_help_panel=PANEL,
                     help=f"Decode steps to simulate (synthetic default {_BASE.steps}; trace default: "
                          "all).")]  # fmt: skip
BatchOpt = Annotated[int | None, typer.Option("--batch-size", min=1, rich_help_panel=PANEL,
                     help=f"Sequences per step of a synthetic trace (default {_BASE.batch_size}; a trace's calls "
                          "keep their own).")]  # fmt: skip
NdpCountOpt = Annotated[int, typer.Option("--ndp-count", min=1, rich_help_panel=_TRI, help="NDP DIMMs.")]
CpuScaleOpt = Annotated[float, typer.Option("--cpu-tflops-scale", rich_help_panel=_TRI,
                        help="AMX CPU TFLOPS relative to the profile's.")]  # fmt: skip
CpuProfileOpt = Annotated[str | None, typer.Option("--cpu-profile", metavar="PROFILE", rich_help_panel=_TRI,
                          help="A measured profile (`moetier profile`, ideally on an AMX machine) whose CPU compute "
                               "replaces the profile's for every system; host-memory reads stay the profile's "
                               "DIMMs.")]  # fmt: skip
HbmOpt = Annotated[float, typer.Option("--hbm-ratio", rich_help_panel=_TRI,
                   help="Fraction in [0, 1] of each layer's routed experts HBM holds.")]  # fmt: skip
NoRefineOpt = Annotated[bool, typer.Option("--no-refinement", rich_help_panel=_TRI,
                        help="Skip the bottleneck-aware refinement (greedy start only; trimoe, gpu-ndp).")]  # fmt: skip
NoRelayoutOpt = Annotated[bool, typer.Option("--no-relayout", rich_help_panel=_TRI,
                          help="No relayout / cold rebalancing over the DIMM-Link (trimoe, gpu-ndp).")]  # fmt: skip
RegimeOpt = Annotated[str, typer.Option("--regime", rich_help_panel=_TRI,
                      help=f"Synthetic trace regime: {', '.join(REGIMES)} (paper: calibrated on TriMoE's 78% "
                           "migration decision accuracy; docs/trimoe.md).")]  # fmt: skip
DriftOpt = Annotated[float | None, typer.Option("--drift", min=0.0, rich_help_panel=_TRI,
                     help="Synthetic trace: popularity rank swaps per layer per step (default: the "
                          "regime's).")]  # fmt: skip
StepNoiseOpt = Annotated[float | None, typer.Option("--step-noise", min=0.0, rich_help_panel=_TRI,
                         help="Synthetic trace: sd of a batch-shared router-logit offset per step, layer and "
                              "expert (stationary popularity, the preset's shares kept; default: the "
                              "regime's).")]  # fmt: skip
ContentionOpt = Annotated[str | None, typer.Option("--contention", rich_help_panel=_TRI,
                          help="Eq. 6 contention reading: channel (default) or array (docs/trimoe.md).")]  # fmt: skip
DimmLinkOpt = Annotated[str, typer.Option("--dimm-link", rich_help_panel=_TRI,
                        help=f"DIMM-Link move pricing: {', '.join(DIMM_LINK)} (calibrated: TriMoE 5.5's four "
                             "experts in 0.63 ms; per-link: Table 1's 25 GB/s per link; all-links: spread over "
                             "every DIMM's link).")]  # fmt: skip
KvHomeOpt = Annotated[str, typer.Option("--kv-home", rich_help_panel=_TRI,
                      help=f"Where the KV cache lives: {', '.join(KV_HOMES)} (host: TriMoE 4.1, streamed over "
                           "PCIe for attention).")]  # fmt: skip
PrefillOpt = Annotated[int, typer.Option("--prefill-tokens", min=0, rich_help_panel=_TRI,
                       help="Prompt tokens per sequence for a GPU prefill phase (0: none).")]  # fmt: skip
OutputLenOpt = Annotated[int, typer.Option("--output-len", min=0, rich_help_panel=_TRI,
                         help="Decode tokens per sequence for the end-to-end throughput (0: the simulated "
                              "steps).")]  # fmt: skip
WarmupOpt = Annotated[int, typer.Option("--warmup-steps", min=0, rich_help_panel=_TRI,
                      help="Profiling window: decode steps before the replayed ones (a trace's first ones), never "
                           "timed; the offline layout, every system's HBM set and the predictor start from their "
                           "mean loads (0: from each layer's first replayed call).")]  # fmt: skip


def _decode_calls(spec_name: str | None, trace: Path | None, synthetic: bool, cfg: TriSimConfig,
                  steps: int | None, batch: int | None) -> tuple[ModelSpec, list[traces.Call], str]:  # fmt: skip
    """(spec, decode calls, source): synthetic (sweep_tri.synthetic_calls) or a trace's first
    cfg.warmup_steps + `steps` decode steps (the first warmup_steps are the profiling window)."""
    spec = source_spec(spec_name, trace, synthetic)
    if spec is not None:
        return spec, synthetic_calls(spec, cfg), f"synthetic {spec.name} preset (trimoe statistics), seed {cfg.seed}"
    assert trace is not None
    if batch is not None:
        raise ConfigError("--batch-size applies to --synthetic only (a trace's calls keep their own tokens)")
    spec, calls, source = trace_calls(spec_name, trace)
    decode = [c for c in calls if c.step > 0]  # step 0 is the prefill chunk
    w = cfg.warmup_steps
    held = sorted({c.step for c in decode})
    kept = held[: (w + steps) if steps else None]
    if not kept:
        raise ConfigError(f"{trace}: no decode steps (step > 0) to replay")
    if steps is not None and len(kept) < w + steps:
        raise ConfigError(f"{trace}: --warmup-steps {w} + --steps {steps} but the trace holds {len(held)} decode "
                          "steps")  # fmt: skip
    if len(kept) <= w:
        raise ConfigError(f"{trace}: --warmup-steps {w} leaves none of its {len(held)} decode steps to replay")
    last = kept[-1]
    return spec, [c for c in decode if c.step <= last], source


def tri_table(d: dict[str, Any], source: str) -> Table:
    """Metric / value rows of one three-domain simulation (the --json payload)."""
    title = (f"{d['model']} on {d['profile']}: {d['scheduler']}, {d['ndp_count']} NDP DIMMs, CPU x"
             f"{d['cpu_tflops_scale']:g}, HBM {d['hbm_ratio']:g}")  # fmt: skip
    pred, mig = d["predictor"], d["migration"]
    w = d["warmup_steps"]
    moe = f"{d['moe_step_s'] * 1e3:.3f} ms ({d['steps']} steps, {d['calls']} calls; {w} untimed warm-up)"
    rows = [
        ("MoE time per step", moe),
        ("step time", f"{d['step_s'] * 1e3:.3f} ms (batch {d['batch']:g})"),
        ("throughput", f"{d['throughput_tok_s']:.1f} tok/s"),
        ("prefill / end to end", f"{d['prefill_s'] * 1e3:.3f} ms / {d['e2e_tok_s']:.1f} tok/s"),
        ("CPU compute from", str(d["extra"]["cpu_source"])),
        ("greedy-start MoE / step", f"{d['greedy_moe_s'] / d['steps'] * 1e3:.3f} ms ({d['moves']} refinement moves)"),
    ]
    rows += [(f"busy {k}", f"{100 * v:.1f}%") for k, v in d["busy"].items()]
    rows += [(f"per step: {k}", f"{100 * v:.1f}%") for k, v in d["step_util"].items()]
    rows += [(f"FLOP utilisation {k}", f"{100 * v:.2f}%") for k, v in d["flop_util"].items()]
    rows += [(f"experts on {k}", f"{v} ({d['localised'][k]} from a localised layout)") for k, v in d["experts"].items()]
    rows.append(("migration decisions right", f"{100 * pred['decision_accuracy']:.1f}% of {pred['decisions']:g}"))
    rows.append(("predictor class accuracy", f"{100 * pred['accuracy']:.1f}% (hot recall "
                 f"{100 * pred['hot_recall']:.1f}%)"))  # fmt: skip
    rows.append(("prefetch / relayout / migrate", f"{mig['prefetch']} / {mig['relayout']} / {mig['migrate']}"))
    rows.append(("DIMM-Link moves per layer call", f"max {mig['moves_max']:g}, mean {mig['moves_mean']:.2f} "
                 f"({d['dimm_link']}: {mig['move_s'] * 1e3:.3f} ms per expert)"))  # fmt: skip
    rows.append(("link time / total time", f"{100 * mig['link_frac']:.2f}%"))
    kv = d["kv"]
    rows.append(("KV cache", f"{d['kv_home']}: {kv['bytes'] / 1e9:.1f} GB over PCIe, {kv['pcie_s'] * 1e3:.1f} ms "
                 f"({kv['exposed_s'] * 1e3:.1f} ms beyond the GPU's work)"))  # fmt: skip
    return metric_table(title, rows, source)


def simulate_tri_cmd(
    scheduler: SchedOpt = _BASE.scheduler,
    profile: ProfileOpt = _BASE.profile,
    spec: SpecOpt = None,
    trace: TraceOpt = None,
    synthetic: SyntheticOpt = False,
    steps: StepsOpt = None,
    seed: SeedOpt = _BASE.seed,
    batch_size: BatchOpt = None,
    ndp_count: NdpCountOpt = _BASE.ndp_count,
    cpu_tflops_scale: CpuScaleOpt = _BASE.cpu_tflops_scale,
    cpu_profile: CpuProfileOpt = None,
    hbm_ratio: HbmOpt = _BASE.hbm_ratio,
    no_refinement: NoRefineOpt = False,
    no_relayout: NoRelayoutOpt = False,
    regime: RegimeOpt = _BASE.regime,
    drift: DriftOpt = None,
    step_noise: StepNoiseOpt = None,
    contention: ContentionOpt = None,
    dimm_link: DimmLinkOpt = _BASE.dimm_link,
    kv_home: KvHomeOpt = _BASE.kv_home,
    prefill_tokens: PrefillOpt = _BASE.prefill_tokens,
    output_len: OutputLenOpt = _BASE.output_len,
    warmup_steps: WarmupOpt = WARMUP_STEPS,
    run_dir: SimRunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Simulate decode on the three-domain GPU + AMX CPU + DIMM-NDP machine (TriMoE): MoE and step time, busy
    time and FLOP utilisation per domain, predictor accuracy, background migrations."""
    report, _ = consoles(json_out)
    with user_errors():
        # 1. flags -> config (checked before any trace work)
        cfg = TriSimConfig(
            scheduler=scheduler, ndp_count=ndp_count, cpu_tflops_scale=cpu_tflops_scale, hbm_ratio=hbm_ratio,
            batch_size=batch_size or _BASE.batch_size, steps=steps or _BASE.steps, seed=seed,
            refinement=not no_refinement, relayout=not no_relayout, profile=profile, regime=regime, drift=drift,
            step_noise=step_noise, contention=contention, dimm_link=dimm_link, kv_home=kv_home,
            prefill_tokens=prefill_tokens,
            output_len=output_len, warmup_steps=warmup_steps, cpu_profile=cpu_profile,
        )  # fmt: skip
        if drift is not None and not synthetic:
            raise ConfigError("--drift applies to --synthetic traces only")
        if step_noise and not synthetic:
            raise ConfigError("--step-noise applies to --synthetic traces only")
        load_ndp(cfg.profile)  # an unknown profile fails before any trace work
        machine_profile(cfg)  # so does an unreadable --cpu-profile, or a profile without a GPU
        # 2. the calls, 3. the run
        model, calls, source = _decode_calls(spec, trace, synthetic, cfg, steps, batch_size)
        result = simulate_tri(model, calls, cfg)
        payload = asdict(result)
        payload.update(moe_step_s=result.moe_s / result.steps, profile=cfg.profile, ndp_count=cfg.ndp_count,
                       cpu_tflops_scale=cfg.cpu_tflops_scale, hbm_ratio=cfg.hbm_ratio, refinement=cfg.refinement,
                       relayout=cfg.relayout, seed=cfg.seed, source=source, regime=cfg.regime,
                       drift=cfg.trace_regime()[0], step_noise=cfg.trace_regime()[1],
                       contention=cfg.contention or "channel", dimm_link=cfg.dimm_link, kv_home=cfg.kv_home,
                       warmup_steps=cfg.warmup_steps, cpu_profile=cfg.cpu_profile)  # fmt: skip
        report.print(tri_table(payload, source))
        write_simulation(run_dir, payload, source, trace)
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier simulate-tri` to `app` (once)."""
    register_command(app, "simulate-tri", simulate_tri_cmd)


__all__ = ["register", "simulate_tri_cmd", "tri_table"]
