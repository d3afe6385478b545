"""DynaExq precision policy: budget split (paper 3.5) and Algorithm 1 (paper 3.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import BudgetError
from moetier.policies.precision import (
    Decision,
    ExpertState,
    PrecisionController,
    order_switches,
    split_budget,
)
from moetier.types import ExpertKey

# --- split_budget ----------------------------------------------------------------------------


def used(n_hot, experts, hot, cold, reserve):
    return sum(n_hot[layer] * hot + (experts[layer] - n_hot[layer]) * cold for layer in experts) + reserve


def test_split_budget_example_remainder_to_first_layers():
    experts = {0: 8, 1: 8, 2: 8}
    # all cold: 24 * 10 + 5 = 245 ; each hot expert costs 30 more ; (345 - 245) // 30 = 3 ... + 2 spare
    assert split_budget(experts, 40, 10, 245 + 5 * 30 + 29, reserve=5) == {0: 2, 1: 2, 2: 1}
    assert split_budget(experts, 40, 10, 245, reserve=5) == {0: 0, 1: 0, 2: 0}
    assert split_budget(experts, 40, 10, 10**9, reserve=5) == experts  # everything hot


def test_split_budget_caps_small_layers_and_spreads_the_rest():
    experts = {4: 2, 1: 10, 9: 10}
    out = split_budget(experts, 3, 1, 22 + 2 * 15)  # 15 hot: layer 4 capped at 2, 13 over two layers
    assert out == {1: 7, 4: 2, 9: 6}


def test_split_budget_too_small_names_minimum():
    with pytest.raises(BudgetError, match="minimum budget is 245 B"):
        split_budget({0: 8, 1: 16}, 40, 10, 244, reserve=5)


@pytest.mark.parametrize(("hot", "cold"), [(10, 10), (5, 10)])
def test_split_budget_hot_not_larger_than_cold(hot, cold):
    with pytest.raises(ValueError, match="must exceed cold_bytes"):
        split_budget({0: 4}, hot, cold, 1000)


def test_split_budget_bad_sizes():
    with pytest.raises(ValueError, match="experts"):
        split_budget({0: 0}, 4, 1, 1000)
    with pytest.raises(ValueError, match=">= 0"):
        split_budget({0: 4}, 4, 1, 1000, reserve=-1)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.integers(0, 60), st.integers(1, 64), min_size=1, max_size=8),
    st.integers(0, 1000),
    st.integers(1, 1000),
    st.integers(0, 500),
    st.integers(0, 200_000),
)
def test_split_budget_fits_and_is_maximal(experts, cold, extra, reserve, slack):
    hot = cold + extra
    floor = sum(experts.values()) * cold + reserve
    out = split_budget(experts, hot, cold, floor + slack, reserve=reserve)
    assert sorted(out) == sorted(experts)
    assert all(0 <= out[layer] <= experts[layer] for layer in experts)
    assert used(out, experts, hot, cold, reserve) <= floor + slack
    if sum(out.values()) < sum(experts.values()):  # maximal: one more hot expert would not fit
        assert used(out, experts, hot, cold, reserve) + (hot - cold) > floor + slack
    uncapped = [out[layer] for layer in experts if out[layer] < experts[layer]]
    if uncapped:  # even spread: uncapped layers differ by at most one, and none is above a capped share
        assert max(uncapped) - min(uncapped) <= 1
    with pytest.raises(BudgetError, match=f"minimum budget is {floor} B"):
        split_budget(experts, hot, cold, floor - 1, reserve=reserve)


# --- controller: helpers ---------------------------------------------------------------------


def stream(rng, favoured, num_experts, k, n_tok, boost=6.0):
    """Synthetic router output: top-k without replacement, favoured experts `boost` times likelier."""
    p = np.ones(num_experts)
    p[list(favoured)] = boost
    keys = np.log(p) + rng.gumbel(size=(n_tok, num_experts))  # [T, E] Gumbel top-k
    ids = np.argsort(-keys, axis=1)[:, :k]  # [T, k]
    w = p[ids]
    return ids, w / w.sum(axis=1, keepdims=True)


def feed(ctl, rng, favoured, n_tok, k=2, chunk=32):
    for _ in range(n_tok // chunk):
        for layer in ctl.layers:
            ctl.observe(layer, *stream(rng, favoured[layer], ctl.hotness.num_experts, k, chunk))


def decide_checked(ctl, force=False):
    """decide() plus the invariants of one decision against the target states just before it."""
    before = {(layer, e): ctl.state(ExpertKey(layer, e)) for layer in ctl.layers for e in range(16)}
    dec = ctl.decide(force=force)
    for key in dec.upgrades:
        assert before[key] is ExpertState.LOW and ctl.state(key) is ExpertState.HIGH
    for key in dec.downgrades:
        assert before[key] is ExpertState.HIGH and ctl.state(key) is ExpertState.LOW
    moved = set(dec.upgrades) | set(dec.downgrades)
    for (layer, e), st_before in before.items():
        if ExpertKey(layer, e) not in moved:
            assert ctl.state(ExpertKey(layer, e)) is st_before  # target changes only through the decision
    assert len(set(dec.upgrades)) == len(dec.upgrades) and not set(dec.upgrades) & set(dec.downgrades)
    for layer in ctl.layers:
        assert len(ctl.hot_set(layer)) <= ctl.n_hot[layer]
    return dec


# --- controller: Algorithm 1 -----------------------------------------------------------------


def test_stationary_stream_converges_then_stays():
    rng = np.random.default_rng(0)
    favoured = {0: {3, 7, 11, 15}, 1: {0, 1, 2, 9}}
    ctl = PrecisionController({0: 4, 1: 4}, 16, alpha=0.99, period=128)
    for _ in range(40):
        feed(ctl, rng, favoured, 128)
        decide_checked(ctl)
    assert ctl.decisions == 40
    for layer in (0, 1):
        assert ctl.hot_set(layer) == favoured[layer]
        assert ctl.threshold(layer) is not None and ctl.threshold(layer) > 0
    late = ctl.history()[5:]
    assert all(r.promotions == 0 and r.demotions == 0 for r in late)  # no oscillation
    assert ctl.promotions - ctl.demotions == 8 == ctl.history()[-1].hot


def test_distribution_shift_is_followed_within_bounded_periods():
    rng = np.random.default_rng(1)
    old, new = {0: {3, 7, 11, 15}}, {0: {0, 1, 2, 5}}
    ctl = PrecisionController({0: 4}, 16, alpha=0.99, period=128, hysteresis=0.1)
    for _ in range(15):
        feed(ctl, rng, old, 128)
        decide_checked(ctl)
    assert ctl.hot_set(0) == old[0]
    before = ctl.promotions
    caught_up = None
    for i in range(15):
        feed(ctl, rng, new, 128)
        dec = decide_checked(ctl)
        assert [k.layer for k in dec.upgrades] == [0] * len(dec.upgrades)
        if caught_up is None and ctl.hot_set(0) == new[0]:
            caught_up = i + 1
    assert ctl.promotions - before >= 4
    assert caught_up is not None and caught_up <= 5
    assert ctl.hot_set(0) == new[0]
    assert all(r.promotions == r.demotions == 0 for r in ctl.history()[-5:])


def test_period_gating_force_and_warmup_threshold():
    ctl = PrecisionController({0: 2}, 4, alpha=0.5, period=4)
    assert ctl.threshold(0) is None
    ctl.observe(0, np.array([[0], [1], [2]]), np.ones((3, 1)))
    dec = ctl.decide()
    assert dec == Decision() and dec.empty and dec.step == -1 and ctl.decisions == 0
    assert ctl.pending_tokens == 3
    dec = ctl.decide(force=True)  # warmup ends now: tau = 2nd largest score
    scores = ctl.hotness.scores(0)  # [0.125, 0.25, 0.5, 0]
    assert ctl.threshold(0) == pytest.approx(0.25)
    assert dec.step == 0 and dec.downgrades == ()
    assert dec.upgrades == (ExpertKey(0, 2), ExpertKey(0, 1))  # hottest first
    assert scores[2] > scores[1]
    assert ctl.pending_tokens == 0 and ctl.decide().step == -1
    ctl.observe(0, np.array([[3], [3], [3], [0]]), np.ones((4, 1)))
    dec = ctl.decide()  # 4 tokens: runs; tau stays fixed
    assert ctl.threshold(0) == pytest.approx(0.25)
    s = ctl.hotness.scores(0)
    assert s[3] >= 0.25 and s[0] >= 0.25 and s[2] < 0.25
    assert dec.downgrades == (ExpertKey(0, 1), ExpertKey(0, 2))  # coldest first
    assert s[1] < s[2]
    assert set(dec.upgrades) == {ExpertKey(0, 0), ExpertKey(0, 3)}
    assert [(r.step, r.promotions, r.demotions, r.hot) for r in ctl.history()] == [(0, 2, 0, 2), (1, 2, 2, 2)]
    assert ctl.history()[1].tokens == 7


def test_never_routed_expert_is_never_hot_and_tau_gates():
    ctl = PrecisionController({0: 3}, 4, alpha=0.5, period=1)
    ctl.observe(0, np.array([[1]]), np.ones((1, 1)))
    dec = ctl.decide()
    assert dec.upgrades == (ExpertKey(0, 1),)  # tau = 0, but zero scores never qualify
    ctl.set_threshold(0, value=0.4)
    ctl.observe(0, np.array([[2], [0]]), np.ones((2, 1)))  # scores: 0:.5, 1:.125, 2:.25
    dec = ctl.decide()
    assert dec.downgrades == (ExpertKey(0, 1),) and dec.upgrades == (ExpertKey(0, 0),)
    assert ctl.hot_set(0) == {0}  # fewer than n_hot above tau: H is smaller (Algorithm 1)


def test_hysteresis_stops_near_tie_oscillation():
    def run(h):
        ctl = PrecisionController({0: 1}, 2, alpha=0.99, period=200, hysteresis=h)
        ctl.set_threshold(0, value=0.0)
        lead_a = np.array([0, 1] * 9 + [0, 0])  # 55% / 45% interleaved: ratio 1.22
        for phase in range(12):
            pattern = lead_a if phase % 2 == 0 else 1 - lead_a
            ids = np.tile(pattern.reshape(-1, 1), (10, 1))  # [200, 1]
            ctl.observe(0, ids, np.ones_like(ids, dtype=float))
            ctl.decide()
        return ctl

    assert run(0.0).promotions >= 10  # Algorithm 1 alone follows every lead change
    calm = run(0.5)
    assert calm.promotions == 1 and calm.demotions == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 16),
    st.sampled_from([0.0, 0.05, 0.5]),
    st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=12),
)
def test_invariants_under_random_streams(seed, n_hot, h, ops):
    rng = np.random.default_rng(seed)
    favoured = {2: set(rng.choice(16, 3, replace=False).tolist()), 5: {0}}
    ctl = PrecisionController({2: n_hot, 5: min(n_hot, 2)}, 16, alpha=0.9, period=16, hysteresis=h)
    for n_tok, force in ops:
        for layer in ctl.layers:
            ctl.observe(layer, *stream(rng, favoured[layer], 16, 3, n_tok))
        dec = decide_checked(ctl, force=force)
        if dec.step < 0:
            assert dec.empty
            continue
        if h == 0.0:  # exactly Algorithm 1: every HIGH scores >= every eligible LOW
            for layer in ctl.layers:
                s, tau = ctl.hotness.scores(layer), ctl.threshold(layer)
                hot = ctl.hot_set(layer)
                low_ok = [s[e] for e in range(16) if e not in hot and s[e] > 0 and s[e] >= tau]
                assert all(s[e] >= tau and s[e] > 0 for e in hot)
                if low_ok:
                    assert len(hot) == ctl.n_hot[layer] and min(s[e] for e in hot) >= max(low_ok)
    assert ctl.promotions - ctl.demotions == sum(len(ctl.hot_set(layer)) for layer in ctl.layers)


def test_hysteresis_zero_is_algorithm_1_computed_by_hand():
    """4 experts, 2 hot slots, alpha 0.5, a decision every 2 tokens, top-1 routing with the gate weights
    below. Every score and decision written out by hand from Algorithm 1 (UpdateHotness, then
    PrecisionSchedule with tau = the 2nd largest score at the first decision)."""
    ctl = PrecisionController({0: 2}, 4, alpha=0.5, period=2, hysteresis=0.0)

    def tokens(*routed: tuple[int, float]) -> None:
        ctl.observe(0, np.array([[e] for e, _ in routed]), np.array([[g] for _, g in routed]))

    tokens((0, 1.0), (1, 0.8))
    # t1: S0 = 0.5*0 + 0.5*1.0 = 0.5 ; t2: S0 = 0.25 (decay), S1 = 0.5*0.8 = 0.4
    assert ctl.hotness.scores(0) == pytest.approx([0.25, 0.4, 0.0, 0.0])
    d = ctl.decide()  # tau = 2nd largest = 0.25 ; H = {1, 0}
    assert ctl.threshold(0) == pytest.approx(0.25)
    assert d.upgrades == _keys(1, 0) and d.downgrades == ()
    tokens((2, 1.0), (2, 0.6))
    # t3: [0.125, 0.2, 0.5, 0] ; t4: [0.0625, 0.1, 0.25 + 0.3 = 0.55, 0]
    assert ctl.hotness.scores(0) == pytest.approx([0.0625, 0.1, 0.55, 0.0])
    d = ctl.decide()  # only expert 2 has S >= tau: H = {2}, fewer than K
    assert d.downgrades == _keys(0, 1) and d.upgrades == _keys(2) and ctl.hot_set(0) == {2}
    tokens((3, 1.0), (1, 1.0))
    # t5: [0.03125, 0.05, 0.275, 0.5] ; t6: [0.015625, 0.525, 0.1375, 0.25]
    assert ctl.hotness.scores(0) == pytest.approx([0.015625, 0.525, 0.1375, 0.25])
    d = ctl.decide()  # S >= 0.25: experts 1 and 3 ; expert 2 (0.1375) falls out
    assert d.downgrades == _keys(2) and d.upgrades == _keys(1, 3) and ctl.hot_set(0) == {1, 3}
    tokens((0, 0.9), (0, 0.9))
    # t7: [0.45 + 0.0078125, 0.2625, 0.06875, 0.125] ; t8: [0.678906.., 0.13125, 0.034375, 0.0625]
    d = ctl.decide()  # S >= 0.25: expert 0 only
    assert d.downgrades == _keys(3, 1) and d.upgrades == _keys(0) and ctl.hot_set(0) == {0}
    assert [(r.promotions, r.demotions, r.hot) for r in ctl.history()] == [(2, 0, 2), (1, 2, 1), (2, 1, 2), (1, 2, 1)]


def literal_algorithm_1(scores: np.ndarray, tau: float, k: int, state: set[int]) -> tuple[set[int], set[int]]:
    """Algorithm 1's PrecisionSchedule as printed: sort by S descending, H = top-K with S >= tau;
    returns (upgrades, downgrades). (Our controller also never promotes an expert of score 0.)"""
    order = sorted(range(len(scores)), key=lambda e: -scores[e])
    h = {e for e in order[:k] if scores[e] >= tau and scores[e] > 0}
    return h - state, state - h


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 8))
def test_hysteresis_zero_equals_literal_algorithm_1_on_random_streams(seed: int, k: int, period: int):
    rng = np.random.default_rng(seed)
    e_count, alpha = 8, 0.8
    ctl = PrecisionController({0: k}, e_count, alpha=alpha, period=period, hysteresis=0.0)
    s = np.zeros(e_count)  # the reference's own EMA, token by token (Algorithm 1 UpdateHotness)
    state: set[int] = set()
    tau = None
    for _ in range(12):
        ids = np.stack([rng.choice(e_count, 2, replace=False) for _ in range(period)])  # [T, 2]
        w = rng.random(ids.shape)  # distinct floats: no ties
        for t in range(period):
            s *= alpha
            s[ids[t]] += (1 - alpha) * w[t]
        ctl.observe(0, ids, w)
        if tau is None:
            tau = float(np.sort(s)[-k])
        ups, downs = literal_algorithm_1(s, tau, k, state)
        d = ctl.decide()
        assert ctl.hotness.scores(0) == pytest.approx(s)
        assert {x.expert for x in d.upgrades} == ups and {x.expert for x in d.downgrades} == downs
        state = (state | ups) - downs
        assert ctl.hot_set(0) == state


def trend_run(lookahead: float) -> tuple[list[set[int]], list[set[int]]]:
    """1 hot slot of 3, a decision every 20 tokens; expert 1's routing share rises 10 points per period
    (spread evenly over it), expert 0 takes the rest. Returns the hot set after each decision and the
    prediction made halfway through each period."""
    ctl = PrecisionController({0: 1}, 3, alpha=0.9, period=20, hysteresis=0.0, lookahead=lookahead)
    ctl.set_threshold(0, value=1e-9)
    sets, predicted = [], []
    for phase in range(8):
        ids = np.zeros((20, 1), dtype=np.int64)  # [20, 1]
        n1 = round(20 * (0.1 + 0.1 * phase))
        ids[np.linspace(0, 19, n1).round().astype(np.int64)] = 1
        ctl.observe(0, ids[:10], np.ones((10, 1)))
        predicted.append({k.expert for k in ctl.predict_upgrades()})
        ctl.observe(0, ids[10:], np.ones((10, 1)))
        ctl.decide()
        sets.append(ctl.hot_set(0))
    return sets, predicted


def test_prediction_follows_the_trend_and_lookahead_promotes_a_decision_early():
    plain, plain_pred = trend_run(0.0)
    ahead, ahead_pred = trend_run(1.0)
    assert plain.index({1}) == 5 and ahead.index({1}) == 4  # one decision earlier with lookahead 1
    assert plain[:5] == [{0}] * 5 and all(h == {1} for h in plain[5:])  # and no flapping after
    assert plain_pred[5] == {1} and not any(plain_pred[:5])  # halfway, named before its decision
    assert ahead_pred[3] == {1}  # with one period more of horizon, named a period earlier still
    with pytest.raises(ValueError, match="lookahead"):
        PrecisionController({0: 1}, 3, lookahead=-1.0)


def test_predict_upgrades_is_empty_before_the_first_decision_and_excludes_hot_experts():
    ctl = PrecisionController({0: 1}, 3, alpha=0.5, period=4, hysteresis=0.0)
    ctl.observe(0, np.array([[0], [0]]), np.ones((2, 1)))
    assert ctl.predict_upgrades() == ()
    ctl.observe(0, np.array([[0], [0]]), np.ones((2, 1)))
    ctl.decide()
    assert ctl.hot_set(0) == {0}
    ctl.observe(0, np.array([[2], [2]]), np.ones((2, 1)))  # 2 rises, 0 decays: 2 overtakes along the trend
    assert ctl.predict_upgrades() == (ExpertKey(0, 2),)
    assert ExpertKey(0, 0) not in ctl.predict_upgrades()


def test_initial_hot_and_seed():
    ctl = PrecisionController({0: 2, 1: 1}, 4, period=1, initial_hot={0: [1, 3]})
    assert ctl.hot_set(0) == {1, 3} and ctl.state(ExpertKey(0, 3)) is ExpertState.HIGH
    assert ctl.state(ExpertKey(1, 0)) is ExpertState.LOW
    ctl.seed({0: [0.9, 0.1, 0.0, 0.5], 1: [0.0, 0.2, 0.3, 0.0]})
    assert ctl.threshold(0) == pytest.approx(0.5) and ctl.threshold(1) == pytest.approx(0.3)
    dec = ctl.decide(force=True)
    assert dec.downgrades == (ExpertKey(0, 1),)
    assert dec.upgrades == (ExpertKey(0, 0), ExpertKey(1, 2))
    assert ctl.hot_set(0) == {0, 3} and ctl.hot_set(1) == {2}


def test_reset_target_after_failed_move():
    ctl = PrecisionController({0: 1}, 4, alpha=0.5, period=1)
    ctl.observe(0, np.array([[2]]), np.ones((1, 1)))
    assert ctl.decide().upgrades == (ExpertKey(0, 2),)
    ctl.reset_target(ExpertKey(0, 2), high=False)  # the promotion failed: 2 is still LOW
    assert ctl.hot_set(0) == set() and ctl.promotions == 1 and ctl.demotions == 0
    assert ctl.decide(force=True).upgrades == (ExpertKey(0, 2),)  # decided again
    ctl.observe(0, np.array([[1], [1]]), np.ones((2, 1)))
    assert ctl.decide().downgrades == (ExpertKey(0, 2),)
    ctl.reset_target(ExpertKey(0, 2), high=True)  # the demotion failed: layer holds 2 > n_hot HIGH
    assert ctl.hot_set(0) == {1, 2}
    ctl.set_threshold(0, value=0.0)  # both stay eligible: only n_hot decides
    dec = ctl.decide(force=True)  # the next decision demotes the colder surplus
    assert dec.downgrades == (ExpertKey(0, 2),) and dec.upgrades == () and ctl.hot_set(0) == {1}
    with pytest.raises(ValueError, match="out of range"):
        ctl.reset_target(ExpertKey(0, 7), high=True)


def test_n_hot_zero_layer_never_promotes():
    ctl = PrecisionController({0: 0}, 4, period=1)
    ctl.observe(0, np.array([[0, 1]]), np.ones((1, 2)))
    assert ctl.decide().empty and ctl.threshold(0) == float("inf")


def test_controller_validation():
    with pytest.raises(ValueError, match="n_hot 5 outside"):
        PrecisionController({0: 5}, 4)
    with pytest.raises(ValueError, match="period"):
        PrecisionController({0: 1}, 4, period=0)
    with pytest.raises(ValueError, match="hysteresis"):
        PrecisionController({0: 1}, 4, hysteresis=-0.1)
    with pytest.raises(ValueError, match="alpha"):
        PrecisionController({0: 1}, 4, alpha=1.0)
    with pytest.raises(ValueError, match="exceed n_hot"):
        PrecisionController({0: 1}, 4, initial_hot={0: [0, 1]})
    with pytest.raises(ValueError, match="unknown layer 3"):
        PrecisionController({0: 1}, 4, initial_hot={3: [0]})
    ctl = PrecisionController({0: 1}, 4)
    with pytest.raises(ValueError, match="unknown layer 2"):
        ctl.observe(2, np.array([[0]]), np.ones((1, 1)))
    with pytest.raises(ValueError, match="out of range"):
        ctl.state(ExpertKey(0, 4))
    with pytest.raises(ValueError, match="id 9 out of range"):
        ctl.observe(0, np.array([[9]]), np.ones((1, 1)))
    assert ctl.pending_tokens == 0


# --- order_switches: fitting a decision to the slots ---------------------------------------


def _keys(*experts: int) -> tuple[ExpertKey, ...]:
    return tuple(ExpertKey(0, e) for e in experts)


def test_order_switches_pairs_each_promotion_after_a_demotion() -> None:
    plan = order_switches(Decision(upgrades=_keys(1, 2), downgrades=_keys(7, 8), step=0), free_high_slots=0)
    assert plan.moves == (
        (ExpertKey(0, 7), ExpertState.LOW), (ExpertKey(0, 1), ExpertState.HIGH),
        (ExpertKey(0, 8), ExpertState.LOW), (ExpertKey(0, 2), ExpertState.HIGH),
    )  # fmt: skip
    assert not plan.rejected_upgrades and not plan.kept_high


def test_order_switches_uses_free_slots_first_and_keeps_needless_demotions_high() -> None:
    plan = order_switches(Decision(upgrades=_keys(1), downgrades=_keys(7, 8), step=0), free_high_slots=1)
    assert plan.moves == ((ExpertKey(0, 1), ExpertState.HIGH),)
    assert plan.kept_high == _keys(7, 8)
    plan = order_switches(Decision(upgrades=_keys(1, 2, 3), downgrades=_keys(7), step=0), free_high_slots=1)
    assert plan.rejected_upgrades == _keys(3)
    with pytest.raises(ValueError, match="free_high_slots"):
        order_switches(Decision(), -1)


def test_order_switches_with_a_transient_buffer_runs_promotions_first() -> None:
    up, down = ExpertState.HIGH, ExpertState.LOW
    plan = order_switches(Decision(upgrades=_keys(1, 2, 3), downgrades=_keys(7, 8, 9), step=0), 0, transient=2)
    assert plan.moves == (
        (ExpertKey(0, 1), up), (ExpertKey(0, 2), up),  # into the two transient slots
        (ExpertKey(0, 7), down), (ExpertKey(0, 3), up), (ExpertKey(0, 8), down), (ExpertKey(0, 9), down),
    )  # fmt: skip
    with pytest.raises(ValueError, match="transient"):
        order_switches(Decision(), 0, transient=-1)


@settings(max_examples=150, deadline=None)
@given(
    ups=st.integers(0, 6), downs=st.integers(0, 6), free=st.integers(0, 4), hot=st.integers(0, 6),
    transient=st.integers(0, 3),
)  # fmt: skip
def test_order_switches_never_needs_a_slot_it_does_not_have(
    ups: int, downs: int, free: int, hot: int, transient: int
) -> None:
    """Replaying the moves with hot slots = hot + free + transient and one spare low slot never runs out,
    and leaves the transient slots free."""
    decision = Decision(upgrades=_keys(*range(ups)), downgrades=_keys(*range(10, 10 + downs)), step=0)
    plan = order_switches(decision, free, transient)
    free_hi, free_lo = free + transient, 1
    for _, state in plan.moves:
        if state is ExpertState.HIGH:
            assert free_hi > 0
            free_hi, free_lo = free_hi - 1, free_lo + 1
        else:
            assert free_lo > 0
            free_hi, free_lo = free_hi + 1, free_lo - 1
    assert free_hi >= transient
    moved = {k for k, _ in plan.moves}
    assert moved | set(plan.rejected_upgrades) | set(plan.kept_high) == set(decision.upgrades) | set(
        decision.downgrades
    )
    assert len(moved) == len(plan.moves)
