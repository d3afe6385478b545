"""Route observers: what sees a MoE layer call's routing before any of its experts is touched.

Every TieredMoE call hands one `Route` (the layer, its input x [T, H], the top-k ids and weights
[T, k] and the router logits [T, E]) to the model's `ObserverList`, in order, before it plans.
The observers are the trace recorder (`TraceObserver`), the precision controller
(runtime/precision.py Switching), score-aware caching (`CacheScores`, MRS) and the cross-layer
prefetcher (runtime/prefetch.py Prefetcher); tests and benchmarks add a `Tap`.

Invariants:
- one list per model, shared by its blocks, ordered by `Stage`: recorders first, then cache
  scores, then the prefetcher (a later `add` of a stage goes after the ones already there), so
  cache scores reach the store, and prefetches are issued, after every recorder saw the call
  and before the call's first expert access;
- router probabilities are computed by `router_probs` only (softmax or sigmoid per
  family.scoring), at most once per call (`Route.probs`), whatever the observers;
- an observer never changes the call's result: it reads the route, it does not write it;
- the route is the one the experts compute, after the model's routing override (runtime/route_override.py): a
  pair it skipped has id -1 and weight 0, and a followed trace's route has no logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from enum import IntEnum
from typing import Protocol

import torch

from moetier.store.store import ExpertStore
from moetier.traces import TraceRecorder


def router_probs(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """logits [T, E] -> router probabilities [T, E] in float32: sigmoid or softmax per family.scoring."""
    x = logits.float()
    return torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)


class Route:
    """One MoE layer call's routing, as the observers see it."""

    def __init__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor | None,
        scoring: str, num_experts: int = 0,
    ) -> None:  # fmt: skip
        self.layer = layer
        self.x = x  # [T, H] the block's input
        self.ids = ids  # [T, k] top-k expert ids
        self.weights = weights  # [T, k] their gate weights
        self.logits = logits  # [T, E] router logits; None through the seam (the family's router is its own code)
        self.scoring = scoring  # family.scoring: "softmax" | "sigmoid"
        self.num_experts = num_experts  # E, for `probs` without logits

    @functools.cached_property
    def probs(self) -> torch.Tensor:
        """Router probabilities [T, E] (float32), computed on first use. Without logits (the seam), the top-k
        gate weights scattered into zeros: the probability mass the family's router gave the chosen experts."""
        if self.logits is None:
            probs = torch.zeros((self.ids.shape[0], self.num_experts), dtype=torch.float32, device=self.ids.device)
            ids, w = self.ids.long(), self.weights.float()
            if bool((ids < 0).any()):  # -1: a pair a routing override skipped (weight 0), no expert's
                return probs.scatter_add_(1, ids.clamp(min=0), w * (ids >= 0))  # [T, E]
            return probs.scatter_(1, ids, w)  # [T, E]
        return router_probs(self.logits, self.scoring)


class Stage(IntEnum):
    """Where in the list an observer runs."""

    RECORD = 0  # trace recorder, precision controller, taps: read-only bookkeeping
    SCORE = 1  # router scores to the cache policy
    PREFETCH = 2  # the prefetcher: issues loads for the next layers


class RouteObserver(Protocol):
    stage: Stage

    def observe(self, route: Route) -> None: ...


class ObserverList:
    """The model's route observers in run order (see the module docstring)."""

    def __init__(self) -> None:
        self._items: list[RouteObserver] = []

    def add(self, obs: RouteObserver) -> None:
        """Insert `obs` after every observer of its stage or an earlier one."""
        at = sum(1 for o in self._items if o.stage <= obs.stage)
        self._items.insert(at, obs)

    def __iter__(self) -> Iterator[RouteObserver]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


class TraceObserver:
    """Records every layer call's routing (and, with scores, its router probabilities) into a TraceRecorder; the
    engine owns the recorder's forward boundaries (Engine.step: `begin`, and `rollback` when a forward fails)."""

    stage = Stage.RECORD

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder = recorder

    def observe(self, route: Route) -> None:
        scores = route.probs.tolist() if self.recorder.with_scores else None  # [T][E]
        self.recorder.record(route.layer, route.ids.tolist(), route.weights.float().tolist(), scores)


class CacheScores:
    """Score-aware caching (MRS): the call's router probabilities, summed over its tokens (float64 [E]),
    to the store's policy before the call's expert accesses."""

    stage = Stage.SCORE

    def __init__(self, store: ExpertStore) -> None:
        self.store = store

    def observe(self, route: Route) -> None:
        self.store.on_route(route.layer, route.probs.sum(0).cpu().double().numpy())  # [E]


class Tap:
    """A plain function of the route, run with the recorders (tests, benchmarks, debugging)."""

    stage = Stage.RECORD

    def __init__(self, fn: Callable[[Route], None]) -> None:
        self.fn = fn

    def observe(self, route: Route) -> None:
        self.fn(route)
