"""`moetier simulate`: replay a routing trace (recorded, or synthetic for a spec) on a simulated two-domain
(GPU + CPU) machine (moetier.sim) and report TTFT, TBT, throughput, MoE layer time, hit rate, utilisation per
domain, bytes per link and prefetch statistics; optionally draw the timeline of a window. The three-domain
TriMoE machine is `moetier simulate-tri` (simulate_tri.py).

Registered on the main app by cli/app.py (`register(app)`). Thin: flags -> SimConfig (which checks them),
trace -> calls (sim_inputs.py), simulate -> a rich table or, with --json, one JSON line; `--run-dir DIR` also
writes DIR/result.json and DIR/timeline.jsonl for `moetier report` (report/record.py).

Defaults are HybriMoE's setting (the paper's regime, docs/hybrid.md): with no scheduler flag the scheduler is
hybrimoe with its MRS cache and its impact-driven prefetch 3 MoE layers ahead (policies.schedulers.
SYSTEM_PREFETCH_DEPTH: each named system gets its own paper's prefetch unless --prefetch / --no-prefetch says
otherwise), 4-bit experts (the paper's Marlin kernels), and for --synthetic traces the statistics fitted to
HybriMoE Fig. 9 (`--stats hybrimoe`, for the three models the paper evaluates; TriMoE 3.1's for other models)
behind a 128-step warm-up that builds the placements and caches. The
machine is named with --profile (a6000-5220r is the paper's).

Invariants (as cli/app.py): bad input (unknown spec, profile, scheduler or policy; both or neither of
--trace and --synthetic; a trace of another model; a ratio outside [0, 1]; more steps than the
trace holds) is one line `error: ...` on stderr and exit 2; with --json stdout holds one JSON line.
"""

from __future__ import annotations

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
from moetier.policies.costmodel import load_profile
from moetier.policies.schedulers import SCHEDULERS, SYSTEM_PREFETCH_DEPTH
from moetier.report.record import SimRunDirOpt, write_simulation
from moetier.sim import SimConfig, simulate
from moetier.sim.timeline import draw_timeline
from moetier.specs import ModelSpec
from moetier.studies.synthetic import HYBRIMOE_SKEW, generate, preset

_SIM = PANEL
ProfileOpt = Annotated[str | None, typer.Option("--profile", rich_help_panel=_SIM,
                       help="Hardware profile: a profile name (yours or shipped) or a .json (required).")]  # fmt: skip
StepsOpt = Annotated[int | None, typer.Option("--steps", min=1, rich_help_panel=_SIM,
                     help="Decode steps to simulate (synthetic default 64; trace default: all).")]  # fmt: skip
BatchOpt = Annotated[int | None, typer.Option("--batch-size", min=1, rich_help_panel=_SIM,
                     help="Sequences per step (synthetic default 1; trace: its decode rows).")]  # fmt: skip
PromptOpt = Annotated[int | None, typer.Option("--prompt-len", min=0, rich_help_panel=_SIM,
                      help="Prompt tokens per sequence (synthetic default 32; trace: its step-0 rows).")]  # fmt: skip
SchedOpt = Annotated[str, typer.Option("--scheduler", rich_help_panel=_SIM,
                     help=f"{', '.join(SCHEDULERS)}; the three-domain schedulers run with "
                          "`moetier simulate-tri`.")]  # fmt: skip
PolicyOpt = Annotated[str | None, typer.Option("--cache-policy", rich_help_panel=_SIM,
                      help="lru, lfu, mrs (default: the scheduler's).")]  # fmt: skip
RatioOpt = Annotated[float, typer.Option("--cache-ratio", rich_help_panel=_SIM,
                     help="Fraction in [0, 1] of all routed experts the fast tier holds.")]  # fmt: skip
PrefetchOpt = Annotated[bool | None, typer.Option("--prefetch/--no-prefetch", show_default=False,
                        rich_help_panel=_SIM,
                        help="Impact-driven prefetching of the next MoE layers' experts (default: the "
                             "scheduler's own, as its paper runs it: on for hybrimoe and adapmoe, off for the "
                             "others).")]  # fmt: skip
DepthOpt = Annotated[int | None, typer.Option("--prefetch-depth", min=1, max=3, rich_help_panel=_SIM,
                     help="MoE layers ahead to predict (1-3; default: the scheduler's own, hybrimoe 3, "
                          "adapmoe 1; else 3).")]  # fmt: skip
AccOpt = Annotated[str | None, typer.Option("--prefetch-oracle-accuracy", rich_help_panel=_SIM,
                   help="Predict from the trace's true future degraded to this accuracy per distance, "
                        "comma-separated (e.g. 0.85,0.75,0.65); default: a predictor learning from the "
                        "replayed routing (policies/route_history.py).")]  # fmt: skip
GateOpt = Annotated[float, typer.Option("--gate-drop", rich_help_panel=_SIM,
                    help="adapmoe-gated: fraction of routed experts its adaptive gating drops at decode "
                         "(threshold fitted on the warm-up; AdapMoE reports 25%).")]  # fmt: skip
AllocOpt = Annotated[str | None, typer.Option("--cache-alloc", metavar="dp|global", rich_help_panel=_SIM,
                     help="How the cache's slots are split: dp (one cache per MoE layer, sized by AdapMoE's DP "
                          "on the warm-up window) or global (one cache for all layers); default: the "
                          "scheduler's (dp for adapmoe, global for the others).")]  # fmt: skip
TimelineOpt = Annotated[Path | None, typer.Option("--timeline", rich_help_panel=_SIM,
                        help="Write a Gantt chart (PNG) of the window to this file.")]  # fmt: skip
PrecOpt = Annotated[str, typer.Option("--precision", rich_help_panel=_SIM,
                    help="Routed experts' precision: full, int8, int4, int2 (default int4: HybriMoE ran "
                         "4-bit).")]  # fmt: skip
StatsOpt = Annotated[str | None, typer.Option("--stats", rich_help_panel=_SIM, show_default=False,
                     help="Synthetic trace statistics: hybrimoe (fitted to HybriMoE Fig. 9's hit rates; the "
                          "default for the three models it evaluates) or trimoe (TriMoE 3.1; the default for "
                          "other models); docs/traces.md.")]  # fmt: skip
WarmOpt = Annotated[int | None, typer.Option("--warmup-steps", min=0, rich_help_panel=_SIM, show_default=False,
                    help="Decode steps before the replayed ones that only build the static placements and the "
                         "initial cache (0: the replayed steps themselves, an oracle; default: 128 for "
                         "--synthetic, 0 for --trace).")]  # fmt: skip
AdmitOpt = Annotated[bool, typer.Option("--prefill-admit/--prefill-stage", rich_help_panel=_SIM,
                     help="Admit experts moved during the prefill into the cache (default: a staging buffer, "
                          "used for their call and dropped).")]  # fmt: skip
WinOpt = Annotated[str, typer.Option(rich_help_panel=_SIM, help="Timeline window as FIRST:LAST (end excluded).")]
StepWinOpt = Annotated[str | None, typer.Option(rich_help_panel=_SIM, show_default=False,
                       help="Trace steps drawn in the timeline, FIRST:LAST (end excluded; default: the first "
                            "replayed decode step, warm-up + 1).")]  # fmt: skip


def _range(text: str, flag: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        lo, hi = int(a), int(b) if sep else int(a) + 1
    except ValueError:
        raise ConfigError(f"{flag} must be FIRST:LAST (ints), got {text!r}") from None
    if not 0 <= lo < hi:
        raise ConfigError(f"{flag} must satisfy 0 <= FIRST < LAST, got {text!r}")
    return lo, hi


def _accuracy(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--prefetch-oracle-accuracy must be comma-separated numbers, got {text!r}") from None


def _calls(spec_name: str | None, trace: Path | None, synthetic: bool, steps: int | None, seed: int,
           batch: int | None, prompt: int | None, stats: str | None,
           warmup: int) -> tuple[ModelSpec, list[traces.Call], str]:  # fmt: skip
    """(spec, calls, source) from the flags: a synthetic trace of (steps or 64) + warmup decode steps, or --trace.
    Statistics by default: HybriMoE's Fig. 9 fit where the model has one, else TriMoE 3.1's."""
    spec = source_spec(spec_name, trace, synthetic)
    if spec is not None:
        stats = stats or ("hybrimoe" if str(spec.name) in HYBRIMOE_SKEW else "trimoe")
        params = preset(spec, batch_size=batch or 1, seed=seed, stats=stats)
        t = generate(params, (steps or 64) + warmup, prompt_len=32 if prompt is None else prompt)
        return spec, traces.iter_calls(t), f"synthetic {spec.name} preset ({stats} statistics), seed {seed}"
    assert trace is not None
    return trace_calls(spec_name, trace)


def result_table(d: dict[str, Any], source: str) -> Table:
    """Metric / value rows of one simulation (the --json payload)."""
    title = (f"{d['spec']} on {d['profile']}: {d['scheduler']}, {d['cache_policy']} cache at "
             f"{d['cache_ratio']:g}, prefetch {'on' if d['prefetch']['enabled'] else 'off'}")  # fmt: skip
    rows = [
        ("TTFT", f"{d['ttft_s'] * 1e3:.2f} ms ({d['prompt_len']} prompt tokens x {d['batch_size']})"),
        ("TBT", f"{d['tbt_s'] * 1e3:.3f} ms ({d['steps']} decode steps)"),
        ("throughput", f"{d['throughput_tok_s']:.2f} tok/s"),
        ("MoE layer (decode)", f"{d['moe_layer_s'] * 1e6:.1f} us"),
        ("hit rate (all / decode)", f"{100 * d['hit_rate']:.1f}% / {100 * d['decode_hit_rate']:.1f}%"),
        ("cache slots", str(d["cache_slots"])),
    ]
    if d.get("layer_slots"):
        per = list(d["layer_slots"].values())
        rows[-1] = ("cache slots", f"{d['cache_slots']} (per layer by the DP: {min(per)}-{max(per)})")
    rows += [(f"utilization {lane}", f"{100 * u:.1f}%") for lane, u in d["utilization"].items()]
    rows += [(f"bytes over {link}", f"{b / 2**30:.2f} GiB") for link, b in d["link_bytes"].items()]
    if d.get("gating"):
        g = d["gating"]
        rows.append(("adaptive gating", f"threshold {g['threshold']:.3f}, {100 * g['dropped_frac']:.1f}% of "
                                        f"{g['routed']} decode routings dropped"))  # fmt: skip
    rows.append(("moves (demand / prefetch)", f"{d['moves']['demand']} / {d['moves']['prefetch']}"))
    pf = d["prefetch"]
    if pf["enabled"]:
        if d["predictor"] == "oracle":
            rows.append(("oracle accuracy (assumed)", ",".join(f"{a:g}" for a in d["prefetch_accuracy"])))
        by_d = ", ".join(f"d={k}: {100 * v:.1f}%" for k, v in pf["accuracy_by_distance"].items())
        rows.append((f"prediction accuracy ({d['predictor']})", by_d or "-"))
        rows.append(("prefetches issued / used", f"{pf['issued']} / {pf['used']} ({100 * pf['used_frac']:.1f}%)"))
    return metric_table(title, rows, source)


def simulate_cmd(
    profile: ProfileOpt = None,
    spec: SpecOpt = None,
    trace: TraceOpt = None,
    synthetic: SyntheticOpt = False,
    steps: StepsOpt = None,
    seed: SeedOpt = 0,
    batch_size: BatchOpt = None,
    prompt_len: PromptOpt = None,
    scheduler: SchedOpt = "hybrimoe",
    cache_policy: PolicyOpt = None,
    cache_ratio: RatioOpt = 0.25,
    prefetch: PrefetchOpt = None,
    prefetch_depth: DepthOpt = None,
    prefetch_accuracy: AccOpt = None,
    gate_drop: GateOpt = 0.25,
    cache_alloc: AllocOpt = None,
    precision: PrecOpt = "int4",
    stats: StatsOpt = None,
    warmup_steps: WarmOpt = None,
    prefill_admit: AdmitOpt = False,
    timeline: TimelineOpt = None,
    timeline_steps: StepWinOpt = None,
    timeline_layers: WinOpt = "0:4",
    run_dir: SimRunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Simulate a trace on a two-domain (GPU + CPU) machine profile: TTFT, TBT, utilisation, hit rate, link bytes."""
    report, err = consoles(json_out)
    with user_errors():
        # 1. flags -> config (checked before any trace work)
        acc = _accuracy(prefetch_accuracy)
        own = SYSTEM_PREFETCH_DEPTH.get(scheduler, 0)  # the named system's own prefetch (its paper's)
        prefetch = own > 0 if prefetch is None else prefetch
        prefetch_depth = prefetch_depth or own or 3
        if stats is not None and not synthetic:
            raise ConfigError("--stats applies to --synthetic traces only")
        warmup_steps = (128 if synthetic else 0) if warmup_steps is None else warmup_steps
        cfg = SimConfig(
            prefetch_accuracy=acc if acc is not None else SimConfig.prefetch_accuracy,
            predictor="oracle" if acc is not None else "history", gate_drop=gate_drop, cache_alloc=cache_alloc,
            scheduler=scheduler, cache_policy=cache_policy, cache_ratio=cache_ratio, prefetch=prefetch,
            prefetch_depth=prefetch_depth, batch_size=batch_size, prompt_len=prompt_len,
            steps=steps if trace is not None else None, seed=seed, precision=precision,
            warmup_steps=warmup_steps, prefill_admit=prefill_admit,
            timeline_steps=_range(timeline_steps or f"{warmup_steps + 1}:{warmup_steps + 2}", "--timeline-steps"),
            timeline_layers=_range(timeline_layers, "--timeline-layers"),
        )  # fmt: skip
        if profile is None:
            raise ConfigError(f"--profile is required with the two-domain scheduler {scheduler!r}")
        hw = load_profile(profile)
        # 2. the trace, 3. the run
        model, calls, source = _calls(spec, trace, synthetic, steps, seed, batch_size, prompt_len, stats, warmup_steps)
        result = simulate(model, hw, calls, cfg)
        payload = result.as_dict()
        if timeline is not None:
            draw_timeline(result.timeline, timeline, f"{model.name} on {hw.name}, {scheduler}, cache {cache_ratio:g}")
            payload["timeline"] = str(timeline)
            err.print(f"timeline written to {timeline}", highlight=False)
        report.print(result_table(payload, source))
        write_simulation(run_dir, payload, source, trace, result.timeline)
        if json_out:
            emit_json({**payload, "source": source})


def register(app: typer.Typer) -> None:
    """Add `moetier simulate` to `app` (once)."""
    register_command(app, "simulate", simulate_cmd)


__all__ = ["register", "result_table", "simulate_cmd"]
