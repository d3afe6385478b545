"""Run directories: what `moetier generate/eval --run-dir DIR` and `moetier simulate --run-dir DIR` write,
the input `moetier report` reads (report/load.py).

A RUN directory (generate, eval) holds
- `trace.parquet`: the routing trace (moetier.traces schema; router scores with --trace-scores);
- `stats.jsonl`: the engine's statistics over time, one JSON object a line, sampled in the CLI layer
  from `Engine.stats()` every `every` decode steps (generate) or after every window (eval):
  {"step", "hits", "misses", "promotions", "demotions", "precision": {name: experts},
   "sparsity": {layer: achieved} (only with --sparsity)};
- `run.json`: {"kind": "run", "schema", "command", "model", "config" (EngineConfig as a dict),
  "stats_every", "result" (the command's --json payload, final stats included)}.
A SIMULATION directory holds `result.json` ({"kind": "simulation", "schema", "source", "trace" (the
absolute path of the replayed trace, null when synthetic), "result": the --json payload}) and, for
the two-domain simulator, `timeline.jsonl` (one TimelineOp a line: the window that
`--timeline-steps/--timeline-layers` selects).

Invariants: without a run directory every function here is a no-op (the callbacks pass straight
through), so the cli commands call them unconditionally; sampling only reads `Engine.stats()`; run.json is
written last, so a directory with run.json is complete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from moetier.errors import ConfigError

SCHEMA = 1
TRACE, STATS, RUN, RESULT, TIMELINE = "trace.parquet", "stats.jsonl", "run.json", "result.json", "timeline.jsonl"
MAX_SAMPLES = 512  # stats.jsonl lines of a generate run at most (the sampling interval grows with the tokens)

RunDirOpt = Annotated[
    Path | None,
    typer.Option("--run-dir", metavar="DIR", help="Record a run for `moetier report`: DIR/trace.parquet, "
                 "DIR/stats.jsonl (engine stats over time) and DIR/run.json."),
]  # fmt: skip
SimRunDirOpt = Annotated[
    Path | None,
    typer.Option("--run-dir", metavar="DIR", help="Record the simulation for `moetier report`: DIR/result.json "
                 "and DIR/timeline.jsonl (the --timeline-steps/--timeline-layers window's ops)."),
]  # fmt: skip


def _prepare(run_dir: Path) -> Path:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file; give a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run_trace(run_dir: Path | None, trace: Path | None) -> Path | None:
    """The trace file to record: DIR/trace.parquet with a run directory (then --trace is a ConfigError)."""
    if run_dir is None:
        return trace
    if trace is not None:
        raise ConfigError(f"--run-dir records its own trace ({run_dir / TRACE}); drop --trace")
    return _prepare(run_dir) / TRACE


def sample(stats: dict[str, Any], step: int) -> dict[str, Any]:
    """One stats.jsonl line from Engine.stats() after `step` decode steps (or windows)."""
    line: dict[str, Any] = {
        "step": step, "hits": int(stats.get("hits", 0)), "misses": int(stats.get("misses", 0)),
        "promotions": int(stats.get("promotions", 0)), "demotions": int(stats.get("demotions", 0)),
        "precision": {str(k): int(v.get("experts", 0)) for k, v in (stats.get("precision") or {}).items()},
    }  # fmt: skip
    sparsity = stats.get("sparsity")
    if isinstance(sparsity, dict):
        line["sparsity"] = {str(k): float(v["achieved"]) for k, v in (sparsity.get("layers") or {}).items()}
    return line


class RunRecorder:
    """Samples `stats()` into DIR/stats.jsonl while a command runs; `finish` writes DIR/run.json."""

    def __init__(self, run_dir: Path | None, command: str, model: Path, stats: Callable[[], dict[str, Any]],
                 config: Any = None, every: int = 1) -> None:  # fmt: skip
        self.run_dir, self.command, self.model, self.stats = run_dir, command, model, stats
        self.config, self.every, self.step = config, max(1, every), 0
        if run_dir is not None:
            (_prepare(run_dir) / STATS).write_text("", encoding="utf-8")

    @classmethod
    def for_generate(cls, run_dir: Path | None, engine: Any, model: Path, max_new_tokens: int) -> RunRecorder:
        every = -(-max_new_tokens // MAX_SAMPLES)  # ceil: at most MAX_SAMPLES lines
        return cls(run_dir, "generate", model, engine.stats, engine.config, every)

    @classmethod
    def for_eval(cls, run_dir: Path | None, engine: Any, model: Path) -> RunRecorder:
        return cls(run_dir, "eval", model, engine.stats, engine.config)

    def _write(self, step: int) -> None:
        assert self.run_dir is not None
        with (self.run_dir / STATS).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(sample(self.stats(), step)) + "\n")

    def on_token(self, inner: Callable[[int, str], None]) -> Callable[[int, str], None]:
        """Wraps generate's on_token: a stats line every `every` tokens."""
        if self.run_dir is None:
            return inner

        def call(token_id: int, text: str) -> None:
            inner(token_id, text)
            self.step += 1
            if self.step % self.every == 0:
                self._write(self.step)

        return call

    def on_window(self, inner: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """Wraps eval's on_window(done, total): a stats line per window."""
        if self.run_dir is None:
            return inner

        def call(done: int, total: int) -> None:
            inner(done, total)
            self.step = done
            self._write(done)

        return call

    def finish(self, payload: dict[str, Any]) -> Path | None:
        """Write run.json (the final stats line too, if the last step was not sampled)."""
        if self.run_dir is None:
            return None
        if self.step % self.every:  # eval samples every window (every == 1): never left over
            self._write(self.step)
        cfg = self.config
        config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else cfg
        doc = {"kind": "run", "schema": SCHEMA, "command": self.command, "model": str(self.model),
               "config": config, "stats_every": self.every, "result": payload}  # fmt: skip
        path = self.run_dir / RUN
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        return path


def write_simulation(run_dir: Path | None, payload: dict[str, Any], source: str, trace: Path | None,
                     ops: Sequence[Any] = ()) -> None:  # fmt: skip
    """`moetier simulate --run-dir DIR`: DIR/timeline.jsonl (the window's ops), then DIR/result.json, which
    names the replayed trace file by its absolute path (null for a synthetic trace)."""
    if run_dir is None:
        return
    _prepare(run_dir)
    lines = [json.dumps(dataclasses.asdict(op)) for op in ops]
    (run_dir / TIMELINE).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    doc = {"kind": "simulation", "schema": SCHEMA, "source": source,
           "trace": str(trace.resolve()) if trace is not None else None, "result": payload}  # fmt: skip
    (run_dir / RESULT).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


__all__ = ["MAX_SAMPLES", "RunDirOpt", "RunRecorder", "SimRunDirOpt", "run_trace", "sample", "write_simulation"]
