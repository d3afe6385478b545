"""Sweep grids: what a sweep point is (a named function of its parameters, registered in POINTS) and a
GRID.toml expanded into points, checked whole before anything runs (sweep.py runs them).

GRID.toml::

    point = "simulate"          # a name in POINTS (default "simulate")
    metrics = ["tbt_s"]         # result columns plotted (default: the point's first column)
    figures = "trimoe"          # optional: a study's own figures (figures.FIGURES), drawn after the plots
    [params]                    # fixed values, one per parameter
    profile = "a6000-5220r"
    [grid]                      # lists; the sweep is their cartesian product, first key outermost
    models = ["deepseek-v2-lite", "qwen2-57b-a14b"]
    cache_ratios = [0.25, 0.5]

`[[grid]]` tables instead of one `[grid]` give several products (each may have `name = "..."`); the sweep
runs their union, once per distinct point. A key names a parameter of the point, or its plural
(models -> model, batch_sizes -> batch_size, cache_policies -> cache_policy). A point is keyed by a stable
hash of the point name and the parameters the grid gives it (`point_key`).

The shipped points are defined in their own modules (studies/sweep_simulate.py, studies/sweep_tri.py; the Point type is
point.py's) and listed in POINTS here; `register_point` adds others (tests, studies of your own).

Invariants: no torch here; a grid is checked whole (keys, value types, each point's own check) before any
point runs, and an unknown key is one ConfigError naming it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError
from moetier.studies import sweep_simulate, sweep_tri
from moetier.studies.figures import get_figures
from moetier.studies.point import REQUIRED, Point

Scalar = str | int | float | bool

POINTS: dict[str, Point] = {"simulate": sweep_simulate.POINT, "tri": sweep_tri.POINT}  # the shipped points (add new)


def register_point(name: str, point: Point) -> None:
    """Make `point` available as `point = "NAME"` in grid files (replacing any of that name)."""
    POINTS[name] = point


def get_point(name: str) -> Point:
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
    figures: str = ""  # a name in figures.FIGURES drawn after the generic plots ("" = none)

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


__all__ = [
    "POINTS", "REQUIRED", "Axes", "Block", "Grid", "Point", "Scalar", "check_metrics", "get_point",
    "load_grid", "parse_grid", "point_key", "register_point",
]  # fmt: skip
