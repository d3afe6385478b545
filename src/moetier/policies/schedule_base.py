"""The scheduler protocol: which domain computes each expert of one MoE layer call, and
which experts cross the link first.

A machine has a *fast* domain (the GPU; on a CPU-only machine the CPU computing from host
memory), an optional *slow* domain (the CPU computing from host memory while the GPU is
the fast one) and a *link* that moves an expert's weights to the fast domain's memory
(PCIe host -> GPU; on a CPU-only machine disk -> host). An expert can run on the fast
domain only once its weights are there (`cached`, or after its move on the link).

Schedulers are pure functions of plain data: an `ExpertWork` list whose costs the caller
already priced with the cost model (policies/costmodel.py), and the times at which each
lane becomes free. They return a `Schedule`: a timeline of ops on the three lanes
(`gpu`, `cpu`, `link`; times in seconds from the layer's start), where each expert
computes, which experts were moved (the caller admits them into its cache), and the
makespan. The engine runs the assignment; the simulator replays the timeline; both use
the same decision.

Shared experts are ExpertWork with a negative expert id (-1, -2, ...) and `cached=True`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from moetier.types import Domain, ExpertKey

Lane = Literal["gpu", "cpu", "link"]
LANES: tuple[Lane, ...] = ("gpu", "cpu", "link")


@dataclass(frozen=True)
class ExpertWork:
    """One expert's work in one layer call, priced for this machine."""

    key: ExpertKey
    tokens: int  # tokens routed to it in this call (> 0)
    cached: bool  # weights already in the fast domain's memory
    fast_s: float  # compute time on the fast domain for `tokens`
    slow_s: float | None  # compute time on the slow domain; None: no slow domain
    move_s: float  # time to move its weights over the link
    nbytes: int = 0  # bytes a move carries


@dataclass(frozen=True)
class Op:
    lane: Lane
    key: ExpertKey
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    domains: Mapping[ExpertKey, Domain]  # Domain.ACCEL (fast) or Domain.HOST (slow) per expert
    moved: tuple[ExpertKey, ...]  # moved over the link in this call, in link order
    makespan: float  # end of the last compute op (seconds from the layer's start)

    def busy(self, lane: Lane) -> float:
        """Seconds the lane is occupied in this schedule."""
        return sum(op.end - op.start for op in self.ops if op.lane == lane)


class Scheduler(Protocol):
    """One file per variant in policies/, looked up by name in policies.schedulers.SCHEDULERS."""

    name: str
    # True: experts moved by a schedule are admitted into the fast tier's cache (dynamic);
    # False: the fast tier keeps the placement it started with (static mappings).
    admits: bool

    def schedule(self, work: Sequence[ExpertWork], ready: Mapping[Lane, float] | None = None) -> Schedule:
        """`ready`: when each lane is free (e.g. the link is busy with a prefetch), default 0."""
        ...
