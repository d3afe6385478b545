"""TriMoE 4.3: EMA load predictor (eq. 8), its accuracy, and the relayout / rebalancing planner."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import ConfigError
from moetier.policies.predictor import (
    Action,
    ActionKind,
    ExpertState,
    FractionRule,
    Heat,
    Layout,
    LoadPredictor,
    PathTimes,
    PredictorStats,
    ThresholdRule,
    dimm_loads,
    link_ports,
    plan_actions,
)
from moetier.types import ExpertKey

H, W, C = Heat.HOT, Heat.WARM, Heat.COLD
TIMES = PathTimes(gpu_hit=1, gpu_miss_striped=4, gpu_miss_local=6, cpu_striped=3, cpu_local=5, ndp=2)


def st_(
    e: int, heat: Heat, layout: Layout = Layout.STRIPED, dimm: int = 0, in_hbm: bool = False, **kw: float
) -> ExpertState:
    times = dataclasses.replace(TIMES, **{k: kw.pop(k) for k in list(kw) if k in PathTimes.__dataclass_fields__})
    costs = {"prefetch_s": 1.0, "relayout_s": 1.0, "migrate_s": 1.0} | kw
    return ExpertState(ExpertKey(0, e), heat, in_hbm, layout, dimm, times, **costs)


# ---------------------------------------------------------------- predictor


def test_ema_matches_hand_computation() -> None:
    p = LoadPredictor([4], 3)  # alpha 0.3 by default
    p.update(4, np.array([10, 0, 4]))
    np.testing.assert_allclose(p.predict(4), [10, 0, 4])  # the first call sets the EMA
    p.update(4, np.array([0, 10, 4]))
    np.testing.assert_allclose(p.predict(4), [0.7 * 10, 0.3 * 10, 4])  # [7, 3, 4]
    p.update(4, np.array([0, 0, 0]))
    np.testing.assert_allclose(p.predict(4), [4.9, 2.1, 2.8])
    q = LoadPredictor([4], 3)
    for ids in ([[0, 2]] * 10, [[1, 2]] * 10 + [[2, 1]] * 4, []):  # loads [10, 0, 10], [0, 14, 14], [0, 0, 0]
        q.update_routing(4, np.array(ids, dtype=np.int64).reshape(-1, 2))
    ema2 = np.array([0.7 * 10, 0.3 * 14, 0.3 * 14 + 0.7 * 10])  # [7, 4.2, 11.2]
    np.testing.assert_allclose(q.predict(4), 0.7 * ema2)


def test_fraction_and_threshold_rules() -> None:
    rule = FractionRule(hot=0.25, warm=0.25)
    assert rule.classify(np.array([2.0, 5.0, 2.0, 0.0])).tolist() == [W, H, C, C]  # tie goes to the lower id
    assert rule.classify(np.zeros(4)).tolist() == [C] * 4  # zero load is never hot or warm
    default = FractionRule().classify(np.arange(160, 0, -1, dtype=float))
    assert (default == H).sum() == 8 and (default == W).sum() == 40 and (default == C).sum() == 112
    thr = ThresholdRule(hot_tokens=100, warm_tokens=10)
    assert thr.classify(np.array([0, 9.9, 10, 99, 100, 500])).tolist() == [C, C, W, W, H, H]
    for bad in (lambda: FractionRule(0.8, 0.3), lambda: FractionRule(-0.1, 0.2), lambda: ThresholdRule(5, 10)):
        with pytest.raises(ConfigError):
            bad()


def test_stats_hand_computation() -> None:
    p = LoadPredictor([0], 4, alpha=0.5, rule=ThresholdRule(hot_tokens=10, warm_tokens=2))
    p.update(0, np.array([20, 4, 0, 0]))  # not scored; last classes [H, W, C, C]
    assert p.stats.calls == 0
    assert p.classes(0).tolist() == [H, W, C, C]
    p.update(0, np.array([12, 0, 3, 0]))  # actual [H, C, W, C] vs predicted [H, W, C, C]
    d = p.stats.as_dict()
    assert d["calls"] == 1 and d["experts"] == 4 and d["accuracy"] == 0.5
    assert d["hot_precision"] == 1.0 and d["hot_recall"] == 1.0
    assert d["change_accuracy"] == 0.0  # no expert was predicted to change class
    assert d["rel_error"] == pytest.approx((8 + 4 + 3 + 0) / 15)
    assert p.predict(0).tolist() == [16, 2, 1.5, 0]
    p.update(0, np.array([0, 0, 1, 0]))  # predicted [H, W, C, C], last [H, C, W, C]: expert 1, 2 predicted to move
    s = p.stats
    assert (s.changed, s.changed_correct) == (2, 1)  # expert 2 went cold as predicted, expert 1 did not warm
    assert PredictorStats().as_dict()["accuracy"] == 0.0


def _stream(rng: np.random.Generator, steps: int, num_experts: int, shuffle: bool) -> list[np.ndarray]:
    mean = 400.0 / np.arange(1, num_experts + 1) ** 1.1  # skewed, stationary per-expert means
    out = []
    for _ in range(steps):
        m = rng.permutation(mean) if shuffle else mean
        out.append(rng.poisson(m).astype(np.float64))
    return out


def test_accuracy_high_on_stationary_low_on_shuffled_stream() -> None:
    rng = np.random.default_rng(0)
    acc = {}
    for shuffle in (False, True):
        p = LoadPredictor([0, 1], 64)
        for loads in _stream(rng, 200, 64, shuffle):
            p.update(0, loads)
            p.update(1, loads[::-1])
        acc[shuffle] = p.stats.as_dict()
        assert acc[shuffle]["calls"] == 2 * 199
    assert acc[False]["accuracy"] > 0.9 and acc[False]["hot_precision"] > 0.9
    assert acc[True]["accuracy"] < 0.65 and acc[True]["hot_precision"] < 0.3


def test_predictor_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        LoadPredictor([0], 4, alpha=0.0)
    with pytest.raises(ConfigError):
        LoadPredictor([0, 0], 4)
    p = LoadPredictor([0], 4)
    for bad in (np.ones(3), np.array([1, -1, 0, 0]), np.array([np.nan, 0, 0, 0])):
        with pytest.raises(ConfigError):
            p.update(0, bad)
    with pytest.raises(ConfigError, match="unknown layer"):
        p.predict(1)
    with pytest.raises(ConfigError):
        p.update_routing(0, np.array([[0, 4]]))


# ---------------------------------------------------------------- planner


def test_prefetch_triggered_only_for_nonresident_hot() -> None:
    states = [st_(0, H), st_(1, H, in_hbm=True), st_(2, W), st_(3, H, gpu_hit=4)]  # 3: no gain
    plan = plan_actions(states, 2, 10.0)
    assert [(a.kind, a.key.expert, a.benefit_s) for a in plan.actions] == [(ActionKind.PREFETCH, 0, 3.0)]
    assert plan.pcie_s == 1.0 and plan.dimm_link_s == 0.0 and plan.actions[0].link == "pcie"
    assert plan_actions(states, 2, 10.0, hbm_free_slots=0).actions == ()


def test_relayout_both_directions_and_not_when_matching() -> None:
    states = [
        st_(0, W, Layout.LOCALISED, dimm=0),  # warm localised -> striped: cpu 5 - 3
        st_(1, W, Layout.STRIPED),  # matches: nothing
        st_(2, C, Layout.STRIPED),  # cold striped -> localised on the idlest DIMM
        st_(3, C, Layout.LOCALISED, dimm=0, ndp=0.5),  # matches; one DIMM: no migration target
        st_(4, W, Layout.LOCALISED, in_hbm=True),  # resident: nothing
    ]
    plan = plan_actions(states, 1, 10.0)
    got = {a.key.expert: a for a in plan.actions}
    assert set(got) == {0, 2}
    assert got[0].kind is ActionKind.RELAYOUT and got[0].layout is Layout.STRIPED and got[0].benefit_s == 2.0
    # off-NDP time min(3, 4) = 3, NDP makespan 0.5 -> 2.5: rise 2.0 charged
    assert got[2].layout is Layout.LOCALISED and got[2].dst_dimm == 0 and got[2].benefit_s == pytest.approx(1.0)
    assert plan.dimm_load_before == (0.5,) and plan.dimm_load_after == (2.5,)
    # a hot localised expert whose prefetch does not fit PCIe is relayouted instead (one action per expert)
    hot = [st_(0, H, Layout.LOCALISED, prefetch_s=5.0)]
    assert [a.kind for a in plan_actions(hot, 1, 10.0).actions] == [ActionKind.PREFETCH]
    only = plan_actions(hot, 1, 2.0).actions
    assert [(a.kind, a.layout, a.benefit_s) for a in only] == [(ActionKind.RELAYOUT, Layout.STRIPED, 2.0)]


def test_cold_relayout_goes_to_idlest_dimm_for_free_when_under_makespan() -> None:
    states = [st_(0, C, Layout.LOCALISED, dimm=0, ndp=3), st_(1, C, Layout.LOCALISED, dimm=1, ndp=1), st_(2, C)]
    plan = plan_actions(states, 2, 10.0, skew_ratio=2.0)  # 3 vs mean 2: no skew at 2.0
    (a,) = plan.actions
    assert a.key.expert == 2 and a.dst_dimm == 1 and a.benefit_s == 3.0  # 1 + 2 <= 3: no makespan rise
    assert plan.dimm_load_after == (3.0, 3.0)


def test_migration_greedy_one_by_one_reduces_max_load() -> None:
    states = [st_(e, C, Layout.LOCALISED, dimm=0, ndp=t) for e, t in enumerate((3.0, 2.0, 1.0))]
    states += [st_(3, C, Layout.LOCALISED, dimm=1, ndp=1.0), st_(4, C, Layout.LOCALISED, dimm=2, ndp=1.0)]
    plan = plan_actions(states, 4, 10.0)
    assert plan.dimm_load_before == (6.0, 1.0, 1.0, 0.0)
    moves = [(a.key.expert, a.src_dimm, a.dst_dimm, a.benefit_s) for a in plan.actions]
    assert moves == [(0, 0, 3, 3.0), (2, 0, 1, 1.0)]  # 3 -> idle DIMM 3; then [3, 1, 1, 3]: 1 -> DIMM 1
    assert all(a.kind is ActionKind.MIGRATE for a in plan.actions)
    assert plan.dimm_load_after == (2.0, 2.0, 1.0, 3.0) and max(plan.dimm_load_after) < max(plan.dimm_load_before)
    assert plan.dimm_link_s == 2.0
    # not triggered: below the skew ratio, or an expert too big to help
    assert plan_actions(states, 4, 10.0, skew_ratio=3.5).actions == ()
    big = [st_(0, C, Layout.LOCALISED, dimm=0, ndp=4.0), st_(1, C, Layout.LOCALISED, dimm=1, ndp=0.5)]
    assert plan_actions(big, 2, 10.0).actions == ()  # moving 4 would leave DIMM 1 at 4.5 > 4
    # the caller's base load counts towards the skew and the idlest DIMM
    based = plan_actions(states, 4, 10.0, dimm_base_s=[0, 0, 0, 5])
    assert based.actions[0].dst_dimm in (1, 2) and based.dimm_load_before[3] == 5.0


def test_ranking_by_benefit_and_window_respected_exactly() -> None:
    states = [
        st_(0, H, gpu_miss_striped=2.0, prefetch_s=0.25),  # benefit 1
        st_(1, H, gpu_miss_striped=9.0, prefetch_s=0.5),  # benefit 8
        st_(2, H, gpu_miss_striped=5.0, prefetch_s=0.25),  # benefit 4
        st_(3, H, gpu_miss_striped=1.5, prefetch_s=0.125),  # benefit 0.5: no room left
        st_(4, H, gpu_miss_striped=50.0, prefetch_s=1.5),  # benefit 49 but over the window: skipped
        st_(5, W, Layout.LOCALISED, relayout_s=1.0),  # DIMM-Link: its own window
    ]
    plan = plan_actions(states, 1, 1.0)
    assert [a.key.expert for a in plan.actions] == [1, 2, 5, 0]  # benefits 8, 4, 2, 1 across both links
    assert [a.benefit_s for a in plan.actions] == sorted((a.benefit_s for a in plan.actions), reverse=True)
    assert plan.pcie_s == 1.0 and plan.dimm_link_s == 1.0  # 0.5 + 0.25 + 0.25 fills the window exactly


def test_dimm_link_is_priced_per_link() -> None:
    # each move is one expert over one link: the ports it uses carry its cost, disjoint moves run in parallel
    mig = Action(ActionKind.MIGRATE, ExpertKey(0, 1), 2.0, 1.0, src_dimm=0, dst_dimm=3)
    assert link_ports(mig, 4) == [(0, 2.0), (3, 2.0)]
    rel = Action(ActionKind.RELAYOUT, ExpertKey(0, 2), 2.0, 1.0, Layout.LOCALISED, dst_dimm=1)
    assert link_ports(rel, 4) == [(0, 0.5), (1, 2.0), (2, 0.5), (3, 0.5)]  # the whole expert enters DIMM 1
    back = Action(ActionKind.RELAYOUT, ExpertKey(0, 2), 2.0, 1.0, Layout.STRIPED, src_dimm=2)
    assert dict(link_ports(back, 4))[2] == 2.0 and link_ports(Action(ActionKind.PREFETCH, ExpertKey(0, 3), 1.0,
                                                                      1.0), 4) == []  # fmt: skip
    # two skewed DIMMs: their migrations use disjoint ports, both fit a window that one link could not hold twice
    states = [st_(0, C, Layout.LOCALISED, dimm=0, ndp=3.0), st_(1, C, Layout.LOCALISED, dimm=0, ndp=3.0),
              st_(2, C, Layout.LOCALISED, dimm=1, ndp=3.0), st_(3, C, Layout.LOCALISED, dimm=1, ndp=3.0)]  # fmt: skip
    plan = plan_actions(states, 4, 1.0, skew_ratio=1.0)
    assert [(a.src_dimm, a.dst_dimm) for a in plan.actions] == [(0, 2), (1, 3)]
    assert plan.dimm_link_s == 1.0 and plan.dimm_port_s == (1.0, 1.0, 1.0, 1.0)
    # a move longer than the window never fits, however many links are idle
    assert plan_actions([dataclasses.replace(s, migrate_s=1.5) for s in states], 4, 1.0, skew_ratio=1.0).actions == ()


def test_planner_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        plan_actions([st_(0, H), st_(0, W)], 2, 1.0)
    with pytest.raises(ConfigError, match="home DIMM"):
        plan_actions([st_(0, C, Layout.LOCALISED, dimm=3)], 2, 1.0)
    assert len(plan_actions([st_(0, C, Layout.STRIPED, dimm=-1)], 2, 1.0).actions) == 1  # striped: dimm ignored
    with pytest.raises(ConfigError):
        plan_actions([], 2, -1.0)
    with pytest.raises(ConfigError):
        plan_actions([], 2, 1.0, skew_ratio=0.5)
    with pytest.raises(ConfigError):
        plan_actions([], 2, 1.0, dimm_base_s=[1.0])
    with pytest.raises(ConfigError):
        st_(0, H, prefetch_s=-1.0)
    with pytest.raises(ConfigError):
        PathTimes(1, 1, 1, 1, 1, float("nan"))


def test_predictor_classes_feed_the_planner() -> None:
    p = LoadPredictor([0], 4, rule=ThresholdRule(hot_tokens=100, warm_tokens=10))
    p.update(0, np.array([300, 20, 1, 0]))
    states = [
        ExpertState(ExpertKey(0, e), int(h), False, "striped", 0, TIMES, 1, 1, 1)  # type: ignore[arg-type]
        for e, h in enumerate(p.classes(0))
    ]  # int codes and plain strings are accepted
    assert [s.heat for s in states] == [H, W, C, C] and states[0].layout is Layout.STRIPED
    kinds = {a.key.expert: a.kind for a in plan_actions(states, 2, 10.0).actions}
    assert kinds[0] is ActionKind.PREFETCH and kinds[2] is ActionKind.RELAYOUT and 1 not in kinds


# ---------------------------------------------------------------- properties


@st.composite
def planner_case(draw: st.DrawFn) -> tuple[list[ExpertState], int, float, int | None, float]:
    n_dimms = draw(st.integers(1, 6))
    n = draw(st.integers(0, 20))
    t = st.floats(0, 10, allow_nan=False)
    states = []
    for e in range(n):
        times = PathTimes(*(draw(t) for _ in range(6)))
        states.append(
            ExpertState(
                ExpertKey(draw(st.integers(0, 2)) * 100, e),
                draw(st.sampled_from(list(Heat))),
                draw(st.booleans()),
                draw(st.sampled_from(list(Layout))),
                draw(st.integers(0, n_dimms - 1)),
                times,
                draw(t),
                draw(t),
                draw(t),
            )
        )
    window = draw(st.floats(0, 20, allow_nan=False))
    slots = draw(st.none() | st.integers(0, 5))
    skew = draw(st.floats(1.0, 3.0))
    return states, n_dimms, window, slots, skew


@settings(max_examples=300, deadline=None)
@given(planner_case())
def test_plan_properties(case: tuple[list[ExpertState], int, float, int | None, float]) -> None:
    states, n_dimms, window, slots, skew = case
    plan = plan_actions(states, n_dimms, window, hbm_free_slots=slots, skew_ratio=skew)
    by_key = {s.key: s for s in states}
    pcie, port = 0.0, [0.0] * n_dimms
    for a in plan.actions:
        pcie += a.cost_s if a.link == "pcie" else 0.0
        for d, t in link_ports(a, n_dimms):
            port[d] += t
    assert pcie <= window and max(port) <= window  # never over the window, PCIe or any DIMM's link port
    assert plan.pcie_s == pcie and plan.dimm_port_s == pytest.approx(port)
    assert plan.dimm_link_s == pytest.approx(max(port))
    assert len({a.key for a in plan.actions}) == len(plan.actions)  # one action per expert: no conflicts
    assert all(a.benefit_s > 0 for a in plan.actions)
    if slots is not None:
        assert sum(a.kind is ActionKind.PREFETCH for a in plan.actions) <= slots
    after = list(states)
    for a in plan.actions:
        s = by_key[a.key]
        assert not s.in_hbm
        if a.kind is ActionKind.PREFETCH:
            assert s.heat is Heat.HOT
        elif a.kind is ActionKind.RELAYOUT:
            assert a.layout is not s.layout and (a.layout is Layout.LOCALISED) == (s.heat is Heat.COLD)
        else:
            assert s.heat is Heat.COLD and s.layout is Layout.LOCALISED and a.src_dimm == s.dimm != a.dst_dimm
        if a.dst_dimm is not None:  # apply the action and check the reported loads
            after[after.index(s)] = dataclasses.replace(s, layout=Layout.LOCALISED, dimm=a.dst_dimm)
    np.testing.assert_allclose(plan.dimm_load_after, dimm_loads(after, n_dimms), atol=1e-9)
    if not any(a.layout is Layout.LOCALISED for a in plan.actions):  # migrations alone never raise the max load
        assert max(plan.dimm_load_after) <= max(plan.dimm_load_before) + 1e-9
