"""Routing traces: schema, recorder, loader (Parquet via pyarrow).

One row per token per MoE layer call:
    step (decode step, or 0 for the prefill chunk), token (position in the batch),
    layer, experts (top-k ids), weights (top-k gate weights), scores (optional, all E
    router probabilities).
File-level metadata (JSON in the Parquet schema metadata under b"moetier"): model id,
num_experts, top_k, hidden_size, moe_intermediate_size, dtype, schema version.
Real traces recorded by the engine and synthetic ones share this schema. The engine records only
forwards that completed: Engine.step marks each forward's start (`TraceRecorder.begin`) and takes a
failed forward's rows back (`TraceRecorder.rollback`), so a retried step appears once.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moetier.errors import TraceError

SCHEMA_VERSION = 1
REQUIRED_META = ("model", "num_experts", "top_k", "hidden_size", "moe_intermediate_size", "dtype")
SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("token", pa.int32()),
        ("layer", pa.int16()),
        ("experts", pa.list_(pa.int32())),
        ("weights", pa.list_(pa.float32())),
        ("scores", pa.list_(pa.float32())),
    ]
)


@dataclass
class Trace:
    table: pa.Table
    metadata: dict[str, Any]

    def __len__(self) -> int:
        return self.table.num_rows


@dataclass
class TraceRecorder:
    """Collects rows in memory; `save` writes them. `record` takes plain lists.

    Forwards: `begin` marks where a forward's rows start; `rollback` drops the rows recorded since then (a
    forward that failed part-way, whose MoE layers before the failure had already recorded). Rows before the
    last `begin`, and those a rollback keeps, are never taken back."""

    metadata: dict[str, Any]
    with_scores: bool = False
    step: int = 0
    _cols: dict[str, list[Any]] = field(default_factory=lambda: {n: [] for n in SCHEMA.names})
    _mark: int = 0  # rows before this one belong to forwards that completed

    def begin(self, step: int | None = None) -> None:
        """A forward starts: the rows recorded from now on are its own (`rollback` takes them back); `step`,
        when given, is their step index."""
        if step is not None:
            self.step = step
        self._mark = len(self._cols["step"])

    def rollback(self, keep: Collection[int] = ()) -> int:
        """The forward since `begin` failed: drop its rows but those of the tokens in `keep` (rows of a forward
        that ran to its end and whose result is used for those tokens; they keep their token numbers and are
        final). Returns the number of rows dropped."""
        tokens, wanted = self._cols["token"][self._mark :], set(keep)
        kept = [i for i, t in enumerate(tokens) if t in wanted]
        for col in self._cols.values():
            tail = col[self._mark :]
            col[self._mark :] = [tail[i] for i in kept]
        self._mark = len(self._cols["step"])  # the forward is over: what it kept is final
        return len(tokens) - len(kept)

    def record(
        self, layer: int, experts: list[list[int]], weights: list[list[float]], scores: list[list[float]] | None
    ) -> None:
        n = len(experts)
        c = self._cols
        c["step"].extend([self.step] * n)
        c["token"].extend(range(n))
        c["layer"].extend([layer] * n)
        c["experts"].extend(experts)
        c["weights"].extend(weights)
        c["scores"].extend(scores if (self.with_scores and scores is not None) else [None] * n)

    def save(self, path: str | os.PathLike[str]) -> Path:
        meta = {**self.metadata, "schema_version": SCHEMA_VERSION}
        return write_table(pa.table(self._cols, schema=SCHEMA), meta, path)


def write_table(table: pa.Table, metadata: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `table` as Parquet with `metadata` as JSON under b"moetier" (what `load` reads), creating the
    parent folder."""
    table = table.replace_schema_metadata({b"moetier": json.dumps(metadata).encode()})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace and its metadata; a file of another schema raises TraceError naming it."""
    p = Path(path)
    try:
        table = pq.read_table(p)
    except (OSError, pa.ArrowInvalid) as exc:
        raise TraceError(f"{p}: cannot read as a Parquet trace: {exc}") from exc
    raw = (table.schema.metadata or {}).get(b"moetier")
    if raw is None:
        raise TraceError(f"{p}: no moetier metadata; not a moetier trace")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{p}: trace metadata is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise TraceError(f"{p}: trace metadata is {type(meta).__name__}, expected a JSON object")
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise TraceError(f"{p}: trace metadata lacks {missing}")
    absent = [n for n in SCHEMA.names if n not in table.column_names]
    if absent:
        raise TraceError(f"{p}: trace lacks column(s) {absent}")
    wrong = [
        f"{n} is {table.schema.field(n).type}, expected {SCHEMA.field(n).type}"
        for n in SCHEMA.names
        if not table.schema.field(n).type.equals(SCHEMA.field(n).type) and not _null_column(table, n)
    ]
    if wrong:
        raise TraceError(f"{p}: trace column types differ from the schema: {'; '.join(wrong)}")
    return Trace(table=table.select(SCHEMA.names), metadata=meta)


def _null_column(table: pa.Table, name: str) -> bool:
    """An all-null column (e.g. scores not recorded) may be stored as the null type."""
    return bool(pa.types.is_null(table.schema.field(name).type))


@dataclass(frozen=True)
class Call:
    """One MoE layer call of a trace, as arrays: ids/weights [T, k], scores [T, E] or None."""

    step: int
    layer: int
    ids: Any  # np.ndarray int64 [T, k]
    weights: Any  # np.ndarray float32 [T, k]
    scores: Any  # np.ndarray float32 [T, E] | None


def iter_calls(trace: Trace) -> list[Call]:
    """The trace's layer calls in recorded order (rows of one call are contiguous: same step and
    layer). Raises TraceError for ragged top-k or score rows."""
    import numpy as np

    t = trace.table
    if t.num_rows == 0:
        return []
    step = t.column("step").to_numpy()
    layer = t.column("layer").to_numpy()
    k = int(trace.metadata["top_k"])
    ids = _fixed(t.column("experts"), k, "experts", np.int64)
    weights = _fixed(t.column("weights"), k, "weights", np.float32)
    scores = None
    if not _null_column(t, "scores") and t.column("scores").null_count == 0:
        scores = _fixed(t.column("scores"), int(trace.metadata["num_experts"]), "scores", np.float32)
    change = np.flatnonzero((np.diff(step) != 0) | (np.diff(layer) != 0)) + 1
    bounds = [0, *change.tolist(), t.num_rows]
    return [
        Call(int(step[a]), int(layer[a]), ids[a:b], weights[a:b], None if scores is None else scores[a:b])
        for a, b in itertools.pairwise(bounds)
    ]


def _fixed(column: Any, width: int, name: str, dtype: Any) -> Any:
    """A list column whose every row has `width` values -> array [N, width]."""
    import numpy as np

    col = column.combine_chunks()
    lengths = col.value_lengths().to_numpy(zero_copy_only=False)
    if col.null_count or (lengths != width).any():
        bad = int(np.flatnonzero(lengths != width)[0]) if (lengths != width).any() else -1
        raise TraceError(f"trace column {name!r}: every row needs {width} values (row {bad} differs)")
    return col.flatten().to_numpy(zero_copy_only=False).astype(dtype).reshape(-1, width)
