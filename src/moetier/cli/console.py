"""Console side of the command line (cli/): reading text and trace files, one-line errors, the
report and stderr consoles, progress bars, the --json line, streaming generated text, and
registering a command module's command on the app (each command module's `register`).

Invariants (see cli/app.py): every MoetierError and any OSError on a file named by a flag becomes
`error: <message>` on stderr with exit 2 (a NumericalError, NaN / Inf produced by the model, included: no
figure is printed then); with --json, stdout holds exactly one JSON line, and it is strict JSON: a figure that
is not finite (an overflowed perplexity, say) is written as null and its key listed in `non_finite`, never as
a bare NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetier.errors import ConfigError, MoetierError, TraceError

if TYPE_CHECKING:
    from moetier.runtime.engine import Engine


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def require_trace(path: Path) -> None:
    """TraceError (-> `error: PATH: no such file`) unless `path` is a file."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")


def register_command(app: typer.Typer, name: str, command: Any) -> None:
    """Add `command` to `app` as `moetier NAME`, once: a second call for the same name is a no-op."""
    if any(cmd.name == name for cmd in app.registered_commands):
        return
    app.command(name=name)(command)


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """MoetierError and file errors -> `error: ...` on stderr, exit 2; Ctrl-C -> exit 130."""
    try:
        yield
    except MoetierError as exc:
        fail(str(exc))
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        fail("interrupted", 130)


def consoles(json_out: bool) -> tuple[Console, Console]:
    """(report console, stderr console): reports go to stderr in --json mode."""
    err = Console(stderr=True)
    return (err if json_out else Console()), err


def progress_bar(err: Console, transient: bool = False) -> Progress:
    """The bar every long command shows on stderr: description, bar, done/total, elapsed."""
    return Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=err, transient=transient,
    )  # fmt: skip


def emit_json(payload: dict[str, Any]) -> None:
    """The --json line: strict JSON (non-finite floats become null, their dotted keys listed in `non_finite`)."""
    bad: list[str] = []
    clean = _finite(payload, "", bad)
    if bad:
        clean["non_finite"] = bad
    sys.stdout.write(json.dumps(clean, default=str, allow_nan=False) + "\n")
    sys.stdout.flush()


def _finite(obj: Any, where: str, bad: list[str]) -> Any:
    """`obj` with every NaN / Inf float (in dicts, lists, tuples) replaced by None; their paths appended to `bad`."""
    if isinstance(obj, float) and not math.isfinite(obj):
        bad.append(where or "value")
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, f"{where}.{k}" if where else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v, f"{where}[{i}]", bad) for i, v in enumerate(obj)]
    return obj


class TokenStream:
    """Writes generated text as it comes. It decodes the ids since the last newline and
    writes the new suffix, holding back an incomplete UTF-8 sequence, so characters split
    over tokens and SentencePiece word starts come out right (as transformers' TextStreamer)."""

    def __init__(self, engine: Engine, out: TextIO) -> None:
        self.engine, self.out = engine, out
        self.ids: list[int] = []  # since the last newline written
        self.written = 0  # characters of decode(self.ids) already written

    def __call__(self, token_id: int, _text: str) -> None:
        self.ids.append(token_id)
        text = self._decode()
        if text.endswith("\ufffd"):
            return
        self._write(text)
        if text.endswith("\n"):
            self.ids, self.written = [], 0

    def finish(self) -> None:
        self._write(self._decode())
        self.out.write("\n")
        self.out.flush()

    def _decode(self) -> str:
        return str(self.engine.tokenizer.decode(self.ids, skip_special_tokens=True)) if self.ids else ""

    def _write(self, text: str) -> None:
        if len(text) > self.written:
            self.out.write(text[self.written :])
            self.out.flush()
            self.written = len(text)
