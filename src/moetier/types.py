"""Plain data shared by the pipeline (route -> plan -> move -> compute -> combine).

Torch-free on purpose: policies and the simulator import these and nothing heavier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Literal, NamedTuple


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
    STORED = "stored"  # as the checkpoint stores it (FP8, MXFP4, GPTQ ...), dequantised per call; no fixed bits
    # ggml's block formats, written by `moetier quantize` with ggml's own quantiser (formats/quant_ggml.py)
    Q6_K = "q6_k"
    Q5_K = "q5_k"
    Q4_K = "q4_k"
    IQ4_XS = "iq4_xs"
    Q3_K = "q3_k"
    Q2_K = "q2_k"


# Bits per stored weight of each precision, highest first: the one table (config, hwprofile, specs). "full" is a
# 16-bit weight (bf16 / fp16); byte counts of a full-precision expert use the model's own dtype, not this 16.
PRECISION_BITS: Mapping[str, int] = MappingProxyType({
    Precision.FULL.value: 16, Precision.INT8.value: 8, Precision.INT4.value: 4, Precision.INT2.value: 2,
})  # fmt: skip

# The ggml block precisions: precision -> (GGUF type name, bits a weight including the block scales, the integer
# precision the cost model prices it as). The bits are the type's block bytes * 8 / values a block (gguf's
# GGML_QUANT_SIZES; a test holds them to it); a matrix whose rows are not whole super-blocks of 256 takes
# llama-quantize's fallback type (formats/quant_ggml.py), so its expert's bits may differ.
GGML_PRECISIONS: Mapping[str, tuple[str, float, str]] = MappingProxyType({
    Precision.Q6_K.value: ("Q6_K", 6.5625, "int8"), Precision.Q5_K.value: ("Q5_K", 5.5, "int8"),
    Precision.Q4_K.value: ("Q4_K", 4.5, "int4"), Precision.IQ4_XS.value: ("IQ4_XS", 4.25, "int4"),
    Precision.Q3_K.value: ("Q3_K", 3.4375, "int4"), Precision.Q2_K.value: ("Q2_K", 2.625, "int2"),
})  # fmt: skip


def precision_bits(precision: str) -> float | None:
    """Bits a weight of `precision` (full: 16), None for "stored" (the checkpoint's) or an unknown name."""
    if precision in PRECISION_BITS:
        return float(PRECISION_BITS[precision])
    gg = GGML_PRECISIONS.get(precision)
    return gg[1] if gg is not None else None


def priced_as(precision: str) -> str:
    """The precision of PRECISION_BITS the cost model prices `precision` as (a ggml block precision: the integer
    precision of its kernel class; any other name: itself)."""
    gg = GGML_PRECISIONS.get(precision)
    return gg[2] if gg is not None else precision


class Domain(StrEnum):
    """Where an expert is computed."""

    ACCEL = "accel"
    HOST = "host"
    NDP = "ndp"


Lane = Literal["gpu", "cpu", "link"]  # a timeline lane: fast domain, slow domain, the link between tiers
LANES: tuple[Lane, ...] = ("gpu", "cpu", "link")


class Op(NamedTuple):
    """One op on a lane of a layer call's timeline, seconds from the call's start (a NamedTuple, not a
    dataclass: a 64-expert prefill builds about 100 per call)."""

    lane: Lane
    key: ExpertKey
    start: float
    end: float


@dataclass(frozen=True)
class ExpertTask:
    """One expert's work in one layer call: tokens routed to it, and the neuron sparsity it runs with."""

    key: ExpertKey
    tokens: int
    sparsity: float = 0.0


@dataclass(frozen=True)
class Plan:
    """What every scheduler returns for one MoE layer call (step 2 of the pipeline), two- and three-domain,
    engine and simulator alike: the tasks in run order and the domain computing each expert, the experts
    whose weights cross the link for this call (in link order), and, where the scheduler priced the call,
    the predicted makespan (seconds) and the timeline it priced (`ops`; the simulator replays it)."""

    tasks: tuple[ExpertTask, ...]
    domains: Mapping[ExpertKey, Domain]  # the domain computing each task's expert
    moved: tuple[ExpertKey, ...] = ()
    makespan: float = 0.0
    ops: tuple[Op, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tasks) != len(self.domains) or any(t.key not in self.domains for t in self.tasks):
            raise ValueError(f"Plan: {len(self.tasks)} tasks but domains for {len(self.domains)} other experts")

    def on(self, domain: Domain) -> tuple[ExpertTask, ...]:
        """The tasks `domain` runs, in plan order."""
        return tuple(t for t in self.tasks if self.domains[t.key] is domain)

    def busy(self, lane: Lane) -> float:
        """Seconds `lane` is occupied in the timeline."""
        return sum(op.end - op.start for op in self.ops if op.lane == lane)


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
