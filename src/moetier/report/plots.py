"""The figures of `moetier report`, one function per figure, each writing one PNG from report/data.py's
numbers: activation heatmap (DynaExq Fig. 1 style), hit rate against cache size per policy, precision
mix and promotions over time, achieved sparsity per layer. The simulator's timeline is drawn by
moetier.sim.timeline.draw_timeline (the same chart as `moetier simulate --timeline`), not here.

Invariants: matplotlib with the Agg backend only (no display); every function creates the parent
folder, closes its figure and returns the path it wrote.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetier.plotting import pyplot, save_figure
from moetier.report.data import Activation, PrecisionSeries


def plot_activation(act: Activation, path: Path, title: str) -> Path:
    """Left: heatmap layer x expert of token share; right: each of the first and last layers' shares
    sorted high to low against the uniform share (how skewed routing is, as DynaExq's Fig. 1)."""
    plt = pyplot()
    share = np.asarray(act.share)  # [L, E]
    n_layers, n_experts = share.shape
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.35 * n_layers + 1.8)),
                                  gridspec_kw={"width_ratios": [3, 1.3]})  # fmt: skip
    # 1. heatmap
    im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    step = max(1, n_layers // 16)
    ax.set_yticks(range(0, n_layers, step), [str(act.layers[i]) for i in range(0, n_layers, step)])
    fig.colorbar(im, ax=ax, label="token share in layer")
    ax.set_title(title, fontsize="medium")
    # 2. sorted shares of the first and last layers
    ranks = np.arange(1, n_experts + 1)  # [E]
    for i in sorted({0, n_layers - 1}):
        ax2.plot(ranks, np.sort(share[i])[::-1], marker=".", label=f"layer {act.layers[i]}")
    ax2.axhline(1.0 / n_experts, color="gray", linestyle="--", linewidth=1, label="uniform")
    ax2.set_xlabel("expert rank")
    ax2.set_ylabel("token share")
    ax2.set_title("sorted routing frequency", fontsize="medium")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_hit_rates(curves: dict[str, list[dict[str, float]]], path: Path, title: str) -> Path:
    """Hit rate (all calls, solid; decode only, dashed) against the cache ratio, one colour per policy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for i, (policy, pts) in enumerate(curves.items()):
        color = f"C{i}"
        xs = [p["ratio"] for p in pts]
        ax.plot(xs, [100 * p["hit_rate"] for p in pts], marker="o", color=color, label=policy)
        ax.plot(xs, [100 * p["decode_hit_rate"] for p in pts], linestyle="--", color=color, alpha=0.6)
    ax.set_xlabel("cache size (fraction of all routed experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title + " (dashed: decode only)", fontsize="medium")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_precision(series: PrecisionSeries, path: Path, title: str) -> Path:
    """Top: experts held at each precision (stacked); bottom: cumulative promotions and demotions."""
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 5.6), sharex=True)
    steps = list(series.steps)
    ax.stackplot(steps, *[list(v) for v in series.experts.values()], labels=list(series.experts), alpha=0.85,
                 step="post")  # fmt: skip
    ax.set_ylabel("experts")
    ax.legend(loc="upper right", fontsize="small")
    ax.set_title(title, fontsize="medium")
    ax2.step(steps, list(series.promotions), where="post", marker=".", label="promotions")
    ax2.step(steps, list(series.demotions), where="post", marker=".", label="demotions")
    ax2.set_xlabel(series.unit)
    ax2.set_ylabel("cumulative count")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_sparsity(layers: dict[str, float], target: float, path: Path, title: str) -> Path:
    """One bar per MoE layer: achieved fraction of neurons skipped; the target as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.3 * len(layers) + 2.5), 3.8))
    names = list(layers)
    ax.bar(names, [layers[n] for n in names], color="#4c72b0", label="achieved")
    ax.axhline(target, color="#c44e52", linestyle="--", label=f"target {target:g}")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("sparsity (neurons skipped)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")
    return save_figure(fig, path)


__all__ = ["plot_activation", "plot_hit_rates", "plot_precision", "plot_sparsity"]
