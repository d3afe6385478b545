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
