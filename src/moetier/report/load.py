"""The input of `moetier report`: a run directory, a simulation directory (report/record.py writes
both) or a bare routing trace (.parquet), detected and read into one `ReportInput`.

Invariants: anything else (a missing path, a file that is not a moetier trace, a directory with
neither run.json nor result.json, an unreadable JSON file) is a ConfigError or TraceError whose
message names the path and what was expected; absent optional parts (no trace, no stats lines, no
timeline) are None / empty, never errors, and the report says why their figures are missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetier import traces
from moetier.errors import ConfigError, TraceError
from moetier.report.record import RESULT, RUN, STATS, TIMELINE, TRACE
from moetier.sim.machine import TimelineOp


@dataclass(frozen=True)
class ReportInput:
    kind: str  # "run" | "simulation" | "trace"
    path: Path
    name: str
    trace: traces.Trace | None = None
    trace_path: Path | None = None
    run: dict[str, Any] = field(default_factory=dict)  # run.json or result.json
    stats: tuple[dict[str, Any], ...] = ()  # stats.jsonl lines (runs)
    timeline: tuple[TimelineOp, ...] = ()  # simulations of the two-domain machine


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{n}: expected a JSON object")
        out.append(row)
    return out


def _timeline(path: Path) -> tuple[TimelineOp, ...]:
    names = {"lane", "kind", "label", "start", "end", "step", "layer"}
    ops = []
    for row in _jsonl(path):
        if set(row) != names:
            raise ConfigError(f"{path}: a timeline op needs exactly the keys {sorted(names)}, got {sorted(row)}")
        ops.append(TimelineOp(**row))
    return tuple(ops)


def _optional_trace(path: Path) -> traces.Trace | None:
    return traces.load(path) if path.is_file() else None


def load_input(path: Path) -> ReportInput:
    """Detect and read INPUT: a run dir (run.json), a simulation dir (result.json) or a trace (.parquet)."""
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / RUN).is_file():
            run = _json(path / RUN)
            return ReportInput("run", path, path.resolve().name, trace=_optional_trace(path / TRACE),
                               trace_path=path / TRACE, run=run, stats=tuple(_jsonl(path / STATS)))  # fmt: skip
        if (path / RESULT).is_file():
            res = _json(path / RESULT)
            source = Path(res["trace"]) if isinstance(res.get("trace"), str) else None
            trace = _optional_trace(source) if source is not None else None
            return ReportInput("simulation", path, path.resolve().name, trace=trace, trace_path=source, run=res,
                               timeline=_timeline(path / TIMELINE))  # fmt: skip
        raise ConfigError(f"{path}: not a run directory ({RUN}, from generate/eval --run-dir) nor a simulation "
                          f"directory ({RESULT}, from simulate --run-dir)")  # fmt: skip
    try:
        trace = traces.load(path)
    except TraceError as exc:
        raise TraceError(f"{path}: not a run directory, simulation directory or routing trace (.parquet): "
                         f"{str(exc).removeprefix(f'{path}: ')}") from None  # fmt: skip
    return ReportInput("trace", path, path.stem, trace=trace, trace_path=path)


def default_out(inp: ReportInput) -> Path:
    """INPUT/report for a directory, ./report-NAME for a trace file."""
    return inp.path / "report" if inp.kind != "trace" else Path.cwd() / f"report-{inp.name}"


__all__ = ["ReportInput", "default_out", "load_input"]
