"""The simulated machine: a simpy clock, the lanes that do work (fast domain, slow domain, link),
and the replay of one MoE layer call's `Plan` onto them.

Lanes, named by what they are: the fast domain (`gpu`, or `cpu` on a CPU-only machine), the
slow domain (`cpu`, absent on a CPU-only machine) and the link that fills the fast tier
(`pcie`, or `disk` on a CPU-only machine). A schedule's lanes (`gpu`/`cpu`/`link`, see
policies/schedule_base.py) map onto them through `MachineShape`.

Invariants:
- The forward pass owns the compute lanes: it runs one layer at a time, so the fast and slow
  lanes never contend and their ops replay analytically (no simpy process per op).
- The link is a simpy `PriorityResource` shared by the forward pass's demand moves (priority 0)
  and background prefetches (priority 1). Neither preempts: a prefetch already on the link
  delays a demand move, and the scheduler is told so through `link_ready()`.
- A compute op on the fast lane whose expert is still on the link (a demand move of the same
  call, or a prefetch in flight) starts no earlier than its arrival.
- Busy seconds and bytes are counted when the work is done; `ops` keeps only the timeline window.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import simpy

from moetier.errors import ConfigError
from moetier.types import ExpertKey, Lane, Op, Plan

SimGen = Generator[simpy.Event, Any, Any]


@dataclass(frozen=True)
class MachineShape:
    """Which hardware plays fast domain, slow domain and link."""

    fast: str  # "gpu" | "cpu"
    slow: str | None  # "cpu" | None
    link: str  # "pcie" | "disk"

    @classmethod
    def from_profile(cls, profile: Any) -> MachineShape:
        """GPU machine: gpu / cpu / pcie. CPU-only machine (profile.gpu is None): cpu / - / disk."""
        if profile.gpu is None:
            return cls(fast="cpu", slow=None, link="disk")
        if profile.pcie is None:
            raise ConfigError(f"profile {profile.name!r} has a GPU but no pcie link")
        return cls(fast="gpu", slow="cpu", link="pcie")

    def lane_name(self, lane: Lane) -> str:
        if lane == "gpu":
            return self.fast
        if lane == "cpu":
            if self.slow is None:
                raise ConfigError("the schedule put work on the slow domain, but this machine has none")
            return self.slow
        return self.link

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.fast, self.slow, self.link) if n is not None)


@dataclass(frozen=True)
class TimelineOp:
    """One bar of the Gantt chart (absolute seconds)."""

    lane: str  # "gpu" | "cpu" | "pcie" | "disk"
    kind: str  # "dense" | "expert" | "shared" | "move" | "prefetch"
    label: str
    start: float
    end: float
    step: int
    layer: int


@dataclass(frozen=True)
class PrefetchItem:
    key: ExpertKey
    move_s: float
    nbytes: int
    call: int  # index of the layer call it is meant for
    fill: bool = False  # a background fill of a miss (no call in view), not a prefetch


class Machine:
    """Lanes on a simpy clock plus their accounting (busy seconds, bytes, timeline window)."""

    def __init__(self, shape: MachineShape, window: Callable[[int, int], bool] | None = None) -> None:
        self.shape = shape
        self.env = simpy.Environment()
        self.link = simpy.PriorityResource(self.env, capacity=1)
        self.busy: dict[str, float] = dict.fromkeys(shape.names, 0.0)
        self.link_bytes = 0
        self.moves = {"demand": 0, "prefetch": 0, "fill": 0}
        self.link_until = 0.0  # when the op now holding the link ends
        self.pending: dict[ExpertKey, simpy.Event] = {}  # experts on the link -> arrival event
        self.ops: list[TimelineOp] = []
        self._window = window
        self.step = 0
        self.layer = 0

    @property
    def now(self) -> float:
        return float(self.env.now)

    def link_ready(self) -> float:
        """Seconds from now until the link is free of the op holding it (0 when idle)."""
        return max(0.0, self.link_until - self.now) if self.link.count else 0.0

    def record(self, lane: str, kind: str, label: str, start: float, end: float) -> None:
        if self._window is not None and self._window(self.step, self.layer):
            self.ops.append(TimelineOp(lane, kind, label, start, end, self.step, self.layer))

    # 1. Work the forward pass does alone -------------------------------------------------------------------------
    def compute(self, lane: str, seconds: float, kind: str, label: str) -> SimGen:
        """Occupy a compute lane for `seconds` (dense work, no contention)."""
        t0 = self.now
        self.busy[lane] += seconds
        yield self.env.timeout(seconds)
        self.record(lane, kind, label, t0, self.now)

    # 2. One layer call's schedule --------------------------------------------------------------------------------
    def replay(
        self,
        sched: Plan,
        nbytes: dict[ExpertKey, int],
        then: Callable[[], None] | None = None,
        inflight: Collection[ExpertKey] = (),
    ) -> SimGen:
        """Run `sched` from now: demand moves on the link (a simpy process), compute lanes analytically.
        `then` runs once the demand moves are queued (prefetches queue behind them). A demand move of
        an expert in `inflight` (a prefetch on the link when the call was scheduled) is not repeated:
        that prefetch has arrived by the time the demand moves get the link. Returns (as the
        generator's value) the seconds the layer call took."""
        t0 = self.now
        link_ops = [op for op in sched.ops if op.lane == "link"]
        fast_ops = sorted((op for op in sched.ops if op.lane == "gpu"), key=lambda o: o.start)
        slow_ops = [op for op in sched.ops if op.lane == "cpu"]
        # 1. demand moves: one process holds the link for the call's moves, in the schedule's order
        arrivals: dict[ExpertKey, simpy.Event] = {}
        if link_ops:
            for op in link_ops:
                arrivals[op.key] = self.env.event()
            self.env.process(self._demand(sorted(link_ops, key=lambda o: o.start), t0, arrivals, nbytes, set(inflight)))
        if then is not None:
            then()
        # 2. slow lane: never waits for anything, its ops run back to back; the plan's CPU ready time (the profile's
        # first_expert_s, HybriMoE Fig. 3e; 0 by default) is CPU work added to its first op
        slow_name = self.shape.lane_name("cpu") if slow_ops else ""
        slow_end = t0
        for n, op in enumerate(sorted(slow_ops, key=lambda o: o.start)):
            d = op.end - op.start + (op.start if n == 0 else 0.0)  # the first op also pays the lane's ready offset
            self.record(slow_name, _kind(op.key), _label(op.key), slow_end, slow_end + d)
            slow_end += d
            self.busy[slow_name] += d
        # 3. fast lane: in order; an expert still on the link is waited for
        t = t0
        fast = self.shape.fast
        for op in fast_ops:
            ev = arrivals.get(op.key) or self.pending.get(op.key)
            if ev is not None and not ev.processed:
                if t > self.now:
                    yield self.env.timeout(t - self.now)
                yield ev
                t = max(t, self.now)
            d = op.end - op.start
            self.record(fast, _kind(op.key), _label(op.key), t, t + d)
            self.busy[fast] += d
            t += d
        end = max(t, slow_end)
        if end > self.now:
            yield self.env.timeout(end - self.now)
        return end - t0

    def _demand(
        self,
        ops: Sequence[Op],
        t0: float,
        arrivals: dict[ExpertKey, simpy.Event],
        nbytes: dict[ExpertKey, int],
        inflight: set[ExpertKey],
    ) -> SimGen:
        with self.link.request(priority=0) as req:
            yield req
            for op in ops:
                if op.key in inflight:  # its prefetch held the link before us: already there
                    arrivals[op.key].succeed()
                    continue
                gap = t0 + op.start - self.now
                if gap > 0:
                    yield self.env.timeout(gap)
                d = op.end - op.start
                start = self.now
                self.link_until = start + d
                yield self.env.timeout(d)
                self._moved(op.key, nbytes.get(op.key, 0), d, "demand")
                self.record(self.shape.link, "move", _label(op.key), start, self.now)
                arrivals[op.key].succeed()

    # 3. Background prefetches ------------------------------------------------------------------------------------
    def prefetch(
        self,
        items: Sequence[PrefetchItem],
        valid: Callable[[PrefetchItem], bool],
        arrived: Callable[[PrefetchItem], None],
    ) -> None:
        """Start a background process moving `items` one by one at low priority. An item still
        `valid` when it gets the link is moved and `arrived` is called on arrival."""
        self.env.process(self._prefetch(items, valid, arrived))

    def _prefetch(
        self,
        items: Sequence[PrefetchItem],
        valid: Callable[[PrefetchItem], bool],
        arrived: Callable[[PrefetchItem], None],
    ) -> SimGen:
        for item in items:
            with self.link.request(priority=1) as req:
                yield req
                if not valid(item) or item.key in self.pending:
                    continue
                ev = self.env.event()
                self.pending[item.key] = ev
                start = self.now
                self.link_until = start + item.move_s
                yield self.env.timeout(item.move_s)
                del self.pending[item.key]
                kind = "fill" if item.fill else "prefetch"
                self._moved(item.key, item.nbytes, item.move_s, kind)
                self.record(self.shape.link, kind, f"L{item.key.layer}:{_label(item.key)}", start, self.now)
                ev.succeed()
                arrived(item)

    def _moved(self, key: ExpertKey, nbytes: int, seconds: float, kind: str) -> None:
        self.busy[self.shape.link] += seconds
        self.link_bytes += nbytes
        self.moves[kind] += 1


def _kind(key: ExpertKey) -> str:
    return "shared" if key.expert < 0 else "expert"


def _label(key: ExpertKey) -> str:
    return f"S{-key.expert}" if key.expert < 0 else f"E{key.expert}"
