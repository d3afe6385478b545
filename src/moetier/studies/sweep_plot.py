"""Plots of a sweep (sweep.py): for each model, one metric against the grid's first varying parameter
other than model and scheduler, one line per scheduler; OUT/METRIC_MODEL.png (OUT/METRIC.png without a
model parameter). Without such a parameter the plot is one bar per scheduler. A grid of several [[grid]]
blocks gets one set per block, named BLOCK_METRIC_MODEL.png.

Invariants: matplotlib with the Agg backend only; only rows with status "ok" and a numeric metric are
drawn; a metric is averaged over the other varying parameters (seeds, ...), and the title says which;
x values keep grid order (numbers on a numeric axis, anything else as categories); a model with nothing
to draw gets no file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from moetier.plotting import pyplot, save_figure
from moetier.studies.sweep_grid import Grid, point_key

SPLIT = ("model", "scheduler")  # one figure per model, one line per scheduler


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "all"


def _values(grid: Grid, name: str) -> tuple[Any, ...]:
    axes, fixed = dict(grid.axes), dict(grid.fixed)
    return axes[name] if name in axes else ((fixed[name],) if name in fixed else (None,))


def plot_results(rows: Sequence[dict[str, Any]], grid: Grid, metric: str, out: Path, prefix: str = "") -> list[Path]:
    """Write the metric's plots for `rows` (sweep_results.result_rows) to `out`, file names starting with
    `prefix`; returns the files. A grid of several blocks: one set of plots per block (prefix: its name)."""
    if len(grid.blocks) > 1:
        paths = []
        for b in grid.blocks:
            keys = {point_key(grid.point, g) for g in b.given(dict(grid.fixed))}
            sub = [r for r in rows if r.get("point_key") in keys]
            paths += plot_results(sub, replace(grid, blocks=(b,)), metric, out, f"{prefix}{_slug(b.name)}_")
        return paths
    plt = pyplot()
    xs_name = next((n for n in grid.varying if n not in SPLIT), None)
    averaged = [n for n in grid.varying if n not in SPLIT and n != xs_name]
    xs = _values(grid, xs_name) if xs_name else (None,)
    numeric_x = all(_number(x) for x in xs)
    paths = []
    for model in _values(grid, "model"):
        series: dict[Any, list[tuple[Any, float]]] = {}
        for sched in _values(grid, "scheduler"):
            pts = []
            for x in xs:
                ys = [float(r[metric]) for r in rows if r.get("status") == "ok" and _number(r.get(metric))
                      and r.get("model") == model and r.get("scheduler") == sched
                      and (xs_name is None or r.get(xs_name) == x)]  # fmt: skip
                if ys:
                    pts.append((x, sum(ys) / len(ys)))
            if pts:
                series[sched] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        if xs_name is None:
            labels = [str(s) for s in series]
            ax.bar(labels, [pts[0][1] for pts in series.values()], color="#4c72b0")
            ax.set_xlabel("scheduler")
        else:
            for sched, pts in series.items():
                px = [x if numeric_x else xs.index(x) for x, _ in pts]
                ax.plot(px, [y for _, y in pts], marker="o", label=str(sched) if sched is not None else metric)
            if not numeric_x:
                ax.set_xticks(range(len(xs)), [str(x) for x in xs])
            ax.set_xlabel(xs_name)
            ax.legend(fontsize="small")
        ax.set_ylabel(metric)
        title = f"{model}: {metric}" if model is not None else metric
        ax.set_title(title + (f" (mean over {', '.join(averaged)})" if averaged else ""), fontsize="medium")
        ax.grid(alpha=0.3)
        stem = f"{_slug(metric)}_{_slug(str(model))}" if model is not None else _slug(metric)
        paths.append(save_figure(fig, out / f"{prefix}{stem}.png"))
    return paths


__all__ = ["plot_results"]
