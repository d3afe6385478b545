"""A study's own figures, drawn from a sweep's result rows after the generic plots (`figures = "NAME"` in
a grid file). FIGURES maps a name to a function that takes (rows, out folder) and returns the files it wrote.
Invariants: matplotlib is imported only when a function draws (moetier.plotting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError
from moetier.studies import figures_tri

Figures = Callable[[Sequence[dict[str, Any]], Path], list[Path]]
FIGURES: dict[str, Figures] = {"trimoe": figures_tri.draw}


def get_figures(name: str) -> Figures:
    if name not in FIGURES:
        raise ConfigError(f"unknown figures {name!r}; known: {', '.join(sorted(FIGURES))}")
    return FIGURES[name]


__all__ = ["FIGURES", "Figures", "get_figures"]
