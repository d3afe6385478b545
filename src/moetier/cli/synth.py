"""`moetier synth`: write a synthetic routing trace (moetier.studies.synthetic) and print its statistics.

Registered on the main app by cli/app.py (`register(app)`). The knobs come from a model spec's
preset (`--spec NAME`, TriMoE 3.1 statistics), from a fit to a recorded trace (`--fit TRACE`) or from a
knobs file (`--params FILE.json`, as `--params-out` writes it: fit once, generate many); the trace has
`--steps` decode steps of `--batch-size` tokens after a prefill chunk of `--prompt-len` tokens per
sequence, and carries all router scores.

Invariants (as cli/app.py): bad input (not exactly one of --spec/--fit/--params, an unknown spec, a missing
or malformed trace or knobs file, non-positive steps) is one line `error: ...` on stderr and exit 2; with --json stdout
holds exactly one JSON line.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier import traces
from moetier.cli.console import consoles, emit_json, register_command, require_trace, user_errors
from moetier.cli.options import JsonOut
from moetier.errors import ConfigError
from moetier.specs import load_spec
from moetier.studies import synthetic
from moetier.studies.synthetic_fit import fit_params
from moetier.studies.synthetic_stats import trace_stats

SpecOpt = Annotated[
    str | None, typer.Option("--spec", help="Model spec name (a shipped spec) or .json path: its preset.")
]
FitOpt = Annotated[
    Path | None, typer.Option("--fit", help="Recorded trace (.parquet, with scores) to fit the knobs to.")
]
StepsOpt = Annotated[int, typer.Option("--steps", help="Decode steps to generate.")]
OutOpt = Annotated[Path, typer.Option("--out", help="Output trace file (.parquet).")]
BatchOpt = Annotated[
    int | None,
    typer.Option("--batch-size", help="Sequences per step (default: the preset's 1, or the fitted trace's)."),
]
PromptOpt = Annotated[int, typer.Option("--prompt-len", help="Prefill tokens per sequence (step 0); 0 = none.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed of the generator.")]
ParamsOpt = Annotated[
    Path | None, typer.Option("--params", help="Knobs file (.json) written by --params-out: generate from it.")
]
ParamsOutOpt = Annotated[
    Path | None,
    typer.Option("--params-out", help="Also write the knobs used (e.g. the fitted ones) to this .json file."),
]

STAT_ROWS = (
    ("top10_share", "share of tokens on the top 10% experts"),
    ("bottom70_share", "share of tokens on the bottom 70% experts"),
    ("reuse", "step-to-step reuse of a sequence's experts"),
    ("reuse_indep", "  reuse if steps were independent"),
    ("layer_pred", "adjacent-layer predictability (co-activation)"),
    ("layer_pred_base", "  predicting the most loaded experts instead"),
    ("drift_corr", "load correlation, first vs second half"),
    ("topk_mass", "router probability mass of the top-k"),
)


def _load_spec(name: str) -> Any:
    """The spec named on the command line (moetier.specs)."""
    return load_spec(name)


def stats_table(stats: dict[str, Any], params: dict[str, Any]) -> Table:
    """Shape, knobs and statistics of a generated trace."""
    table = Table(title=f"synthetic trace of {params['model']}", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    shape = f"{stats['layers']} layers x {stats['num_experts']} experts, top-{stats['top_k']}"
    table.add_row("shape", shape)
    table.add_row(
        "steps", f"{stats['prefill_tokens']} prefill tokens, {stats['decode_steps']} x {stats['batch']} decode"
    )
    for key in (
        "hot_frac",
        "warm_frac",
        "hot_share",
        "warm_share",
        "spread",
        "temporal",
        "layer_corr",
        "drift",
        "sharpness",
    ):
        table.add_row(f"knob {key}", f"{params[key]:.3f}")
    table.add_section()
    for key, label in STAT_ROWS:
        value = stats.get(key)
        table.add_row(label, "-" if value is None else f"{value:.3f}")
    return table


def synth_cmd(
    steps: StepsOpt,
    out: OutOpt,
    spec: SpecOpt = None,
    fit: FitOpt = None,
    batch_size: BatchOpt = None,
    prompt_len: PromptOpt = 0,
    seed: SeedOpt = 0,
    params_file: ParamsOpt = None,
    params_out: ParamsOutOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Write a synthetic routing trace from a model's preset, a fit to a recorded trace, or a knobs file."""
    report, err = consoles(json_out)
    with user_errors():
        # 1. flags
        if sum(x is not None for x in (spec, fit, params_file)) != 1:
            raise ConfigError("give exactly one of --spec NAME, --fit TRACE or --params FILE.json")
        if steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {steps}")
        if prompt_len < 0:
            raise ConfigError(f"--prompt-len must be >= 0, got {prompt_len}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        # 2. the knobs
        if fit is not None:
            require_trace(fit)
            with err.status(f"fitting to {fit}"):
                params = fit_params(traces.load(fit))
        elif params_file is not None:
            params = synthetic.load_params(params_file)
        else:
            params = synthetic.preset(_load_spec(str(spec)))
        params = replace(params, seed=seed, batch_size=batch_size or params.batch_size)
        if params_out is not None:
            synthetic.save_params(params, params_out)
        # 3. generate, write, measure
        with err.status("generating"):
            trace = synthetic.generate(params, steps, prompt_len)
            synthetic.save(trace, out)
            stats = trace_stats(trace)
        knobs = {**asdict(params), "moe_layers": list(params.layer_ids)}
        report.print(stats_table(stats, knobs))
        err.print(f"trace written to {out} ({len(trace)} rows)", markup=False, highlight=False)
        if params_out is not None:
            err.print(f"knobs written to {params_out}", markup=False, highlight=False)
        source = f"fit:{fit}" if fit else f"params:{params_file}" if params_file else f"spec:{spec}"
        if json_out:
            emit_json({"out": str(out), "rows": len(trace), "source": source, "params": knobs, "stats": stats,
                       "params_out": None if params_out is None else str(params_out)})  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add `moetier synth` to `app` (once)."""
    register_command(app, "synth", synth_cmd)


__all__ = ["register", "stats_table", "synth_cmd"]
