"""Plain data shared by the pipeline (route -> plan -> move -> compute -> combine).

Torch-free on purpose: policies and the simulator import these and nothing heavier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer. `layer` is the decoder-layer index."""

    layer: int
    expert: int


class Tier(StrEnum):
    """Where expert bytes live, fastest first."""

    ACCEL = "accel"
    HOST = "host"
    DISK = "disk"


class Layout(StrEnum):
    """How an expert's weights lie in host DRAM (TriMoE 4.3): across every DIMM (full host bandwidth
    for CPU / GPU reads), or on one DIMM (needed for near-data processing on that DIMM)."""

    STRIPED = "striped"
    LOCALISED = "localised"


class Precision(StrEnum):
    FULL = "full"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"


class Domain(StrEnum):
    """Where an expert is computed."""

    ACCEL = "accel"
    HOST = "host"
    NDP = "ndp"


@dataclass(frozen=True)
class RoutingStep:
    """The router's decision for one MoE layer call: top-k ids and weights per token."""

    layer: int
    experts: tuple[tuple[int, ...], ...]  # [T][k]
    weights: tuple[tuple[float, ...], ...]  # [T][k]


@dataclass(frozen=True)
class ExpertTask:
    """One expert's work in one layer call."""

    key: ExpertKey
    tokens: int
    precision: Precision = Precision.FULL
    sparsity: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Ordered tasks and the domain each runs in."""

    tasks: tuple[ExpertTask, ...]
    domains: tuple[Domain, ...]

    def __post_init__(self) -> None:
        if len(self.tasks) != len(self.domains):
            raise ValueError(f"Plan has {len(self.tasks)} tasks but {len(self.domains)} domains")


class MoveKind(StrEnum):
    FETCH = "fetch"
    PREFETCH = "prefetch"
    PROMOTE = "promote"
    DEMOTE = "demote"
    RELAYOUT = "relayout"
    EVICT = "evict"


@dataclass(frozen=True)
class Move:
    """A transfer of one expert between tiers."""

    kind: MoveKind
    key: ExpertKey
    src: Tier
    dst: Tier
    precision: Precision = Precision.FULL
    nbytes: int = 0
    meta: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
