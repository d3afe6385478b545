"""moetier: run Mixture-of-Experts language models with tiered, budgeted expert memory.

Config and errors import eagerly (they are light); the engine (torch, transformers) loads
on first use of `moetier.load` or `moetier.Engine`, so `import moetier` and the CLI's
--help stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetier.config import (
    Budgets,
    CacheConfig,
    EngineConfig,
    PrecisionConfig,
    RuntimeConfig,
    SamplingConfig,
    SparsityConfig,
    parse_size,
)
from moetier.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    MoetierError,
    TraceError,
    UnknownArchitectureError,
)

if TYPE_CHECKING:
    from moetier.runtime.engine import Engine, EvalResult, GenerationResult, load

_LAZY = {"Engine", "EvalResult", "GenerationResult", "load"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from moetier.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'moetier' has no attribute {name!r}")


__all__ = [
    "BudgetError", "Budgets", "CacheConfig", "CheckpointError", "ConfigError", "Engine", "EngineConfig",
    "EvalResult", "GenerationResult", "MoetierError", "PrecisionConfig", "RuntimeConfig", "SamplingConfig",
    "SparsityConfig", "TraceError",
    "UnknownArchitectureError", "load", "parse_size",
]  # fmt: skip
__version__ = "0.1.0"
