"""Sweeps: expand a GRID.toml into points, run each point (a named function of its parameters) in a
process pool or on a Ray cluster, and keep one row per point (`moetier sweep`, cli_sweep.py).

GRID.toml::

    point = "simulate"          # a name in POINTS (default "simulate")
    metrics = ["tbt_s"]         # result columns plotted (default: the point's first column)
    figures = "trimoe"          # optional: a study's own figures (sweep_figures.FIGURES), drawn after the plots
    [params]                    # fixed values, one per parameter
    profile = "a6000-5220r"
    [grid]                      # lists; the sweep is their cartesian product, first key outermost
    models = ["deepseek-v2-lite", "qwen2-57b-a14b"]
    cache_ratios = [0.25, 0.5]

`[[grid]]` tables instead of one `[grid]` give several products (each may have `name = "..."`); the sweep
runs their union, once per distinct point. A key names a parameter of the point, or its plural
(models -> model, batch_sizes -> batch_size, cache_policies -> cache_policy). The output folder holds
`points.jsonl` (one JSON record per finished point, appended and flushed as it finishes, keyed by a stable
hash of the point name and the parameters the grid gives it), `results.parquet` (one row per point: its
parameters, status, error, seconds, then the result columns; sweep_results.py) and the plots
(sweep_plot.py). Points run through sweep_exec.py.

Invariants: no torch here (points import what they need inside); a grid is checked whole (keys, value
types, each point's own check) before any point runs, and an unknown key is one ConfigError naming it;
a point that raises is an error row and the sweep goes on; a point with a record in points.jsonl never
runs again (resume: an interrupted sweep redoes nothing it finished); results.parquet is always rebuilt
from points.jsonl, in grid order; ray is imported only when a Ray address is given.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError, MoetierError
from moetier.studies.sweep_exec import RECORDS, Appender, read_records, run_point, run_pool, run_ray

REQUIRED: Any = object()  # a parameter default meaning "the grid must give it"
Scalar = str | int | float | bool


@dataclass(frozen=True)
class Point:
    """What a sweep point computes: fn(params) -> {column: value}; nested dicts are flattened (a_b)."""

    fn: Callable[[dict[str, Any]], dict[str, Any]]  # module-level, so process pools can pickle it
    params: Mapping[str, Any]  # accepted parameter -> default (REQUIRED: no default)
    refused: Mapping[str, str] = field(default_factory=dict)  # parameters this point cannot use -> why
    check: Callable[[dict[str, Any]], None] | None = None  # cheap validation of one point's params
    columns: tuple[str, ...] = ()  # result columns it returns (plottable metrics); () unknown


POINTS: dict[str, Point] = {}
# modules registering the shipped points (add new)
POINT_MODULES = ("moetier.studies.sweep_simulate", "moetier.studies.sweep_tri")


def register_point(name: str, point: Point) -> None:
    """Make `point` available as `point = "NAME"` in grid files (replacing any of that name)."""
    POINTS[name] = point


def get_point(name: str) -> Point:
    import importlib

    for module in POINT_MODULES:  # each registers its points on import (cheap, no torch)
        importlib.import_module(module)
    try:
        return POINTS[name]
    except KeyError:
        raise ConfigError(f"unknown point {name!r}; known: {', '.join(sorted(POINTS))}") from None


# Grid files ----------------------------------------------------------------------------------------------------
Axes = tuple[tuple[str, tuple[Scalar, ...]], ...]  # parameter -> values, file order (first outermost)


@dataclass(frozen=True)
class Block:
    """One cartesian product of a grid file: `[grid]`, or one `[[grid]]` table (with an optional name)."""

    name: str
    axes: Axes

    def given(self, fixed: Mapping[str, Any]) -> list[dict[str, Any]]:
        names = [name for name, _ in self.axes]
        combos = itertools.product(*(values for _, values in self.axes))
        return [{**fixed, **dict(zip(names, combo, strict=True))} for combo in combos]


@dataclass(frozen=True)
class Grid:
    point: str
    blocks: tuple[Block, ...]  # one per [grid] / [[grid]] table, file order
    fixed: tuple[tuple[str, Scalar], ...]  # [params]
    metrics: tuple[str, ...]
    source: str = ""
    figures: str = ""  # a name in sweep_figures.FIGURES drawn after the generic plots ("" = none)

    @property
    def axes(self) -> Axes:
        """Every block's axes merged: parameter -> its values over all blocks (first seen order)."""
        merged: dict[str, list[Scalar]] = {}
        for b in self.blocks:
            for name, values in b.axes:
                merged.setdefault(name, []).extend(v for v in values if v not in merged.get(name, []))
        return tuple((n, _homogeneous(v)) for n, v in merged.items())

    @property
    def varying(self) -> tuple[str, ...]:
        """Axes with more than one value (over all blocks), in file order."""
        return tuple(name for name, values in self.axes if len(values) > 1)

    def given(self) -> list[dict[str, Any]]:
        """Every point's given parameters ([params] + one value per axis of its block), blocks in file order
        (a point in two blocks appears twice; points() lists each once)."""
        return [g for b in self.blocks for g in b.given(dict(self.fixed))]

    def points(self) -> Iterator[tuple[Block, str, dict[str, Any]]]:
        """(block, point_key, given) of every distinct point, in grid order; a point in two blocks comes once,
        under the first."""
        seen: set[str] = set()
        for b in self.blocks:
            for given in b.given(dict(self.fixed)):
                key = point_key(self.point, given)
                if key not in seen:
                    seen.add(key)
                    yield b, key, given

    def full(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The point function's argument: its defaults overlaid with the given parameters."""
        return {**get_point(self.point).params, **given}


def point_key(point: str, given: Mapping[str, Any]) -> str:
    """Stable hash of a point: its function's name and the parameters the grid gives it (not defaults)."""
    text = json.dumps({"point": point, "params": dict(given)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _param_name(key: str, known: Iterable[str]) -> str | None:
    names = set(known)
    for cand in (key, key[:-3] + "y" if key.endswith("ies") else None, key[:-1] if key.endswith("s") else None):
        if cand in names:
            return cand
    return None


def _scalar(value: Any, where: str, default: Any) -> Scalar:
    if not isinstance(value, str | int | float | bool):
        raise ConfigError(f"{where}: expected a string, number or boolean, got {value!r}")
    if default is REQUIRED or default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok, value = isinstance(value, int | float), float(value) if isinstance(value, int | float) else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"{where}: expected a {type(default).__name__}, got {value!r}")
    return value


def _homogeneous(values: list[Scalar]) -> tuple[Scalar, ...]:
    """Ints and floats mixed in one list become floats (one Parquet column type)."""
    nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if any(isinstance(v, float) for v in nums) and len(nums) == len(values):
        return tuple(float(v) for v in values)
    return tuple(values)


def _claim(key: str, table: str, source: str, name: str, pt: Point, known: list[str], seen: dict[str, str]) -> str:
    """The parameter `key` names in [table], recorded in `seen`; ConfigError when the point refuses it or it
    is already given ([params] and every key of the same [grid] table share `seen`)."""
    param = _param_name(key, known)
    assert param is not None  # unknown keys were refused before
    if param in pt.refused:
        raise ConfigError(f"{source}: [{table}] {key}: point {name!r} cannot use {param}: {pt.refused[param]}")
    if param in seen:
        raise ConfigError(f"{source}: {param} is given twice ({seen[param]} and [{table}] {key})")
    seen[param] = f"[{table}] {key}"
    return param


def _axes(raw: Mapping[str, Any], table: str, source: str, name: str, pt: Point, known: list[str],
          seen: Mapping[str, str]) -> Axes:  # fmt: skip
    """The axes of one [grid] table (`seen`: the [params] keys); ConfigError naming the key on any problem."""
    axes: list[tuple[str, tuple[Scalar, ...]]] = []
    mine = dict(seen)  # another block may give the same parameters again
    for key, value in raw.items():
        param = _claim(key, table, source, name, pt, known, mine)
        where, default = f"{source}: [{table}] {key}", pt.params[param]
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: expected a non-empty list of values, got {value!r}")
        if len(set(map(repr, value))) != len(value):
            raise ConfigError(f"{where}: repeated values in {value!r}")
        axes.append((param, _homogeneous([_scalar(v, where, default) for v in value])))
    return tuple(axes)


def parse_grid(data: Mapping[str, Any], source: str = "grid") -> Grid:
    """A Grid from a parsed GRID.toml; ConfigError naming the file and key on any problem. `[grid]` is one
    table, or `[[grid]]` several (each a cartesian product, optionally `name = "..."`; the sweep runs their union)."""
    # 1. Top level
    extra = sorted(set(data) - {"point", "metrics", "params", "grid", "figures"})
    if extra:
        raise ConfigError(f"{source}: unknown top-level keys {extra}; allowed: point, metrics, figures, [params], "
                          f"[grid] or [[grid]]")  # fmt: skip
    name = data.get("point", "simulate")
    if not isinstance(name, str):
        raise ConfigError(f"{source}: point must be a string, got {name!r}")
    pt = get_point(name)
    fixed_raw, grid_raw = data.get("params", {}), data.get("grid", {})
    tables = grid_raw if isinstance(grid_raw, list) else [grid_raw]
    if not isinstance(fixed_raw, dict) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: [params] must be a table and [grid] a table or a non-empty [[grid]] list")
    # 2. Keys: every one names a parameter (or its plural)
    known = [*pt.params, *pt.refused]
    keys = [*fixed_raw, *(k for t in tables for k in t if k != "name")]
    unknown = sorted({k for k in keys if _param_name(k, known) is None})
    if unknown:
        raise ConfigError(f"{source}: point {name!r} has no parameter(s) {unknown}; it takes: "
                          f"{', '.join(sorted(pt.params))} (grid keys may be plural)")  # fmt: skip
    # 3. [params], then each block's axes
    seen: dict[str, str] = {}
    fixed: list[tuple[str, Scalar]] = []
    for key, value in fixed_raw.items():
        param = _claim(key, "params", source, name, pt, known, seen)
        fixed.append((param, _scalar(value, f"{source}: [params] {key}", pt.params[param])))
    blocks: list[Block] = []
    for i, t in enumerate(tables):
        label = t.get("name", f"grid{i}" if len(tables) > 1 else "")
        if not isinstance(label, str) or label in {b.name for b in blocks}:
            raise ConfigError(f"{source}: [[grid]] name must be a unique string, got {label!r}")
        where = "grid" if len(tables) == 1 else f"grid {label}"
        blocks.append(Block(label, _axes({k: v for k, v in t.items() if k != "name"}, where, source, name, pt,
                                         known, seen)))  # fmt: skip
    missing = sorted({p for b in blocks for p, d in pt.params.items()
                      if d is REQUIRED and p not in seen and p not in dict(b.axes)})  # fmt: skip
    if missing:
        raise ConfigError(f"{source}: point {name!r} needs {missing} in [params] or in every [grid]")
    # 4. Metrics, figures, each point's own check
    metrics = data.get("metrics", list(pt.columns[:1]))
    if isinstance(metrics, str):
        metrics = [metrics]
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"{source}: metrics must be a list of column names, got {metrics!r}")
    figures = data.get("figures", "")
    if not isinstance(figures, str):
        raise ConfigError(f"{source}: figures must be a string, got {figures!r}")
    if figures:
        from moetier.studies.figures import get_figures

        get_figures(figures)
    grid = Grid(name, tuple(blocks), tuple(fixed), tuple(metrics), source, figures)
    check_metrics(grid, grid.metrics)
    if pt.check is not None:
        for given in grid.given():
            try:
                pt.check(grid.full(given))
            except ConfigError as exc:
                raise ConfigError(f"{source}: point {given}: {exc}") from None
    return grid


def check_metrics(grid: Grid, metrics: Iterable[str]) -> None:
    cols = get_point(grid.point).columns
    bad = [m for m in metrics if cols and m not in cols]
    if bad:
        raise ConfigError(f"{grid.source}: unknown metric(s) {bad}; point {grid.point!r} returns: {', '.join(cols)}")


def load_grid(path: str | Path) -> Grid:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such grid file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not a valid TOML file ({exc})") from None
    return parse_grid(data, str(p))


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
    (sweep_results.py, sweep_plot.py).
    jobs: worker processes (default os.cpu_count(); 1 runs inline); ray: a Ray address ("local": start a
    local instance with `jobs` CPUs). on_start(n) before the n points to run; on_point(record) after each."""
    from moetier.studies.sweep_plot import plot_results
    from moetier.studies.sweep_results import RESULTS, result_rows, write_results

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
        from moetier.studies.figures import get_figures

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
    "POINTS", "POINT_MODULES", "REQUIRED", "Block", "Grid", "Point", "SweepReport", "get_point", "load_grid",
    "parse_grid", "point_key", "register_point", "run_sweep",
]  # fmt: skip
