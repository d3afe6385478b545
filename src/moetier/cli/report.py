"""`moetier report INPUT [--out DIR] [--cache-ratios ...] [--policies ...]`: PNG figures and an HTML index
of a run directory (`generate/eval --run-dir`), a simulation directory (`simulate --run-dir`) or a
routing trace (.parquet); the work is moetier.report's (build.py).

Registered on the main app by cli/app.py (`register(app)`). Default OUT: INPUT/report for a
directory, ./report-NAME for a trace file.

Invariants (as cli/app.py): bad input (a missing path, a file that is not a trace, a directory that is
neither kind, a ratio outside (0, 1], an unknown policy) is one line `error: ...` on stderr and exit 2;
the replay's progress bar and the summary go to stderr with --json, whose stdout is one JSON line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetier.cli.console import consoles, emit_json, progress_bar, register_command, user_errors
from moetier.cli.options import JsonOut
from moetier.errors import ConfigError
from moetier.report.build import TITLES, build_report
from moetier.report.load import default_out, load_input
from moetier.sim.cache_replay import parse_policies, slots_for

DEFAULT_RATIOS = "0.05,0.1,0.25,0.5,0.75"
InputArg = Annotated[Path, typer.Argument(metavar="RUN_OR_TRACE",
                     help="A run directory (generate/eval --run-dir), a simulation directory (simulate --run-dir) "
                          "or a routing trace (.parquet).")]  # fmt: skip
OutOpt = Annotated[Path | None, typer.Option("--out", metavar="DIR",
                   help="Output folder; default INPUT/report, or ./report-NAME for a trace file.")]  # fmt: skip
RatiosOpt = Annotated[str, typer.Option("--cache-ratios",
                      help="Cache sizes to replay, as fractions in (0, 1] of all routed experts.")]  # fmt: skip
PoliciesOpt = Annotated[
    str, typer.Option("--policies", help="Cache policies to replay: lru, lfu, mrs, belady, or all.")
]


def parse_ratios(text: str) -> list[float]:
    """'0.1,0.25' -> [0.1, 0.25], each in (0, 1], ascending, without repeats."""
    try:
        ratios = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--cache-ratios must be comma-separated numbers, got {text!r}") from None
    if not ratios:
        raise ConfigError("--cache-ratios is empty")
    for r in ratios:
        slots_for(r, 1)  # range check
    return ratios


def report_cmd(
    input_path: InputArg,
    out: OutOpt = None,
    cache_ratios: RatiosOpt = DEFAULT_RATIOS,
    policies: PoliciesOpt = "lru,lfu,mrs,belady",
    json_out: JsonOut = False,
) -> None:
    """Figures (PNG) and an HTML index of a run, a simulation or a routing trace."""
    report, err = consoles(json_out)
    with user_errors():
        # 1. flags, 2. the input
        ratios = parse_ratios(cache_ratios)
        names = parse_policies(policies)
        inp = load_input(input_path)
        target = out or default_out(inp)
        if target.exists() and not target.is_dir():
            raise ConfigError(f"--out {target} is a file; give a directory")
        # 3. figures and index, the replay under a progress bar
        with progress_bar(err, transient=True) as progress:
            task = progress.add_task("replaying the trace", total=len(ratios) * len(names) if inp.trace else 0)
            result = build_report(
                inp, target, ratios, names,
                on_point=lambda p, r: progress.update(task, advance=1, description=f"replayed {p} at {r:g}"),
            )  # fmt: skip
        # 4. summary
        for key in TITLES:
            line = result["figures"][key] if key in result["figures"] else f"skipped ({result['skipped'][key]})"
            report.print(f"{key}: {line}", highlight=False, markup=False, soft_wrap=True)
        report.print(f"wrote {result['index']}", highlight=False, markup=False, soft_wrap=True)
        if json_out:
            emit_json(result)


def register(app: typer.Typer) -> None:
    """Add `moetier report` to `app` (once)."""
    register_command(app, "report", report_cmd)


__all__ = ["parse_ratios", "register", "report_cmd"]
