"""The two matplotlib steps every figure of moetier shares (report/plots.py, sim/timeline.py, studies/sweep_plot.py,
studies/figures_tri.py): get pyplot on the Agg backend, and save a finished figure.

Invariants: importing this module imports nothing heavy (matplotlib is imported when pyplot() is called);
the backend is always Agg (no display); save_figure lays the figure out tightly, writes it at `dpi`,
creates the parent folder and closes the figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot, with the Agg backend selected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: float = 110) -> Path:
    """tight_layout, write `fig` to `path` (its parent made if missing) at `dpi`, close it; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


__all__ = ["pyplot", "save_figure"]
