"""moetier: run Mixture-of-Experts language models with tiered, budgeted expert memory.

Config and errors import eagerly (they are light); the engine (torch, transformers) loads
on first use of `moetier.load` (runtime/wire.py) or `moetier.Engine` (runtime/engine.py), so
`import moetier` and the CLI's --help stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moetier.config import (
    Budgets,
    CacheConfig,
    EngineConfig,
    PrecisionConfig,
    RoutingConfig,
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
    from moetier.runtime.engine import Engine, EvalResult, GenerationResult
    from moetier.runtime.wire import load

_LAZY = {"Engine": "engine", "EvalResult": "engine", "GenerationResult": "engine", "load": "wire"}


def __getattr__(name: str) -> Any:
    """The engine's names, imported on first use (module-level lazy loading, not a cycle: the CLI's --help
    and `import moetier` stay free of torch)."""
    if name in _LAZY:
        module = importlib.import_module(f"moetier.runtime.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'moetier' has no attribute {name!r}")


__all__ = [
    "BudgetError", "Budgets", "CacheConfig", "CheckpointError", "ConfigError", "Engine", "EngineConfig",
    "EvalResult", "GenerationResult", "MoetierError", "PrecisionConfig", "RoutingConfig", "RuntimeConfig",
    "SamplingConfig", "SparsityConfig", "TraceError",
    "UnknownArchitectureError", "load", "parse_size",
]  # fmt: skip
__version__ = "0.1.0"
