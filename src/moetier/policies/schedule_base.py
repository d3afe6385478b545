"""The scheduler protocol: which domain computes each expert of one MoE layer call, and
which experts cross the link first.

A machine has a *fast* domain (the GPU; on a CPU-only machine the CPU computing from host
memory), an optional *slow* domain (the CPU computing from host memory while the GPU is
the fast one) and a *link* that moves an expert's weights to the fast domain's memory
(PCIe host -> GPU; on a CPU-only machine disk -> host). An expert can run on the fast
domain only once its weights are there (`cached`, or after its move on the link).

Schedulers are pure functions of plain data: an `ExpertWork` list whose costs the caller
already priced with the cost model (policies/costmodel.py), and the times at which each
lane becomes free. They return a `Plan`: a timeline of ops on the three lanes
(`gpu`, `cpu`, `link`; times in seconds from the layer's start), where each expert
computes, which experts were moved (the caller admits them into its cache when the
scheduler `admits`), and the makespan. The engine runs the assignment; the simulator
replays the timeline; both use the same decision.

Shared experts are ExpertWork with a negative expert id (-1, -2, ...) and `cached=True`.

Invariants every scheduler keeps (tests/policies/test_schedulers.py checks them):
- every expert of the call is computed exactly once, on `gpu` or `cpu`;
- an uncached expert computes on `gpu` only after its `link` op ends; cached ones never move;
- no lane runs two ops at once, and no op starts before the lane's `ready` time;
- `makespan` is the end of the last compute op (0 for an empty call);
- with no slow domain (`slow_s` None) nothing runs on `cpu`: every miss is moved.

`ExpertWork` checks its own fields on construction, so a scheduler only checks what spans the
list (`check_work`: unique keys, slow_s given for all or none), which keeps planning cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from moetier.types import LANES, Domain, ExpertKey, ExpertTask, Lane, Op, Plan


def finite_time(v: object) -> bool:
    """A usable duration: a real number (not bool), finite and >= 0."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


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

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"ExpertWork {tuple(self.key)}: tokens must be an int > 0, got {self.tokens!r}")
        for name in ("fast_s", "move_s") + (("slow_s",) if self.slow_s is not None else ()):
            if not finite_time(getattr(self, name)):
                raise ValueError(
                    f"ExpertWork {tuple(self.key)}: {name} must be finite and >= 0, got {getattr(self, name)!r}"
                )
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"ExpertWork {tuple(self.key)}: nbytes must be an int >= 0, got {self.nbytes!r}")


class Scheduler(Protocol):
    """One file per variant in policies/, looked up by name in policies.schedulers.SCHEDULERS.

    Besides `schedule`, a scheduler names how its user sets up the fast tier:
    - `admits`: True: experts moved by a schedule are admitted into the fast tier's cache
      (dynamic); False: the fast tier keeps the placement it started with (static mappings;
      a moved expert is used for this call only);
    - `placement`: the initial fast-tier placement, a key of policies.placement.PLACEMENTS:
      "frequency" (hottest experts of a warm-up window) or "layers" (whole layers, llama.cpp);
    - `cache_policy`: the default eviction policy name (policies.CACHE_POLICIES) when the user
      names none; it only decides anything when `admits` (or when prefetches are admitted);
    - `gates`: True when the scheduler drops low-weight routed experts at decode (AdapMoE's adaptive
      gating), which its user applies to the routing before scheduling; the engine refuses it (it would
      change the model's output);
    - `prefill_on_gpu`: True when every prefill expert computes on the GPU, misses streamed over the
      link and never admitted (kTransformers' layer-wise prefill); its user plans prefill calls with
      `moved_timeline` instead of `schedule`;
    - `cache_alloc`: how the fast tier's slots are split over the MoE layers when the user names no split:
      "global" (one cache, layers compete for slots) or "dp" (AdapMoE's per-layer sizes,
      policies/cache_alloc.py).
    """

    name: str
    admits: bool
    placement: str
    cache_policy: str
    gates: bool
    prefill_on_gpu: bool
    cache_alloc: str

    def schedule(self, work: Sequence[ExpertWork], ready: Mapping[Lane, float] | None = None) -> Plan:
        """`ready`: when each lane is free (e.g. the link is busy with a prefetch), default 0."""
        ...


# Helpers shared by the schedulers ---------------------------------------------------------------------------------
def lane_ready(ready: Mapping[Lane, float] | None) -> tuple[float, float, float]:
    """(gpu, cpu, link) free times; ValueError for an unknown lane or a time that is not finite and >= 0."""
    if not ready:
        return 0.0, 0.0, 0.0
    for lane, t in ready.items():
        if lane not in LANES:
            raise ValueError(f"ready: unknown lane {lane!r}; lanes are {', '.join(LANES)}")
        if not finite_time(t):
            raise ValueError(f"ready[{lane!r}] must be finite and >= 0, got {t!r}")
    return float(ready.get("gpu", 0.0)), float(ready.get("cpu", 0.0)), float(ready.get("link", 0.0))


def check_work(work: Sequence[ExpertWork]) -> bool:
    """Checks what spans the list; returns True when there is a slow domain (slow_s given)."""
    if len({w.key for w in work}) != len(work):
        seen: set[ExpertKey] = set()
        for w in work:
            if w.key in seen:
                raise ValueError(f"schedule: expert {tuple(w.key)} appears twice in one layer call's work")
            seen.add(w.key)
    n_slow = sum(w.slow_s is not None for w in work)
    if 0 < n_slow < len(work):
        raise ValueError(f"schedule: slow_s must be given for all experts or none ({n_slow} of {len(work)} have it)")
    return n_slow > 0


def timeline(
    work: Sequence[ExpertWork],
    ready: tuple[float, float, float],
    fast: Sequence[int],
    moved: Sequence[int],
    slow: Sequence[int],
) -> Plan:
    """The schedule of a fixed assignment (indices into `work`): the link moves `moved` back to back in
    that order; the fast lane computes `fast` (cached experts) in that order, then each moved expert in
    arrival order (never before it arrives); the slow lane computes `slow` back to back in that order."""
    tg, tc, tl = ready
    ops: list[Op] = []
    domains: dict[ExpertKey, Domain] = {}
    end = 0.0
    for i in fast:
        w = work[i]
        ops.append(Op("gpu", w.key, tg, tg + w.fast_s))
        tg += w.fast_s
        domains[w.key] = Domain.ACCEL
        end = max(end, tg)
    for i in moved:
        w = work[i]
        ops.append(Op("link", w.key, tl, tl + w.move_s))
        tl += w.move_s
        tg = max(tg, tl)
        ops.append(Op("gpu", w.key, tg, tg + w.fast_s))
        tg += w.fast_s
        domains[w.key] = Domain.ACCEL
        end = max(end, tg)
    for i in slow:
        w = work[i]
        if w.slow_s is None:
            raise ValueError(f"schedule: expert {tuple(w.key)} assigned to the slow domain, but there is none")
        ops.append(Op("cpu", w.key, tc, tc + w.slow_s))
        tc += w.slow_s
        domains[w.key] = Domain.HOST
        end = max(end, tc)
    tasks = tuple(ExpertTask(work[i].key, work[i].tokens) for i in (*fast, *moved, *slow))
    return Plan(tasks, domains, tuple(work[i].key for i in moved), end, tuple(ops))


def by_load(work: Sequence[ExpertWork], idx: Sequence[int], descending: bool) -> list[int]:
    """Indices ordered by token load; ties in work order either way (deterministic)."""
    if descending:
        return sorted(idx, key=lambda i: (-work[i].tokens, i))
    return sorted(idx, key=lambda i: (work[i].tokens, i))


def moved_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
    """Cached experts on the fast lane (high load first), every miss moved (high load first) then computed there.
    What every scheduler degrades to without a slow domain (a CPU-only machine: the "link" is the disk and
    there is nowhere else to compute a miss)."""
    hits = by_load(work, [i for i, w in enumerate(work) if w.cached], descending=True)
    misses = by_load(work, [i for i, w in enumerate(work) if not w.cached], descending=True)
    return timeline(work, ready, hits, misses, ())


class LayerScheduler:
    """The `schedule` every variant shares: read the lanes' ready times, check the call, and without a slow
    domain fall back to `moved_timeline`; otherwise `plan` (the variant's own decision) decides."""

    gates = False  # AdapMoE's variant overrides it
    prefill_on_gpu = False  # kTransformers' variant overrides it
    cache_alloc = "global"  # AdapMoE's variant overrides it

    def schedule(self, work: Sequence[ExpertWork], ready: Mapping[Lane, float] | None = None) -> Plan:
        t0 = lane_ready(ready)
        if not check_work(work):
            return moved_timeline(work, t0)
        return self.plan(work, t0)

    def plan(self, work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
        """The schedule of a checked call with a slow domain; `ready` is (gpu, cpu, link) free times."""
        raise NotImplementedError
