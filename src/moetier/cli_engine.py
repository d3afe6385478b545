"""The engine's life in a command of cli.py (generate, eval, calibrate): load it with a status line on
stderr, start the routing trace if asked, warm up dynamic precision on a text, and always close.

Invariants: the engine (torch, transformers) is imported only when a command loads one, so
`moetier --help` stays fast; `engine_session` closes the engine on every exit, which also writes
the trace; `--trace-scores` without `--trace` and `--warmup` without `--precision dynamic` are
ConfigErrors (one-line errors through cli_io.user_errors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from moetier.cli_io import read_text
from moetier.config import EngineConfig
from moetier.errors import ConfigError

if TYPE_CHECKING:
    from moetier.runtime.engine import Engine


def run_warmup(engine: Engine, warmup: Path | None, err: Console) -> None:
    """`--warmup FILE`: promote the experts the text uses (needs --precision dynamic), with a status line."""
    if warmup is None:
        return
    if engine.switching is None:
        raise ConfigError("--warmup needs --precision dynamic")
    with err.status(f"warming up on {warmup}"):
        n = engine.warmup(read_text(warmup))
    err.print(f"warmup: {n} tokens, {engine.store.stats().get('promotions', 0)} experts promoted", highlight=False)


@contextmanager
def engine_session(
    model: Path, config: EngineConfig, trace: Path | None, scores: bool, err: Console
) -> Iterator[Engine]:
    """Load (with a status line on stderr), start the trace if asked, and always close."""
    if scores and trace is None:
        raise ConfigError("--trace-scores needs --trace FILE")
    with err.status(f"loading {model}"):
        from moetier.runtime.engine import load

        engine = load(model, config)
    try:
        if trace is not None:
            engine.record_trace(trace, with_scores=scores)
        yield engine
    finally:
        engine.close()  # also writes the trace
    if trace is not None:
        err.print(f"trace written to {trace}", markup=False, highlight=False)


__all__ = ["engine_session", "run_warmup"]
