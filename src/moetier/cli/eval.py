"""`moetier eval MODEL --text FILE`: perplexity of a text file over non-overlapping windows.

Registered on the main app by cli/app.py (`register(app)`). Thin: the engine flags (engine_flags.EngineFlags)
map onto the EngineConfig; `--run-dir` records the run (report.record).

Invariants (cli/app.py's): errors (a missing or non-UTF-8 text included) are one line `error: ...` with exit 2;
the progress bar goes to stderr; with --json stdout holds exactly one JSON line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from moetier.cli.console import consoles, emit_json, progress_bar, read_text, register_command, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags
from moetier.cli.options import JsonOut, Model
from moetier.cli.tables import eval_report
from moetier.report.record import RunDirOpt, RunRecorder, run_trace


@engine_flags
def eval_(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 text file to score.")],
    max_tokens: Annotated[int | None, typer.Option(min=2, help="Score only the first N tokens.")] = None,
    window: Annotated[int, typer.Option(min=0, help="Tokens per window; 0 = the context length, capped at 1024.")] = 0,
    flags: EngineFlags = DEFAULT_FLAGS,
    run_dir: RunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Perplexity of a text file over non-overlapping windows."""
    report, err = consoles(json_out)
    with user_errors():
        config = flags.config()
        body = read_text(text)
        with flags.session(model, config, err, run_trace(run_dir, flags.trace)) as engine:
            rec = RunRecorder.for_eval(run_dir, engine, model)
            ids = engine.encode(body)[:max_tokens]
            t0 = time.perf_counter()
            with progress_bar(err, transient=True) as progress:
                task = progress.add_task(f"scoring {len(ids)} tokens", total=None)
                result = engine.perplexity(ids, window=window, on_window=rec.on_window(
                    lambda done, total: progress.update(task, completed=done, total=total)))  # fmt: skip
            elapsed = time.perf_counter() - t0
        payload = {
            "model": str(model), "text_file": str(text), "ppl": result.ppl, "nll": result.nll,
            "tokens": result.tokens, "eval_s": elapsed,
            "eval_tok_s": result.tokens / elapsed if elapsed > 0 else 0.0,
            **result.stats,
        }  # fmt: skip
        rec.finish(payload)
        if not json_out:
            report.print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens", highlight=False)
        report.print(eval_report(payload))
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier eval` to `app` (once)."""
    register_command(app, "eval", eval_)


__all__ = ["eval_", "register"]
