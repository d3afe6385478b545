"""What a sweep point is: a named, module-level function of its parameters with their defaults
(`REQUIRED`: the grid must give it), the parameters it refuses, a cheap check and its result columns.

Plain data, no registry: the shipped points (studies/sweep_simulate.py, studies/sweep_tri.py) each define
one `POINT`, and studies/sweep_grid.py holds the name -> Point dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REQUIRED: Any = object()  # a parameter default meaning "the grid must give it"


@dataclass(frozen=True)
class Point:
    """What a sweep point computes: fn(params) -> {column: value}; nested dicts are flattened (a_b)."""

    fn: Callable[[dict[str, Any]], dict[str, Any]]  # module-level, so process pools can pickle it
    params: Mapping[str, Any]  # accepted parameter -> default (REQUIRED: no default)
    refused: Mapping[str, str] = field(default_factory=dict)  # parameters this point cannot use -> why
    check: Callable[[dict[str, Any]], None] | None = None  # cheap validation of one point's params
    columns: tuple[str, ...] = ()  # result columns it returns (plottable metrics); () unknown


__all__ = ["REQUIRED", "Point"]
