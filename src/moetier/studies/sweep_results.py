"""The results of a sweep (sweep.py): one row per recorded point of a grid, in grid order, and
OUT/results.parquet written from those rows.

Invariants: columns are point_key, the [params] then the grid's parameters, status, error, seconds, then
the result columns in first-seen order; a result column named like a parameter becomes NAME_result; a
column whose values pyarrow cannot type together is stored as JSON text; the file is replaced atomically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetier.studies.sweep_grid import Grid

RESULTS = "results.parquet"
FIXED_COLUMNS = ("status", "error", "seconds")


def result_rows(grid: Grid, records: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One dict per recorded point of `grid`, in grid order: point_key, its block's name (grids with several
    [[grid]] blocks; a point in two blocks is listed once, under the first), parameters, status, error,
    seconds, then result columns (a result column named like a parameter becomes NAME_result)."""
    rows = []
    names = [n for n, _ in grid.axes]
    for block, key, given in grid.points():
        rec = records.get(key)
        if rec is None:
            continue
        full = grid.full(given)  # a parameter another block varies takes its value here (its default)
        row: dict[str, Any] = {"point_key": key, **({"block": block.name} if len(grid.blocks) > 1 else {}),
                               **{n: full[n] for n in names}, **given,
                               **{c: rec.get(c) for c in FIXED_COLUMNS}}  # fmt: skip
        for col, value in (rec.get("result") or {}).items():
            row[f"{col}_result" if col in row else col] = value
        rows.append(row)
    return rows


def _column(values: list[Any]) -> Any:
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in values], pa.string())


def write_results(rows: list[dict[str, Any]], grid: Grid, path: Path) -> Path:
    """results.parquet: one row per point; parameter columns first (then status, error, seconds, results)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    params = ["point_key", *(["block"] if len(grid.blocks) > 1 else []), *(n for n, _ in grid.fixed),
              *(n for n, _ in grid.axes)]
    names = list(dict.fromkeys([*params, *FIXED_COLUMNS, *(c for r in rows for c in r)]))
    typed = {"point_key": pa.string(), "status": pa.string(), "error": pa.string(), "seconds": pa.float64()}
    arrays = [pa.array([r.get(n) for r in rows], typed[n]) if n in typed else _column([r.get(n) for r in rows])
              for n in names]  # fmt: skip
    meta = {"moetier.sweep": json.dumps({"point": grid.point, "grid": grid.source, "axes": [n for n, _ in grid.axes]})}
    table = pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(meta)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


__all__ = ["FIXED_COLUMNS", "RESULTS", "result_rows", "write_results"]
