"""Dynamic expert precision (DynaExq): a budget-feasible hot set and Algorithm 1.

`split_budget` is paper section 3.5: every expert stays resident at the cold (low)
precision and as many experts as fit are hot (high precision), so that for the budget B,

    sum_l  n_hot_l * hot + (E_l - n_hot_l) * cold + reserve  <=  B

holds exactly, and one more hot expert would not fit (or every expert is already hot).
The hot slots are spread evenly over the layers (lower layer ids take the remainder),
capped at E_l per layer.

`PrecisionController` is paper section 3.2 / Algorithm 1. It keeps an EMA hotness per
expert, a *target* state per expert (HIGH or LOW: what has been enqueued; the store may
lag behind), and a threshold tau_l per layer. Every `period` tokens, `decide()` picks per
layer H = the top-n_hot experts with score >= tau_l and returns the moves that make the
target equal H: downgrades (HIGH, not in H; coldest first), then upgrades (LOW, in H;
hottest first). tau_l is set once, at warmup, to the n_hot-th largest score of the layer
(paper 3.5: "tau_h = top(n_hot, S_i)") and stays fixed unless `set_threshold` is called.

Invariants:
- a decision leaves at most n_hot_l HIGH targets in layer l; `reset_target` may exceed
  that (a failed demotion, or one `order_switches` drops because no promotion needs its
  slot), and the store's global count of hot slots is what bounds memory;
- a decision never upgrades an expert that is HIGH nor downgrades one that is LOW, and
  no expert appears twice in a decision;
- an expert with score 0 (never routed, or decayed to 0) is never made HIGH;
- with hysteresis h > 0 an incumbent HIGH expert is displaced only by a challenger whose
  score exceeds the incumbent's by the factor (1 + h), and stays eligible while
  score * (1 + h) >= tau; with h = 0 (and lookahead 0) this is Algorithm 1 exactly (ties keep
  the incumbent).

Prediction (paper 3.3, "prefetches experts predicted to become hot"; the paper predicts from
cross-layer correlations, we from the EMA's own trend, a named simplification): the trend of
an expert is its score's change since the last decision per token, d_i = (S_i - S_i^last) / p
(p tokens since then; 0 before the first decision). `predicted_scores(layer, t)` is
max(0, S_i + t * d_i), 0 for an expert whose score is 0. Two uses:
- `predict_upgrades()` between decisions: the LOW experts the next decision would promote if the
  trend held until it (their high-precision bytes can be staged SSD -> DRAM ahead of need);
- `lookahead` L > 0 (periods): `decide()` ranks by the score predicted L periods ahead instead of
  the current one, so a rising expert is promoted a decision early (promote ahead of need).
  L = 0 is Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from moetier.errors import BudgetError
from moetier.policies.hotness import EmaHotness
from moetier.types import ExpertKey

DEFAULT_ALPHA = 0.99
"""Per-token EMA factor: memory of about 100 tokens (half-life 69), so a decision every
DEFAULT_PERIOD tokens weighs mostly the last period (0.99^128 = 0.28 left of the one before)
while a single batch cannot flip the hot set."""

DEFAULT_PERIOD = 128
"""Tokens between decisions: coarse enough that precision switches (whole-expert copies)
do not thrash, fine enough that a shift in routing is followed within a few hundred tokens."""


def split_budget(
    num_experts_per_layer: Mapping[int, int],
    hot_bytes: int,
    cold_bytes: int,
    budget: int,
    reserve: int = 0,
) -> dict[int, int]:
    """Number of hot experts per layer (layer -> n_hot) for a byte budget (paper 3.5).

    Raises ValueError for hot_bytes <= cold_bytes or a negative size, and BudgetError (naming
    the minimum budget in bytes) when the budget cannot hold every expert cold plus `reserve`.
    """
    if cold_bytes < 0 or reserve < 0:
        raise ValueError(f"sizes must be >= 0, got cold_bytes={cold_bytes}, reserve={reserve}")
    if hot_bytes <= cold_bytes:
        raise ValueError(f"hot_bytes ({hot_bytes}) must exceed cold_bytes ({cold_bytes})")
    for layer, n in num_experts_per_layer.items():
        if n < 1:
            raise ValueError(f"layer {layer} has {n} experts; need >= 1")
    total = sum(num_experts_per_layer.values())
    floor = total * cold_bytes + reserve
    if budget < floor:
        raise BudgetError(
            f"budget {budget} B cannot hold all {total} experts at cold precision ({cold_bytes} B each) "
            f"plus the reserve {reserve} B: minimum budget is {floor} B"
        )
    n_left = min(total, (budget - floor) // (hot_bytes - cold_bytes))
    out = {layer: 0 for layer in sorted(num_experts_per_layer)}
    active = list(out)  # layers not yet at their cap, in layer order
    while n_left > 0 and active:
        share, rem = divmod(n_left, len(active))
        capped = [layer for layer in active if num_experts_per_layer[layer] <= share]
        if not capped:  # every active layer takes share, the first `rem` one more (cap >= share + 1)
            for i, layer in enumerate(active):
                out[layer] = share + (1 if i < rem else 0)
            break
        for layer in capped:
            out[layer] = num_experts_per_layer[layer]
            n_left -= num_experts_per_layer[layer]
        active = [layer for layer in active if layer not in capped]
    return out


class ExpertState(StrEnum):
    """Target precision class of an expert; which `Precision` is HIGH or LOW is configuration."""

    HIGH = "high"
    LOW = "low"


@dataclass(frozen=True)
class Decision:
    """The moves one run of Algorithm 1 enqueues. `step` is the decision's index (0, 1, ...),
    -1 when `decide()` did not run (fewer than `period` tokens since the last decision)."""

    upgrades: tuple[ExpertKey, ...] = ()  # hottest first
    downgrades: tuple[ExpertKey, ...] = ()  # coldest first; apply these before the upgrades
    step: int = -1

    @property
    def empty(self) -> bool:
        return not self.upgrades and not self.downgrades


@dataclass(frozen=True)
class DecisionRecord:
    """One line of the controller's history: what decision `step` did, at which token count."""

    step: int
    tokens: int  # tokens through the model when the decision ran
    promotions: int
    demotions: int
    hot: int  # HIGH targets over all layers after the decision


class PrecisionController:
    """Algorithm 1 over all MoE layers: EMA hotness, fixed per-layer threshold, periodic decisions.

    n_hot: layer -> number of hot slots (e.g. from `split_budget`); the layers tracked.
    num_experts: experts per layer. alpha: per-token EMA factor. period: tokens between
    decisions. hysteresis: h >= 0, see module docstring. initial_hot: layer -> experts whose
    target starts HIGH (at most n_hot of them); every other expert starts LOW.
    """

    def __init__(
        self,
        n_hot: Mapping[int, int],
        num_experts: int,
        *,
        alpha: float = DEFAULT_ALPHA,
        period: int = DEFAULT_PERIOD,
        hysteresis: float = 0.0,
        initial_hot: Mapping[int, Iterable[int]] | None = None,
        lookahead: float = 0.0,
    ) -> None:
        if not n_hot:
            raise ValueError("n_hot must name at least one layer")
        if not (np.isfinite(lookahead) and lookahead >= 0):
            raise ValueError(f"lookahead must be finite and >= 0 periods, got {lookahead}")
        self._lookahead = float(lookahead)
        if period < 1:
            raise ValueError(f"period must be >= 1 token, got {period}")
        if not (np.isfinite(hysteresis) and hysteresis >= 0):
            raise ValueError(f"hysteresis must be finite and >= 0, got {hysteresis}")
        self._hotness = EmaHotness(sorted(n_hot), num_experts, alpha)  # validates alpha, E
        for layer, n in n_hot.items():
            if not 0 <= n <= num_experts:
                raise ValueError(f"layer {layer}: n_hot {n} outside [0, {num_experts}]")
        self._n_hot = {layer: int(n_hot[layer]) for layer in sorted(n_hot)}
        self._num_experts = int(num_experts)
        self._period = int(period)
        self._hysteresis = float(hysteresis)
        self._high: dict[int, set[int]] = {layer: set() for layer in self._n_hot}
        self._tau: dict[int, float | None] = dict.fromkeys(self._n_hot)
        self._pending = dict.fromkeys(self._n_hot, 0)  # tokens per layer since the last decision
        self._last: dict[int, np.ndarray | None] = dict.fromkeys(self._n_hot)  # scores [E] at the last decision
        self._history: list[DecisionRecord] = []
        self._promotions = 0
        self._demotions = 0
        for layer, experts in (initial_hot or {}).items():
            if layer not in self._n_hot:
                raise ValueError(f"initial_hot names unknown layer {layer}; layers: {list(self._n_hot)}")
            chosen = {int(e) for e in experts}
            bad = [e for e in chosen if not 0 <= e < num_experts]
            if bad:
                raise ValueError(f"initial_hot layer {layer}: expert {bad[0]} out of range [0, {num_experts})")
            if len(chosen) > self._n_hot[layer]:
                raise ValueError(f"initial_hot layer {layer}: {len(chosen)} experts exceed n_hot {self._n_hot[layer]}")
            self._high[layer] = chosen

    # --- read-only views -------------------------------------------------------------------

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self._n_hot)

    @property
    def n_hot(self) -> dict[int, int]:
        return dict(self._n_hot)

    @property
    def period(self) -> int:
        return self._period

    @property
    def hysteresis(self) -> float:
        return self._hysteresis

    @property
    def lookahead(self) -> float:
        return self._lookahead

    @property
    def hotness(self) -> EmaHotness:
        return self._hotness

    @property
    def tokens_seen(self) -> int:
        return self._hotness.tokens_seen

    @property
    def pending_tokens(self) -> int:
        """Tokens through the model since the last decision (largest per-layer count)."""
        return max(self._pending.values())

    @property
    def promotions(self) -> int:
        return self._promotions

    @property
    def demotions(self) -> int:
        return self._demotions

    @property
    def decisions(self) -> int:
        return len(self._history)

    def history(self) -> tuple[DecisionRecord, ...]:
        return tuple(self._history)

    def hot_set(self, layer: int) -> set[int]:
        """Experts of `layer` whose target is HIGH."""
        self._check_layer(layer)
        return set(self._high[layer])

    def state(self, key: ExpertKey) -> ExpertState:
        self._check_layer(key.layer)
        if not 0 <= key.expert < self._num_experts:
            raise ValueError(f"expert {key.expert} out of range [0, {self._num_experts})")
        return ExpertState.HIGH if key.expert in self._high[key.layer] else ExpertState.LOW

    def threshold(self, layer: int) -> float | None:
        """tau of `layer`; None until set (by `set_threshold` or the first decision)."""
        self._check_layer(layer)
        return self._tau[layer]

    def _check_layer(self, layer: int) -> None:
        if layer not in self._n_hot:
            raise ValueError(f"unknown layer {layer}; layers: {list(self._n_hot)}")

    # --- inputs ----------------------------------------------------------------------------

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Feed one layer call's routing (ids, weights: [T, k]) to the hotness."""
        self._hotness.update(layer, ids, weights)
        self._pending[layer] += int(np.shape(ids)[0])

    def seed(self, scores: Mapping[int, Iterable[float]]) -> None:
        """Warm up from known scores (layer -> [E], e.g. an earlier `hotness.snapshot()`) and
        set those layers' thresholds from them."""
        self._hotness.load({layer: list(values) for layer, values in scores.items()})
        for layer in scores:
            self.set_threshold(layer)

    def set_threshold(self, layer: int | None = None, value: float | None = None) -> dict[int, float]:
        """Fix tau for one layer (or all): `value` if given, else the n_hot-th largest current
        score (+inf when n_hot is 0). Returns the thresholds set."""
        layers = self.layers if layer is None else (layer,)
        out: dict[int, float] = {}
        for lay in layers:
            self._check_layer(lay)
            if value is not None:
                if not np.isfinite(value) and value != float("inf"):
                    raise ValueError(f"threshold must be a number or +inf, got {value}")
                tau = float(value)
            else:
                n = self._n_hot[lay]
                tau = float("inf") if n == 0 else float(np.sort(self._hotness.scores(lay))[-n])
            self._tau[lay] = tau
            out[lay] = tau
        return out

    def reset_target(self, key: ExpertKey, high: bool) -> None:
        """Set one expert's target to its actual state after an enqueued move failed.

        Not counted as a promotion or demotion. Resetting to HIGH may leave the layer with more
        than n_hot HIGH targets until the next decision, which demotes the coldest surplus.
        """
        self.state(key)  # validates layer and expert
        if high:
            self._high[key.layer].add(key.expert)
        else:
            self._high[key.layer].discard(key.expert)

    # --- prediction (paper 3.3 prefetch; see the module docstring) ---------------------------

    def predicted_scores(self, layer: int, tokens_ahead: float) -> np.ndarray:
        """Scores [E] extrapolated `tokens_ahead` tokens along the trend since the last decision."""
        self._check_layer(layer)
        scores = self._hotness.scores(layer)  # [E]
        last, p = self._last[layer], self._pending[layer]
        if last is None or p == 0 or tokens_ahead <= 0:
            return scores
        trend = (scores - last) / p  # [E] per token
        return np.where(scores > 0, np.maximum(scores + tokens_ahead * trend, 0.0), 0.0)

    def predict_upgrades(self) -> tuple[ExpertKey, ...]:
        """LOW experts the next decision would make HIGH if every score followed its trend until then
        (hottest predicted first); empty before the first decision (no threshold, no trend)."""
        out: list[tuple[float, ExpertKey]] = []
        for layer in self._n_hot:
            if self._tau[layer] is None or self._last[layer] is None:
                continue
            ahead = max(self._period - self._pending[layer], 0) + self._lookahead * self._period
            pred = self.predicted_scores(layer, ahead)  # [E]
            for e in sorted(self._select(layer, pred) - self._high[layer]):
                out.append((float(pred[e]), ExpertKey(layer, e)))
        out.sort(key=lambda sk: (-sk[0], sk[1]))
        return tuple(k for _, k in out)

    # --- Algorithm 1 -----------------------------------------------------------------------

    def decide(self, force: bool = False) -> Decision:
        """Run PrecisionSchedule if `period` tokens passed since the last decision (or `force`).

        The target states change at once; the caller enqueues the returned moves.
        """
        if not force and self.pending_tokens < self._period:
            return Decision()
        downs: list[tuple[float, ExpertKey]] = []
        ups: list[tuple[float, ExpertKey]] = []
        for layer in self._n_hot:
            if self._tau[layer] is None:  # warmup ends at the first decision (paper 3.5)
                self.set_threshold(layer)
            now = self._hotness.scores(layer)  # [E]
            scores = self.predicted_scores(layer, self._lookahead * self._period) if self._lookahead else now
            target = self._select(layer, scores)
            self._last[layer] = now
            for e in sorted(self._high[layer] - target):
                downs.append((float(scores[e]), ExpertKey(layer, e)))
            for e in sorted(target - self._high[layer]):
                ups.append((float(scores[e]), ExpertKey(layer, e)))
            self._high[layer] = target
        downs.sort(key=lambda sk: (sk[0], sk[1]))
        ups.sort(key=lambda sk: (-sk[0], sk[1]))
        step = len(self._history)
        self._promotions += len(ups)
        self._demotions += len(downs)
        self._history.append(
            DecisionRecord(
                step=step,
                tokens=self.tokens_seen,
                promotions=len(ups),
                demotions=len(downs),
                hot=sum(len(s) for s in self._high.values()),
            )
        )
        self._pending = dict.fromkeys(self._n_hot, 0)
        return Decision(
            upgrades=tuple(k for _, k in ups),
            downgrades=tuple(k for _, k in downs),
            step=step,
        )

    def _select(self, layer: int, scores: np.ndarray) -> set[int]:
        """H for one layer: top-n_hot eligible experts, incumbents favoured by the hysteresis."""
        n = self._n_hot[layer]
        tau = self._tau[layer]
        assert tau is not None
        if n == 0:
            return set()
        h = self._hysteresis
        incumbents = self._high[layer]
        # Eligible: positive score, at or above tau (incumbents get the hysteresis margin).
        # Sorting by (score, -id) makes ties deterministic: lower expert id counts as hotter.
        kept = sorted(
            (e for e in incumbents if scores[e] > 0 and scores[e] * (1 + h) >= tau),
            key=lambda e: (scores[e], -e),
        )  # weakest first
        challengers = sorted(
            (e for e in range(self._num_experts) if e not in incumbents and scores[e] > 0 and scores[e] >= tau),
            key=lambda e: (-scores[e], e),
        )  # hottest first
        free = n - len(kept)
        if free < 0:  # only after reset_target(high=True) overfilled the layer: keep the hottest n
            kept, free = kept[-n:], 0
        chosen = set(kept) | set(challengers[:free])
        rest = challengers[free:]
        for challenger, incumbent in zip(rest, kept, strict=False):
            if scores[challenger] > (1 + h) * scores[incumbent]:
                chosen.discard(incumbent)
                chosen.add(challenger)
            else:
                break
        return chosen


@dataclass(frozen=True)
class SwitchPlan:
    """A decision fitted to the high-precision slots: what to move, in which order, and what not."""

    moves: tuple[tuple[ExpertKey, ExpertState], ...]  # in order; a promotion that needs a slot follows a demotion
    rejected_upgrades: tuple[ExpertKey, ...]  # stay LOW: no slot for them
    kept_high: tuple[ExpertKey, ...]  # stay HIGH: demoting them would free a slot nobody needs


def order_switches(decision: Decision, free_high_slots: int, transient: int = 0) -> SwitchPlan:
    """Pair a decision's moves so that the two pools never need a slot they do not have.

    Every expert is resident, so the low pool has room for all but the hot experts plus a
    few spares: a demotion needs the low slot a promotion frees, and a promotion needs the
    high slot a demotion frees (or one of `free_high_slots`). So: the first `free_high_slots`
    promotions go alone, then each further promotion is paired with one demotion (coldest first).
    Demotions nobody needs a slot from are dropped: the expert keeps its high precision,
    which costs nothing (its slot is paid for) and is never less accurate. Promotions beyond
    the demotions available are rejected.

    `transient` is the number of high-precision slots of the transient buffer (paper 3.4: "a small
    transient buffer absorbs transfer bursts, allowing multiple in-flight promotions"). With none,
    each pair runs demotion first (it frees the high slot its promotion fills). With T >= 1 the first
    T paired promotions go first, into the transient slots, then each demotion is followed by the next
    promotion (d_1, u_(T+1), d_2, u_(T+2), ..., then the last T demotions), so a pipelined mover has up
    to T promotions in flight before any demotion has run, and the transient slots are free again at
    the end. Either order is feasible when the moves run one at a time in plan order (the high pool
    has quota + T slots, each promotion frees the low slot a later demotion takes).
    """
    if free_high_slots < 0 or transient < 0:
        raise ValueError(f"free_high_slots and transient must be >= 0, got {free_high_slots}, {transient}")
    ups, downs = list(decision.upgrades), list(decision.downgrades)
    alone = ups[:free_high_slots]
    paired = ups[free_high_slots : free_high_slots + len(downs)]
    moves: list[tuple[ExpertKey, ExpertState]] = [(k, ExpertState.HIGH) for k in alone]
    lead = paired[:transient]  # into the transient slots, ahead of every demotion
    moves += [(k, ExpertState.HIGH) for k in lead]
    rest = paired[len(lead) :]
    for i, down in enumerate(downs[: len(paired)]):
        moves.append((down, ExpertState.LOW))
        if i < len(rest):
            moves.append((rest[i], ExpertState.HIGH))
    return SwitchPlan(
        moves=tuple(moves),
        rejected_upgrades=tuple(ups[free_high_slots + len(downs) :]),
        kept_high=tuple(downs[len(paired) :]),
    )
