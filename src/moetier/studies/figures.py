"""A study's own figures, drawn from a sweep's result rows after the generic plots (`figures = "NAME"` in
a grid file). FIGURES maps a name to "module:function"; the function takes (rows, out folder) and returns
the files it wrote. Modules are imported only when a grid names them (matplotlib stays out of --help).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

Figures = Callable[[Sequence[dict[str, Any]], Path], list[Path]]
FIGURES: dict[str, str] = {"trimoe": "moetier.studies.figures_tri:draw"}


def get_figures(name: str) -> Figures:
    if name not in FIGURES:
        raise ConfigError(f"unknown figures {name!r}; known: {', '.join(sorted(FIGURES))}")
    module, fn = FIGURES[name].split(":")
    draw: Figures = getattr(importlib.import_module(module), fn)
    return draw


__all__ = ["FIGURES", "Figures", "get_figures"]
