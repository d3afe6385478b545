"""`moetier report`'s work, without the console: for a ReportInput, compute each figure's data
(report/data.py), draw what is there (report/plots.py, sim/timeline.py) into OUT and write
OUT/index.html (report/html.py).

Steps, in order: 1. activation heatmap; 2. hit rate vs cache size (one replay per policy and
ratio; `on_point` is called after each, for a progress bar); 3. precision mix over time;
4. achieved sparsity per layer; 5. simulator timeline; 6. the index.
Invariants: every figure is either written or skipped with a reason, never both; the result
dict lists both (JSON-ready), in the order above.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetier.report import data, plots
from moetier.report.html import Figure, write_index
from moetier.report.load import ReportInput
from moetier.sim.timeline import draw_timeline

TITLES = {
    "activation": "Expert activation per layer",
    "hit_rate": "Hit rate against cache size",
    "precision": "Precision mix and promotions over time",
    "sparsity": "Achieved sparsity per layer",
    "timeline": "Simulator timeline",
}


def _timeline(inp: ReportInput, path: Path) -> Path | data.Skip:
    if inp.kind != "simulation":
        return data.Skip(f"no timeline: the input is a {inp.kind}, not a simulation directory")
    if not inp.timeline:
        return data.Skip("no timeline: the simulation recorded no ops (a three-domain scheduler, or a "
                         "--timeline-steps/--timeline-layers window outside the run)")  # fmt: skip
    res = inp.run.get("result", {})
    title = f"{res.get('spec', '?')} on {res.get('profile', '?')}, {res.get('scheduler', '?')}, " \
            f"cache {res.get('cache_ratio', '?')}"  # fmt: skip
    return draw_timeline(inp.timeline, path, title)


def build_report(inp: ReportInput, out: Path, ratios: Sequence[float], policies: Sequence[str],
                 on_point: Callable[[str, float], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write OUT/*.png and OUT/index.html; returns {"out", "index", "figures", "skipped", "hit_rates"}."""
    out.mkdir(parents=True, exist_ok=True)
    figures: list[Figure] = []

    def add(key: str, made: Path | data.Skip) -> None:
        if isinstance(made, data.Skip):
            figures.append(Figure(key, TITLES[key], None, made.reason))
        else:
            figures.append(Figure(key, TITLES[key], made))

    # 1. activation heatmap
    act = data.activation(inp)
    add("activation", act if isinstance(act, data.Skip) else
        plots.plot_activation(act, out / "activation.png", f"{inp.name}: token share per expert"))  # fmt: skip
    # 2. hit rate against cache size
    curves = data.hit_curves(inp, ratios, policies, on_point)
    add("hit_rate", curves if isinstance(curves, data.Skip) else
        plots.plot_hit_rates(curves, out / "hit_rate.png", f"{inp.name}: cache replay"))  # fmt: skip
    # 3. precision mix and promotions
    series = data.precision_series(inp)
    add("precision", series if isinstance(series, data.Skip) else
        plots.plot_precision(series, out / "precision.png", f"{inp.name}: dynamic precision"))  # fmt: skip
    # 4. achieved sparsity per layer
    sp = data.sparsity_layers(inp)
    add("sparsity", sp if isinstance(sp, data.Skip) else
        plots.plot_sparsity(sp[0], sp[1], out / "sparsity.png", f"{inp.name}: activation sparsity"))  # fmt: skip
    # 5. simulator timeline
    add("timeline", _timeline(inp, out / "timeline.png"))
    # 6. the index
    hit_table = None
    if not isinstance(curves, data.Skip):
        header = ["policy", *(f"{r:g}" for r in ratios)]
        hit_table = (header, [[p, *(f"{100 * pt['hit_rate']:.1f}%" for pt in pts)] for p, pts in curves.items()])
    index = write_index(out, inp.name, data.numbers(inp), figures, hit_table)
    return {
        "input": str(inp.path), "kind": inp.kind, "out": str(out), "index": str(index),
        "figures": {f.key: str(f.file) for f in figures if f.file is not None},
        "skipped": {f.key: f.reason for f in figures if f.file is None},
        "hit_rates": None if isinstance(curves, data.Skip) else curves,
    }  # fmt: skip


__all__ = ["TITLES", "build_report"]
