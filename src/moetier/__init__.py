"""moetier: run Mixture-of-Experts language models with tiered, budgeted expert memory."""

from moetier.config import Budgets, CacheConfig, EngineConfig, RuntimeConfig, SamplingConfig, parse_size
from moetier.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    MoetierError,
    TraceError,
    UnknownArchitectureError,
)
from moetier.runtime.engine import Engine, EvalResult, GenerationResult, load

__all__ = [
    "BudgetError", "Budgets", "CacheConfig", "CheckpointError", "ConfigError", "Engine", "EngineConfig",
    "EvalResult", "GenerationResult", "MoetierError", "RuntimeConfig", "SamplingConfig", "TraceError",
    "UnknownArchitectureError", "load", "parse_size",
]  # fmt: skip
__version__ = "0.1.0"
