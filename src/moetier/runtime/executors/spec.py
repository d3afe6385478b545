"""How an executor variant is declared and built (runtime/wire.py reads these): its name, the store
capabilities it needs (each with the refusal a user gets when the store lacks it), the config checks and
the preparation done before any pool is allocated, and `build`, which makes each MoE layer's scheduler
and executor for a loaded model.

Invariants: a spec's `check` and `prepare` run before the store allocates anything, so a refusal costs no
memory; `build` returns one (scheduler, executor) per MoE layer of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from moetier.config import EngineConfig
from moetier.models.families import Family
from moetier.runtime.executors.base import Executor, LayerScheduler, RoutedExecutor
from moetier.runtime.loader import LoadedModel, Skeleton
from moetier.runtime.pricing import Pricing


class ExecutorState(Protocol):
    """What the engine keeps of an executor variant across the model's layers."""

    stats_key: str  # the key of stats() in Engine.stats()

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BuildContext:
    """What an executor variant is built from: the loaded model, its config, what `prepare` returned
    (before any pool was allocated) and the engine's pricing (when prefetch or hybrid execution is on)."""

    loaded: LoadedModel
    config: EngineConfig
    prepared: Any = None
    pricing: Pricing | None = None


@dataclass(frozen=True)
class Built:
    """One executor variant built for a model: each MoE layer's (scheduler, executor), the variant's state."""

    layers: Mapping[int, tuple[LayerScheduler, Executor]]
    state: ExecutorState | None = None
    routed: Mapping[int, RoutedExecutor] = field(default_factory=dict)  # layers whose executor takes routing as is


def _no_check(config: EngineConfig, family: Family) -> None:
    return None


def _nothing(config: EngineConfig, skeleton: Skeleton) -> Any:
    return None


@dataclass(frozen=True)
class ExecutorSpec:
    """One executor variant, as the wiring sees it (runtime/wire.py)."""

    name: str
    build: Callable[[BuildContext], Built]
    needs: Mapping[str, str] = field(default_factory=dict)  # store capability -> refusal when it is missing
    check: Callable[[EngineConfig, Family], None] = _no_check  # config refusals, before any pool is allocated
    prepare: Callable[[EngineConfig, Skeleton], Any] = _nothing  # before any pool is allocated (e.g. a table)
    needs_pricing: bool = False

__all__ = ["BuildContext", "Built", "ExecutorSpec", "ExecutorState"]
