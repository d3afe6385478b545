"""Gantt chart of a simulated window (like HybriMoE's Fig. 1 and 5): one lane per GPU, CPU,
PCIe link and disk, one bar per op (dense work, routed expert, shared expert, demand move,
prefetch), times in milliseconds from the window's first op.

Invariants: matplotlib with the Agg backend only (no display); lanes appear in the fixed order
gpu, cpu, pcie, disk, only those the window uses; an empty window is a ConfigError naming the
window, never an empty picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moetier.errors import ConfigError
from moetier.plotting import pyplot, save_figure
from moetier.sim.machine import TimelineOp

LANE_ORDER = ("gpu", "cpu", "pcie", "disk")
COLORS = {
    "dense": "#b0b0b0",
    "expert": "#4c72b0",
    "shared": "#8172b2",
    "move": "#dd8452",
    "prefetch": "#55a868",
    "fill": "#c44e52",
}


def draw_timeline(ops: Sequence[TimelineOp], path: str | Path, title: str = "") -> Path:
    """Write the Gantt chart of `ops` to `path` (PNG); returns the path."""
    if not ops:
        raise ConfigError("the timeline window holds no ops; choose steps/layers the run covers")
    plt = pyplot()
    patch = plt.matplotlib.patches.Patch  # pyplot imported matplotlib.patches (moetier.plotting keeps it lazy)

    # 1. lanes and time origin
    lanes = [lane for lane in LANE_ORDER if any(op.lane == lane for op in ops)]
    lanes += sorted({op.lane for op in ops} - set(lanes))
    row = {lane: i for i, lane in enumerate(reversed(lanes))}
    t0 = min(op.start for op in ops)
    span = max(op.end for op in ops) - t0
    # 2. bars, labelled where wide enough
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(lanes) + 1.6), dpi=110)
    for op in ops:
        x, w = (op.start - t0) * 1e3, (op.end - op.start) * 1e3
        ax.broken_barh([(x, w)], (row[op.lane] - 0.4, 0.8), facecolors=COLORS.get(op.kind, "#999999"),
                       edgecolor="white", linewidth=0.4)  # fmt: skip
        if span > 0 and w / (span * 1e3) > 0.025:
            text = op.label if op.kind != "dense" else f"L{op.layer}"
            ax.text(x + w / 2, row[op.lane], text, ha="center", va="center", fontsize=7, color="white")
    # 3. axes and legend
    ax.set_yticks(list(row.values()), list(row.keys()))
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, max(span * 1e3, 1e-6))
    kinds = [k for k in COLORS if any(op.kind == k for op in ops)]
    ax.legend(
        handles=[patch(color=COLORS[k], label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28 if len(lanes) > 2 else -0.45),
        ncol=len(kinds),
        fontsize=8,
        frameon=False,
    )
    steps = sorted({op.step for op in ops})
    layers = sorted({op.layer for op in ops})
    ax.set_title(title or f"steps {steps[0]}-{steps[-1]}, layers {layers[0]}-{layers[-1]}", fontsize=10)
    return save_figure(fig, Path(path))  # dpi 110, as the figure was made
