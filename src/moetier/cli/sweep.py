"""`moetier sweep GRID.toml`: run every point of a grid (moetier.studies.sweep) in a process pool or on a Ray
cluster, with a progress bar, into OUT/points.jsonl (resume), OUT/results.parquet and OUT/*.png.

Registered on the main app by cli/app.py (`register(app)`). Thin: flags -> run_sweep -> a summary
table or, with --json, one JSON line.

Invariants (as cli/app.py): bad input (a missing or malformed grid, an unknown point, parameter or metric, a
bad value, --ray without ray installed) is one line `error: ...` on stderr and exit 2, before any point
runs; a point that fails is an error row, not an exit; with --json stdout holds one JSON line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier.cli.console import consoles, emit_json, progress_bar, register_command, user_errors
from moetier.cli.options import JsonOut
from moetier.studies.sweep import load_grid, run_sweep

_SW = "Sweep"
GridArg = Annotated[Path, typer.Argument(
                    help="Grid file (.toml): point name, fixed params, grid lists (studies.sweep).")]  # fmt: skip
OutOpt = Annotated[Path | None, typer.Option("--out", rich_help_panel=_SW,
                   help="Output folder (default runs/sweep-GRIDNAME); re-running resumes it.")]  # fmt: skip
JobsOpt = Annotated[int | None, typer.Option("--jobs", min=1, rich_help_panel=_SW,
                    help="Worker processes (default: all CPUs; with --ray local: the instance's CPUs).")]  # fmt: skip
RayOpt = Annotated[str | None, typer.Option("--ray", rich_help_panel=_SW,
                   help="Run on a Ray cluster at ADDRESS (e.g. ray://head:10001, auto); 'local' starts one "
                        "here. Needs ray (the project's sweep extra).")]  # fmt: skip
MetricOpt = Annotated[list[str] | None, typer.Option("--metric", rich_help_panel=_SW,
                      help="Result column to plot (repeatable; default: the grid's metrics, else tbt_s).")]  # fmt: skip
RetryOpt = Annotated[bool, typer.Option("--retry-errors", rich_help_panel=_SW,
                     help="Run again the points recorded with an error (default: keep them).")]  # fmt: skip
MAX_ERRORS_SHOWN = 5


def summary_table(d: dict[str, Any], grid: str) -> Table:
    table = Table(title=f"sweep {grid}", title_justify="left")
    table.add_column("item")
    table.add_column("value", overflow="fold")
    rows = [
        ("points", f"{d['points']} ({d['done_before']} done before, {d['ran']} run now, {d['errors']} errors)"),
        ("runner", d["runner"]),
        ("seconds", f"{d['seconds']:.1f}"),
        ("results", d["results"]),
        *(("plot", p) for p in d["plots"]),
        *(("error", e) for e in d["first_errors"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def sweep_cmd(
    grid: GridArg,
    out: OutOpt = None,
    jobs: JobsOpt = None,
    ray: RayOpt = None,
    metric: MetricOpt = None,
    retry_errors: RetryOpt = False,
    json_out: JsonOut = False,
) -> None:
    """Run a grid of simulations in parallel (processes or Ray), resumable; write Parquet results and plots."""
    report, err = consoles(json_out)
    with user_errors():
        g = load_grid(grid)  # 1. the whole grid checked before any point runs
        folder = out if out is not None else Path("runs") / f"sweep-{grid.stem}"
        bar = progress_bar(err)
        task = bar.add_task(f"sweep {grid.name}", total=None)
        errors: list[str] = []

        def on_start(n: int) -> None:
            bar.update(task, total=n)
            bar.start()

        def on_point(rec: dict[str, Any]) -> None:
            if rec["status"] != "ok":
                errors.append(f"{rec['params']}: {rec['error']}")
            bar.advance(task)

        try:  # 2. the run
            result = run_sweep(g, folder, jobs=jobs, ray=ray, metrics=metric, retry_errors=retry_errors,
                               on_start=on_start, on_point=on_point)  # fmt: skip
        finally:
            bar.stop()
        payload = {**result.as_dict(), "grid": str(grid), "first_errors": errors[:MAX_ERRORS_SHOWN]}
        report.print(summary_table(payload, str(grid)))
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier sweep` to `app` (once)."""
    register_command(app, "sweep", sweep_cmd)


__all__ = ["register", "summary_table", "sweep_cmd"]
