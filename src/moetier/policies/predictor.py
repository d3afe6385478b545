"""TriMoE 4.3: EMA expert-load predictor and the background relayout / rebalancing planner.

Predictor (`LoadPredictor`, eq. 8): per layer and expert, after each call of the layer with token
loads F_e(t), EMA_e(t) = a * F_e(t) + (1 - a) * EMA_e(t - 1), a = 0.3 (a weighs the *new* load,
unlike DynaExq's eq. 2 in hotness.py). A layer's first call sets EMA = F. The EMA is the
prediction for the layer's next call. Classes hot / warm / cold come from loads by a rule:
`FractionRule` (Fig. 3: few hot, ~30% warm, >70% cold, by rank) or `ThresholdRule` (tokens per
expert); a load of 0 is always cold.

Accuracy (`PredictorStats`): the paper reports ">78% (migration decision) accuracy" without a
definition. Our reading, the headline `accuracy`: over every call after a layer's first and every
expert, the fraction whose predicted class (rule on the EMA before the update) equals the actual
class (rule on the observed loads); the class decides prefetch / relayout / migration. Also:
`hot_precision` / `hot_recall` (overlap of predicted and actual hot sets), `change_accuracy`
(among experts predicted to leave their last observed class, the fraction that reached the
predicted class), `rel_error` (sum |pred - actual| / sum actual), and `decision_accuracy` (issue 30: the
paper's own words are "78% migration decision accuracy" (4.3) and "predictor accuracy exceeding 78% (which
makes such large transfers infrequent)" (5.5)): among the background actions the planner took (prefetch,
relayout, migration), the share that were right at the layer's next call (`decision_right`), counted by
the simulator through `PredictorStats.record_decisions`.

Planner (`plan_actions`): from each expert's predicted class and `ExpertState` (in HBM, layout,
home DIMM, path times of eq. 1-4 at the predicted load, caller-priced action costs), candidates
touching one expert each; benefit = predicted seconds saved where the expert runs next call:
  1. PREFETCH (PCIe) a hot expert not in HBM: gpu_miss(its layout) - gpu_hit.
  2. RELAYOUT (DIMM-Link) a non-resident expert whose layout mismatches its predicted domain (hot ->
     GPU and warm -> CPU want striped, cold -> NDP wants localised): hot localised -> striped:
     gpu_miss_local - gpu_miss_striped; warm: cpu_local - cpu_striped; cold striped -> localised on
     the idlest DIMM d: off = min(cpu_striped, gpu_miss_striped) leaves the serial GPU / CPU domains,
     less the rise of the parallel NDP domain's makespan: off - max(0, load[d] + ndp - max(load)).
  3. MIGRATE (DIMM-Link) a cold localised non-resident expert from the busiest DIMM b to the idlest
     i when load[b] > skew_ratio * mean(load): load[b] - max(load[b] - ndp, load[i] + ndp) (> 0).
The predicted cold load of DIMM d is base[d] (caller's unmovable load, e.g. eq. 6 contention) plus
the ndp time of the cold, localised, non-resident experts homed on d.
Greedy: take the candidate of highest benefit (ties: lower cost, prefetch < relayout < migrate,
layer, expert) that still fits its link's window, apply it, re-derive the load-dependent candidates
(migrations go one by one), repeat; one that does not fit is skipped, a smaller one may still fit.
Window reading: PCIe (host -> GPU) and the DIMM-Link (inter-DIMM, host-free) are independent, each
gets the whole window hidden by the layer's attention and dense work. PCIe is one serial link. The DIMM-Link is
priced per link (`link_ports`): each DIMM has one link port (Table 1: 25 GB/s per link); an action's cost_s is one
expert over one link, and it occupies the ports it uses: a migration its source and destination DIMMs' ports for
cost_s each; a relayout its localised end's port for cost_s (the whole expert enters or leaves that DIMM) and every
other DIMM's port for cost_s / D (its 1/D stripe). Moves on disjoint ports run in parallel; a port's chosen
actions never exceed the window. `ActionPlan.dimm_link_s` is the busiest port's time (the DIMM-Link's wall time).
With `fabric=True` (the simulator's default "calibrated" DIMM-Link, sim/ndp.py) the DIMM-Link is one shared
fabric of an aggregate rate: every move's cost_s is priced at that rate and the moves run one after another,
so their summed cost must fit the window (TriMoE 5.5: "the ~0.63 ms cost of migrating up to four experts").

Invariants: PCIe: the sum of chosen costs <= its window; DIMM-Link: per port (fabric: in all), the sum of its shares
<= window_s;
an expert gets at most one action;
prefetches <= hbm_free_slots; a migration never raises the maximum DIMM load; bad input: ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum

import numpy as np

from moetier.errors import ConfigError
from moetier.types import ExpertKey, Layout


class Heat(IntEnum):  # the int codes `classify` returns
    COLD = 0
    WARM = 1
    HOT = 2


class ActionKind(StrEnum):
    PREFETCH = "prefetch"
    RELAYOUT = "relayout"
    MIGRATE = "migrate"


def _check_nonneg(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class FractionRule:
    """Top floor(hot * E) experts by load are hot, the next up to floor((hot + warm) * E) warm."""

    hot: float = 0.05
    warm: float = 0.25

    def __post_init__(self) -> None:
        if not (self.hot >= 0 and self.warm >= 0 and self.hot + self.warm <= 1):
            raise ConfigError(f"FractionRule needs hot, warm >= 0 and hot + warm <= 1, got {self.hot}, {self.warm}")

    def classify(self, loads: np.ndarray) -> np.ndarray:
        n = loads.shape[0]
        order = np.lexsort((np.arange(n), -loads))  # by load desc, ties to the lower id
        cls = np.zeros(n, dtype=np.int8)  # [E]
        n_hot, n_hw = int(self.hot * n), int((self.hot + self.warm) * n)
        cls[order[:n_hw]] = Heat.WARM
        cls[order[:n_hot]] = Heat.HOT
        cls[loads <= 0] = Heat.COLD
        return cls


@dataclass(frozen=True)
class ThresholdRule:
    """Hot when load >= hot_tokens, warm when load >= warm_tokens (> 0), else cold."""

    hot_tokens: float
    warm_tokens: float

    def __post_init__(self) -> None:
        if not (0 < self.warm_tokens <= self.hot_tokens and math.isfinite(self.hot_tokens)):
            raise ConfigError(f"ThresholdRule needs 0 < warm <= hot tokens, got {self.warm_tokens}, {self.hot_tokens}")

    def classify(self, loads: np.ndarray) -> np.ndarray:
        cls = np.zeros(loads.shape[0], dtype=np.int8)  # [E]
        cls[loads >= self.warm_tokens] = Heat.WARM
        cls[loads >= self.hot_tokens] = Heat.HOT
        return cls


ClassRule = FractionRule | ThresholdRule


@dataclass
class PredictorStats:
    """Counters of predicted vs actual next-call loads and classes (see the module docstring)."""

    calls: int = 0  # scored layer calls
    experts: int = 0  # scored (call, expert) pairs
    class_correct: int = 0
    hot_predicted: int = 0
    hot_actual: int = 0
    hot_both: int = 0
    changed: int = 0  # predicted class != last observed class
    changed_correct: int = 0
    abs_error: float = 0.0
    actual_load: float = 0.0
    decisions: int = 0  # background actions scored at their layer's next call (`record_decisions`)
    decisions_right: int = 0

    def record(
        self, pred: np.ndarray, pred_cls: np.ndarray, actual: np.ndarray, actual_cls: np.ndarray, last_cls: np.ndarray
    ) -> None:
        """One layer call: predicted loads/classes [E] against the observed ones, last_cls the previous call's."""
        hit = pred_cls == actual_cls  # [E]
        ph, ah = pred_cls == Heat.HOT, actual_cls == Heat.HOT  # [E]
        ch = pred_cls != last_cls  # [E]
        self.calls += 1
        self.experts += int(pred.shape[0])
        self.class_correct += int(hit.sum())
        self.hot_predicted += int(ph.sum())
        self.hot_actual += int(ah.sum())
        self.hot_both += int((ph & ah).sum())
        self.changed += int(ch.sum())
        self.changed_correct += int((ch & hit).sum())
        self.abs_error += float(np.abs(pred - actual).sum())
        self.actual_load += float(actual.sum())

    def record_decisions(self, actions: Sequence[Action], actual_cls: np.ndarray) -> None:
        """Score the background actions planned after a layer's previous call against its actual classes [E] at
        this call (`decision_right`): TriMoE 4.3's "78% migration decision accuracy", our reading."""
        for a in actions:
            self.decisions += 1
            self.decisions_right += decision_right(a, actual_cls)

    def as_dict(self) -> dict[str, float]:
        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        return {
            "calls": self.calls,
            "experts": self.experts,
            "accuracy": ratio(self.class_correct, self.experts),
            "hot_precision": ratio(self.hot_both, self.hot_predicted),
            "hot_recall": ratio(self.hot_both, self.hot_actual),
            "change_accuracy": ratio(self.changed_correct, self.changed),
            "rel_error": ratio(self.abs_error, self.actual_load),
            "decisions": self.decisions,
            "decision_accuracy": ratio(self.decisions_right, self.decisions),
        }


class LoadPredictor:
    """Eq. 8 EMA of token load per expert for a set of layers with `num_experts` experts each."""

    def __init__(
        self, layers: Sequence[int], num_experts: int, alpha: float = 0.3, rule: ClassRule | None = None
    ) -> None:
        layer_t = tuple(int(x) for x in layers)
        if not layer_t or len(set(layer_t)) != len(layer_t):
            raise ConfigError(f"LoadPredictor needs distinct layers, got {list(layer_t)}")
        if num_experts < 1:
            raise ConfigError(f"num_experts must be >= 1, got {num_experts}")
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ConfigError(f"alpha must lie in (0, 1], got {alpha}")
        self.layers, self.num_experts, self.alpha = layer_t, int(num_experts), float(alpha)
        self.rule: ClassRule = rule if rule is not None else FractionRule()
        self._row = {layer: i for i, layer in enumerate(layer_t)}
        self._ema = np.zeros((len(layer_t), self.num_experts), dtype=np.float64)  # [L, E]
        self._last = np.zeros((len(layer_t), self.num_experts), dtype=np.int8)  # [L, E] last actual class
        self._seen = np.zeros(len(layer_t), dtype=bool)  # [L]
        self.stats = PredictorStats()

    def _index(self, layer: int) -> int:
        if layer not in self._row:
            raise ConfigError(f"unknown layer {layer}; tracked layers: {list(self.layers)}")
        return self._row[layer]

    def update(self, layer: int, loads: np.ndarray) -> None:
        """Score the standing prediction against `loads` (tokens per expert, [E]), then apply eq. 8."""
        # 1. Check the input
        row = self._index(layer)
        f = np.asarray(loads, dtype=np.float64)  # [E]
        if f.shape != (self.num_experts,):
            raise ConfigError(f"layer {layer}: expected {self.num_experts} loads, got shape {f.shape}")
        if not np.isfinite(f).all() or (f < 0).any():
            raise ConfigError(f"layer {layer}: loads must be finite and >= 0")
        actual_cls = self.rule.classify(f)
        # 2. Score the prediction standing since the last call (none before the first call)
        if self._seen[row]:
            pred = self._ema[row]
            self.stats.record(pred, self.rule.classify(pred), f, actual_cls, self._last[row])
            self._ema[row] = self.alpha * f + (1.0 - self.alpha) * pred
        else:
            self._ema[row] = f
            self._seen[row] = True
        self._last[row] = actual_cls

    def update_routing(self, layer: int, ids: np.ndarray) -> None:
        """`update` with the loads counted from one call's top-k ids [T, k]."""
        ids_a = np.asarray(ids)
        if ids_a.ndim != 2 or (ids_a.size and (ids_a.min() < 0 or ids_a.max() >= self.num_experts)):
            raise ConfigError(f"layer {layer}: routing ids must be [T, k] in [0, {self.num_experts})")
        self.update(layer, np.bincount(ids_a.ravel().astype(np.int64), minlength=self.num_experts))

    def predict(self, layer: int) -> np.ndarray:
        """Predicted load of each expert at the layer's next call, [E] float64 (zeros before any call)."""
        return self._ema[self._index(layer)].copy()

    def classes(self, layer: int) -> np.ndarray:
        """Predicted class (Heat codes) of each expert at the layer's next call, [E] int8."""
        return self.rule.classify(self._ema[self._index(layer)])


@dataclass(frozen=True)
class PathTimes:
    """Predicted execution time of one expert at its predicted load on each path (eq. 1-4), seconds."""

    gpu_hit: float
    gpu_miss_striped: float
    gpu_miss_local: float
    cpu_striped: float
    cpu_local: float
    ndp: float  # on its own DIMM (eq. 4); layout-independent once localised

    def __post_init__(self) -> None:
        for name in ("gpu_hit", "gpu_miss_striped", "gpu_miss_local", "cpu_striped", "cpu_local", "ndp"):
            _check_nonneg(f"PathTimes.{name}", getattr(self, name))


@dataclass(frozen=True)
class ExpertState:
    """What the planner knows about one expert after a layer: prediction, placement, prices."""

    key: ExpertKey
    heat: Heat  # predicted class at the next call
    in_hbm: bool
    layout: Layout
    dimm: int  # home DIMM when localised; ignored when striped (schedule_trimoe uses -1)
    times: PathTimes
    prefetch_s: float  # PCIe time to bring it into HBM
    relayout_s: float  # DIMM-Link time to convert its layout
    migrate_s: float  # DIMM-Link time to move its localised copy to another DIMM

    def __post_init__(self) -> None:
        object.__setattr__(self, "heat", Heat(self.heat))  # accept the int codes of LoadPredictor.classes
        object.__setattr__(self, "layout", Layout(self.layout))
        for name in ("prefetch_s", "relayout_s", "migrate_s"):
            _check_nonneg(f"{self.key}: {name}", getattr(self, name))


@dataclass(frozen=True)
class Action:
    """One background action; `dst_dimm` is the target of a migration or of a relayout to localised."""

    kind: ActionKind
    key: ExpertKey
    cost_s: float
    benefit_s: float
    layout: Layout | None = None  # the layout after a relayout
    src_dimm: int | None = None
    dst_dimm: int | None = None

    @property
    def link(self) -> str:
        return "pcie" if self.kind is ActionKind.PREFETCH else "dimm_link"


def decision_right(action: Action, actual_cls: np.ndarray) -> bool:
    """Whether one background action was right at its layer's next call, by the class it was taken for: a
    prefetch needs the expert hot; a relayout to striped needs it hot or warm (GPU and CPU want striped); a
    relayout to localised or a migration needs it cold (NDP)."""
    c = Heat(int(actual_cls[action.key.expert]))
    if action.kind is ActionKind.PREFETCH:
        return c is Heat.HOT
    if action.kind is ActionKind.RELAYOUT and action.layout is Layout.STRIPED:
        return c is not Heat.COLD
    return c is Heat.COLD


@dataclass(frozen=True)
class ActionPlan:
    """The planner's answer: actions in the order chosen and the time each link is busy."""

    actions: tuple[Action, ...]  # in the order chosen (priority order)
    pcie_s: float  # time used on PCIe
    dimm_link_s: float  # time the busiest DIMM-Link port is used (link_ports)
    dimm_load_before: tuple[float, ...] = ()  # predicted cold load per DIMM, seconds
    dimm_load_after: tuple[float, ...] = ()
    dimm_port_s: tuple[float, ...] = ()  # time each DIMM's link port is used


def link_ports(action: Action, num_dimms: int, fabric: bool = False) -> list[tuple[int, float]]:
    """(DIMM, seconds) each DIMM-Link port is busy for one action (module docstring); [] for a prefetch. With
    `fabric` the whole DIMM-Link is one budget, reported as port 0 for the action's whole cost."""
    if action.kind is ActionKind.PREFETCH:
        return []
    c = action.cost_s
    if fabric:
        return [(0, c)]
    if action.kind is ActionKind.MIGRATE:
        assert action.src_dimm is not None and action.dst_dimm is not None
        return [(action.src_dimm, c), (action.dst_dimm, c)]
    end = action.dst_dimm if action.layout is Layout.LOCALISED else action.src_dimm
    assert end is not None
    return [(d, c if d == end else c / num_dimms) for d in range(num_dimms)]


def dimm_loads(experts: Sequence[ExpertState], num_dimms: int, base: Sequence[float] | None = None) -> np.ndarray:
    """Predicted cold load per DIMM [D]: base plus ndp time of cold, localised, non-resident experts."""
    load = np.zeros(num_dimms, dtype=np.float64) if base is None else np.array(base, dtype=np.float64)  # [D]
    if load.shape != (num_dimms,) or not np.isfinite(load).all() or (load < 0).any():
        raise ConfigError(f"DIMM base loads must be {num_dimms} finite numbers >= 0, got {base!r}")
    for s in experts:
        if s.heat is Heat.COLD and s.layout is Layout.LOCALISED and not s.in_hbm:
            load[s.dimm] += s.times.ndp
    return load


def _static_candidates(experts: Sequence[ExpertState]) -> list[Action]:
    """Prefetches and relayouts to striped: benefits independent of DIMM loads."""
    out: list[Action] = []
    for s in experts:
        if s.in_hbm or s.heat is Heat.COLD:
            continue
        t = s.times
        if s.heat is Heat.HOT:
            miss = t.gpu_miss_striped if s.layout is Layout.STRIPED else t.gpu_miss_local
            if miss - t.gpu_hit > 0:
                out.append(Action(ActionKind.PREFETCH, s.key, s.prefetch_s, miss - t.gpu_hit))
        if s.layout is Layout.LOCALISED:
            gain = t.gpu_miss_local - t.gpu_miss_striped if s.heat is Heat.HOT else t.cpu_local - t.cpu_striped
            if gain > 0:
                out.append(Action(ActionKind.RELAYOUT, s.key, s.relayout_s, gain, Layout.STRIPED, src_dimm=s.dimm))
    return out


def _load_candidates(experts: Sequence[ExpertState], load: np.ndarray, skew_ratio: float) -> list[Action]:
    """Relayouts to localised (onto the idlest DIMM) and migrations busiest -> idlest, at the current loads."""
    out: list[Action] = []
    idle, busy = int(np.argmin(load)), int(np.argmax(load))
    top = float(load[busy])
    skewed = top > 0 and top > skew_ratio * float(load.mean())
    for s in experts:
        if s.in_hbm or s.heat is not Heat.COLD:
            continue
        ndp = s.times.ndp
        if s.layout is Layout.STRIPED:
            gain = min(s.times.cpu_striped, s.times.gpu_miss_striped) - max(0.0, load[idle] + ndp - top)
            if gain > 0:
                out.append(
                    Action(ActionKind.RELAYOUT, s.key, s.relayout_s, float(gain), Layout.LOCALISED, dst_dimm=idle)
                )
        elif skewed and s.dimm == busy and busy != idle:
            gain = top - max(top - ndp, float(load[idle]) + ndp)
            if gain > 0:
                out.append(Action(ActionKind.MIGRATE, s.key, s.migrate_s, gain, src_dimm=busy, dst_dimm=idle))
    return out


def plan_actions(
    experts: Sequence[ExpertState],
    num_dimms: int,
    window_s: float,
    *,
    dimm_base_s: Sequence[float] | None = None,
    skew_ratio: float = 1.2,
    hbm_free_slots: int | None = None,
    pcie_window_s: float | None = None,
    fabric: bool = False,
) -> ActionPlan:
    """The background actions to run while the layer's attention and dense work hide `window_s` per link
    (`pcie_window_s`, when given, is PCIe's own budget: the window less the PCIe time other traffic takes, e.g. a
    KV cache streamed from host DIMMs; `fabric`: the DIMM-Link as one shared budget, see the module docstring)."""
    # 1. Check the arguments
    _check_nonneg("window_s", window_s)
    pcie_window = window_s if pcie_window_s is None else pcie_window_s
    _check_nonneg("pcie_window_s", pcie_window)
    if num_dimms < 1:
        raise ConfigError(f"num_dimms must be >= 1, got {num_dimms}")
    if not (math.isfinite(skew_ratio) and skew_ratio >= 1.0):
        raise ConfigError(f"skew_ratio must be a finite number >= 1, got {skew_ratio}")
    if hbm_free_slots is not None and hbm_free_slots < 0:
        raise ConfigError(f"hbm_free_slots must be >= 0, got {hbm_free_slots}")
    by_key = {s.key: s for s in experts}
    if len(by_key) != len(experts):
        raise ConfigError("plan_actions: an expert appears twice in the state")
    if bad := [s.key for s in experts if s.layout is Layout.LOCALISED and not 0 <= s.dimm < num_dimms]:
        raise ConfigError(f"{bad[0]}: home DIMM of a localised expert out of range [0, {num_dimms})")
    # 2. Starting loads and static candidates
    load = dimm_loads(experts, num_dimms, dimm_base_s)  # [D]
    before = tuple(float(x) for x in load)
    static = _static_candidates(experts)
    pcie = 0.0  # sum of chosen PCIe costs, in order: compared, never subtracted
    port = [0.0] * num_dimms  # DIMM-Link time per DIMM port (link_ports)
    slots = math.inf if hbm_free_slots is None else hbm_free_slots

    def fits(a: Action) -> bool:
        if a.kind is ActionKind.PREFETCH:
            return slots > 0 and pcie + a.cost_s <= pcie_window
        return all(port[d] + t <= window_s for d, t in link_ports(a, num_dimms, fabric))

    touched: set[ExpertKey] = set()
    chosen: list[Action] = []
    # 3. Greedy: best fitting candidate, apply, re-derive the load-dependent candidates
    while True:
        cands = [a for a in static if a.key not in touched]
        cands += [a for a in _load_candidates(experts, load, skew_ratio) if a.key not in touched]
        ok = [a for a in cands if fits(a)]
        if not ok:
            break
        best = min(ok, key=lambda a: (-a.benefit_s, a.cost_s, list(ActionKind).index(a.kind), a.key))
        chosen.append(best)
        touched.add(best.key)
        for d, t in link_ports(best, num_dimms, fabric):
            port[d] += t
        s = by_key[best.key]
        if best.kind is ActionKind.PREFETCH:
            pcie += best.cost_s
            slots -= 1
        if best.kind is ActionKind.MIGRATE:
            load[s.dimm] = max(0.0, load[s.dimm] - s.times.ndp)
        if best.dst_dimm is not None:  # a migration's or a relayout-to-localised's target
            load[best.dst_dimm] += s.times.ndp
    return ActionPlan(tuple(chosen), pcie, max(port, default=0.0), before, tuple(float(x) for x in load),
                      tuple(port))  # fmt: skip
