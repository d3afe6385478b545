"""Impact-driven prefetching (HybriMoE IV-C): which experts of the next layers to move ahead of time.

Prediction: a predictor gives predicted tokens per expert for the next layers (up to 3 ahead),
which the caller prices with the cost model into ExpertWork lists, cached flags as of now. Both
substrates can run the predictor learning from the routing seen so far (policies/route_history.py):
the engine (runtime/prefetch.py) with `--prefetch-predictor history`, the only one it runs on
transformers' own MoE blocks (the experts seam), and the simulator by default. The engine's default,
"gate" (HybriMoE IV-C), applies the next layers' routers to the current hidden state and counts their
top-k ids; the simulator has no hidden states and may instead degrade the trace's future routing
(sim/predict.py, an option). `predicted_counts` / `predicted_layers` do the same top-k count from
score arrays [T, E], but neither the engine nor the simulator calls them.

Choice (`choose_prefetch`): the gain of prefetching an uncached expert is how much caching it
shortens its layer's simulated makespan under the scheduler in use; greedy by gain per second of
link time, until no candidate shortens a makespan, the link budget (seconds) cannot fit the next
move, or `max_experts` are chosen. Deterministic: ties go to the larger gain, then the earlier
layer (in the mapping's order), then the earlier position in the layer's work.

Keeping it cheap (a few milliseconds for 3 layers x 64 experts):
- experts of one layer with identical costs (tokens, fast_s, slow_s, move_s) are interchangeable
  for every scheduler here (they order by load and break ties by position only), so one
  representative per cost signature is evaluated (at decode, usually one per layer);
- per layer only the `max_candidates` heaviest signatures are candidates (the link moves the
  heaviest misses first, so that is where caching saves the most);
- lazy greedy: a pick changes only its own layer's gains; those are marked stale and recomputed
  only when they reach the top of the heap.

`PrefetchStats` counts predictions and prefetches the same way in the engine and the simulator.

Invariants: `choose_prefetch` picks only uncached experts, each at most once, at most `max_experts`,
whose moves together fit `budget_s`; a bad budget or limit is a ConfigError.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moetier.errors import ConfigError
from moetier.policies.schedule_base import ExpertWork, Scheduler
from moetier.types import ExpertKey


def predicted_counts(scores: np.ndarray, top_k: int) -> dict[int, int]:
    """Predicted tokens per expert of one layer from predicted router scores [T, E] (or [E] for one token):
    each token's top-k experts (ties to the lower id); experts with no token are left out."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1:
        s = s[None, :]  # [1, E]
    if s.ndim != 2 or s.shape[1] == 0:
        raise ConfigError(f"predicted scores must be [T, E] or [E], got shape {np.shape(scores)}")
    if not 1 <= top_k <= s.shape[1]:
        raise ConfigError(f"top_k must be in 1..{s.shape[1]} (the number of experts), got {top_k}")
    if not np.isfinite(s).all():
        raise ConfigError("predicted scores contain NaN or infinite values")
    top = np.argsort(-s, axis=1, kind="stable")[:, :top_k]  # [T, k]
    counts = np.bincount(top.ravel(), minlength=s.shape[1])  # [E]
    return {int(e): int(counts[e]) for e in np.flatnonzero(counts)}


def predicted_layers(scores: Mapping[int, np.ndarray], top_k: int) -> dict[int, dict[int, int]]:
    """`predicted_counts` for each predicted layer (layer -> scores [T, E])."""
    return {layer: predicted_counts(s, top_k) for layer, s in scores.items()}


def _makespan(scheduler: Scheduler, work: Sequence[ExpertWork]) -> float:
    return scheduler.schedule(work).makespan


def _candidates(work: Sequence[ExpertWork], limit: int) -> list[int]:
    """Positions of one uncached expert per cost signature, the heaviest `limit` signatures."""
    seen: dict[tuple[int, float, float | None, float], int] = {}
    for i, w in enumerate(work):
        if not w.cached and w.key.expert >= 0:
            seen.setdefault((w.tokens, w.fast_s, w.slow_s, w.move_s), i)
    return sorted(seen.values(), key=lambda i: (-work[i].tokens, i))[:limit]


def choose_prefetch(
    layers: Mapping[int, Sequence[ExpertWork]],
    scheduler: Scheduler,
    budget_s: float,
    max_experts: int,
    max_candidates: int = 4,
) -> list[ExpertKey]:
    """The experts to prefetch, in the order chosen (see the module docstring)."""
    # 1. Check the arguments
    if not (isinstance(budget_s, int | float) and math.isfinite(budget_s) and budget_s >= 0):
        raise ConfigError(f"prefetch budget must be a finite number of seconds >= 0, got {budget_s!r}")
    if max_experts < 0 or max_candidates < 1:
        raise ConfigError(
            f"prefetch needs max_experts >= 0 and max_candidates >= 1, got {max_experts}, {max_candidates}"
        )
    if max_experts == 0 or not layers:
        return []
    # 2. Per layer: its work (updated as experts are chosen), makespan, and version (bumped by a pick)
    order = list(layers)
    works = {lay: list(layers[lay]) for lay in order}
    for lay, work in works.items():
        if any(w.key.layer != lay for w in work):
            raise ConfigError(f"prefetch: the work of layer {lay} holds experts of another layer")
    base = {lay: _makespan(scheduler, works[lay]) for lay in order}
    version = dict.fromkeys(order, 0)
    # 3. Initial gains: heap of (-gain per link second, -gain, layer rank, position, version)
    heap: list[tuple[float, float, int, int, int]] = []

    def push(rank: int, i: int) -> None:
        lay = order[rank]
        w = works[lay][i]
        trial = works[lay].copy()
        trial[i] = dataclasses.replace(w, cached=True)
        gain = base[lay] - _makespan(scheduler, trial)
        if gain > 0:
            rate = gain / w.move_s if w.move_s > 0 else math.inf
            heapq.heappush(heap, (-rate, -gain, rank, i, version[lay]))

    for rank, lay in enumerate(order):
        for i in _candidates(works[lay], max_candidates):
            push(rank, i)
    # 4. Lazy greedy: pick the best fresh entry that fits the budget; re-price stale ones
    chosen: list[ExpertKey] = []
    left = float(budget_s)
    while heap and len(chosen) < max_experts:
        _, _, rank, i, ver = heapq.heappop(heap)
        lay = order[rank]
        w = works[lay][i]
        if w.cached or w.move_s > left:
            continue
        if ver != version[lay]:
            push(rank, i)
            continue
        chosen.append(w.key)
        left -= w.move_s
        works[lay][i] = dataclasses.replace(w, cached=True)
        base[lay] = _makespan(scheduler, works[lay])
        version[lay] += 1
        stale = {i2 for _, _, r2, i2, _ in heap if r2 == rank}
        for i2 in _candidates(works[lay], max_candidates):  # the pick may expose a new signature
            if i2 not in stale:
                push(rank, i2)
    return chosen


@dataclass
class PrefetchStats:
    """Prediction and prefetch counters, shared by the engine and the simulator. `predicted` / `correct` count
    the last prediction made for each layer call (the nearest one); `by_distance` counts every prediction by
    how many MoE layers ahead it was made (distance -> [predicted, correct])."""

    predicted: int = 0  # experts predicted ((layer, expert) pairs)
    correct: int = 0  # predicted and then actually routed in that layer call
    issued: int = 0  # prefetches started
    used: int = 0  # prefetched experts accessed before eviction
    by_distance: dict[int, list[int]] = field(default_factory=dict)

    def record_prediction(self, predicted: Collection[ExpertKey], actual: Collection[ExpertKey]) -> None:
        """One layer call's prediction against the experts it actually routed to."""
        pred = set(predicted)
        self.predicted += len(pred)
        self.correct += len(pred & set(actual))

    def record_distance(self, distance: int, predicted: Collection[ExpertKey], actual: Collection[ExpertKey]) -> None:
        """A prediction made `distance` MoE layers ahead, against the call's actual experts."""
        pred = set(predicted)
        row = self.by_distance.setdefault(int(distance), [0, 0])
        row[0] += len(pred)
        row[1] += len(pred & set(actual))

    def as_dict(self) -> dict[str, Any]:
        return {
            "predicted": self.predicted,
            "correct": self.correct,
            "issued": self.issued,
            "used": self.used,
            "accuracy": self.correct / self.predicted if self.predicted else 0.0,
            "used_frac": self.used / self.issued if self.issued else 0.0,
            "accuracy_by_distance": {
                str(d): (c / n if n else 0.0) for d, (n, c) in sorted(self.by_distance.items())
            },
            "predicted_by_distance": {str(d): n for d, (n, _) in sorted(self.by_distance.items())},
        }
