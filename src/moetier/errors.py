"""Typed errors. Every message names the file, tensor or number at fault.

The CLI turns any `MoetierError` into a one-line message and a non-zero exit; the
Python API lets them propagate so callers can catch them by type.
"""

from __future__ import annotations


class MoetierError(Exception):
    """Base class of every error moetier raises on purpose."""


class ConfigError(MoetierError, ValueError):
    """A flag or config value is invalid (an unparseable size, an unknown policy name)."""


class UnknownArchitectureError(MoetierError):
    """The checkpoint's architecture has no row in the family table."""


class CheckpointError(MoetierError):
    """The checkpoint folder is incomplete, corrupt, or disagrees with its config."""


class BudgetError(MoetierError):
    """A memory budget is too small to hold what must be resident."""


class TraceError(MoetierError):
    """A trace file is missing, malformed, or of another schema."""


class ExpertReadError(CheckpointError):
    """Reading one expert's bytes failed (EIO, a file truncated or replaced under a running engine).

    `key` is the expert (layer, expert), `path` the file, `rows` the flattened token rows of the MoE
    call that routed to it (row r of an input [B, T, H] is b * T + t), so a caller batching several
    sequences can fail only the ones that needed this expert. Nothing half-written stays registered."""

    def __init__(self, message: str, key: object = None, path: str | None = None, rows: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.key, self.path, self.rows = key, path, rows


class NumericalError(MoetierError):
    """The model produced non-finite values (NaN or Inf): a damaged weight, named where it can be found.

    `rows` are the rows of the step's logits that are not finite (empty when not attributable) and
    `logits` the step's whole output (the finite rows are valid: the forward ran to its end)."""

    def __init__(self, message: str, rows: tuple[int, ...] = (), logits: object = None) -> None:
        super().__init__(message)
        self.rows, self.logits = rows, logits
