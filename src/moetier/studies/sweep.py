"""Sweeps: run every point of a grid (sweep_grid.py) in a process pool or on a Ray cluster, and keep one row
per point (`moetier sweep`, cli/sweep.py). The grid and point names (REQUIRED, Point, register_point,
load_grid, parse_grid, point_key, ...) are sweep_grid.py's, re-exported here for the point modules.

The output folder holds `points.jsonl` (one JSON record per finished point, appended and flushed as it
finishes, keyed by `point_key`), `results.parquet` (one row per point: its parameters, status, error,
seconds, then the result columns; studies/sweep_results.py) and the plots (studies/sweep_plot.py, then the grid's own
figures). Points run through studies/sweep_exec.py.

Invariants: no torch here (points import what they need); a point that raises is an error row and the sweep
goes on; a point with a record in points.jsonl never runs again (resume: an interrupted sweep redoes nothing
it finished); results.parquet is always rebuilt from points.jsonl, in grid order; ray is imported only when a
Ray address is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError, MoetierError
from moetier.studies.figures import get_figures
from moetier.studies.sweep_exec import RECORDS, Appender, read_records, run_point, run_pool, run_ray
from moetier.studies.sweep_grid import (
    POINTS,
    REQUIRED,
    Block,
    Grid,
    Point,
    check_metrics,
    get_point,
    load_grid,
    parse_grid,
    point_key,
    register_point,
)
from moetier.studies.sweep_plot import plot_results
from moetier.studies.sweep_results import RESULTS, result_rows, write_results


@dataclass(frozen=True)
class SweepReport:
    points: int  # in the grid
    done_before: int  # skipped: already in points.jsonl
    ran: int
    errors: int  # error rows in results.parquet (this run or before)
    lost: int  # points whose worker died (not recorded; a re-run retries them)
    seconds: float
    results: Path
    plots: tuple[Path, ...]
    runner: str  # "none" (nothing to run) | "inline" | "processes:N" | "ray:ADDRESS"

    def as_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in ("points", "done_before", "ran", "errors", "lost", "seconds")},
                "results": str(self.results), "plots": [str(p) for p in self.plots], "runner": self.runner}  # fmt: skip


def run_sweep(
    grid: Grid,
    out: str | Path,
    *,
    jobs: int | None = None,
    ray: str | None = None,
    metrics: Iterable[str] | None = None,
    retry_errors: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> SweepReport:
    """Run every point of `grid` not yet in OUT/points.jsonl, then write OUT/results.parquet and the plots
    (studies/sweep_results.py, studies/sweep_plot.py).
    jobs: worker processes (default os.cpu_count(); 1 runs inline); ray: a Ray address ("local": start a
    local instance with `jobs` CPUs). on_start(n) before the n points to run; on_point(record) after each."""
    t0 = time.perf_counter()
    out = Path(out)
    pt = get_point(grid.point)
    plot_metrics = tuple(metrics) if metrics else grid.metrics
    check_metrics(grid, plot_metrics)
    if jobs is not None and jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(out)
    points = list(grid.points())
    todo: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for _, key, given in points:
        rec = records.get(key)
        if rec is None or (retry_errors and rec.get("status") != "ok"):
            todo.append((key, given, grid.full(given)))
    counts = {"ran": 0, "lost": 0}
    appender = Appender(out / RECORDS)

    def done(key: str, given: dict[str, Any], outcome: dict[str, Any] | None) -> None:
        if outcome is None:
            counts["lost"] += 1
            return
        rec = {"key": key, "point": grid.point, "params": given, **outcome}
        appender.write(rec)
        records[key] = rec
        counts["ran"] += 1
        if on_point is not None:
            on_point(rec)

    start = on_start or (lambda n: None)
    n_jobs = jobs or os.cpu_count() or 1
    try:
        if ray is not None:
            runner = f"ray:{ray}"
            if todo:
                run_ray(pt.fn, todo, ray, jobs, done, start)
            else:
                start(0)
        elif n_jobs == 1 or len(todo) <= 1:
            runner = "inline" if todo else "none"
            start(len(todo))
            for key, given, full in todo:
                done(key, given, run_point(pt.fn, full))
        else:
            runner = f"processes:{min(n_jobs, len(todo))}"
            run_pool(pt.fn, todo, min(n_jobs, len(todo)), done, start)
    finally:
        appender.close()
        rows = result_rows(grid, records)
        write_results(rows, grid, out / RESULTS)

    plots = tuple(p for m in plot_metrics for p in plot_results(rows, grid, m, out))
    if grid.figures:
        plots += tuple(get_figures(grid.figures)(rows, out))
    if counts["lost"]:
        raise MoetierError(f"{counts['lost']} point(s) lost to a failed worker (not recorded); "
                           f"re-run the same command to retry them")  # fmt: skip
    return SweepReport(
        points=len(points), done_before=len(points) - len(todo), ran=counts["ran"],
        errors=sum(r["status"] != "ok" for r in rows), lost=counts["lost"], seconds=time.perf_counter() - t0,
        results=out / RESULTS, plots=plots, runner=runner,
    )  # fmt: skip


__all__ = [
    "POINTS", "REQUIRED", "Block", "Grid", "Point", "SweepReport", "get_point", "load_grid",
    "parse_grid", "point_key", "register_point", "run_sweep",
]  # fmt: skip
