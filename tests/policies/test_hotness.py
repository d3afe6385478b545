"""EMA hotness (DynaExq eq. 2): closed form equals the per-token loop, passive decay, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.policies.hotness import EmaHotness, Hotness


def naive(scores: np.ndarray, ids: np.ndarray, weights: np.ndarray, alpha: float) -> np.ndarray:
    """Algorithm 1 UpdateHotness, one token at a time."""
    s = scores.copy()
    for t in range(ids.shape[0]):
        g = np.zeros_like(s)
        g[ids[t]] = weights[t]
        s = alpha * s + (1 - alpha) * g  # selected: a*S + (1-a)*g ; others: a*S
    return s


@st.composite
def routing(draw):
    num_experts = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(4, num_experts)))
    n_tok = draw(st.integers(0, 60))
    seed = draw(st.integers(0, 2**32 - 1))
    alpha = draw(st.floats(0.01, 0.99))
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n_tok, num_experts)), axis=1)[:, :k]  # [T, k] distinct per row
    weights = rng.random((n_tok, k))
    return num_experts, alpha, ids, weights


@settings(max_examples=100, deadline=None)
@given(routing(), st.integers(0, 60))
def test_closed_form_equals_naive_loop(case, split):
    num_experts, alpha, ids, weights = case
    hot = EmaHotness([3], num_experts, alpha)
    start = np.random.default_rng(split).random(num_experts)
    hot.load({3: start})
    split = min(split, ids.shape[0])
    hot.update(3, ids[:split], weights[:split])  # two calls == one stream
    hot.update(3, ids[split:], weights[split:])
    np.testing.assert_allclose(hot.scores(3), naive(start, ids, weights, alpha), rtol=1e-10, atol=1e-12)
    assert hot.tokens_seen == ids.shape[0]


def test_never_routed_is_zero_and_passive_decay_is_geometric():
    alpha = 0.9
    hot = EmaHotness([0, 1], 4, alpha)
    hot.update(0, np.array([[2, 1]]), np.array([[0.75, 0.25]]))
    s0 = hot.scores(0)
    assert s0[2] == pytest.approx(0.1 * 0.75) and s0[1] == pytest.approx(0.1 * 0.25)
    assert s0[0] == 0.0 and s0[3] == 0.0
    for n in (1, 5, 40):
        hot.update(0, np.full((n, 1), 3), np.ones((n, 1)))  # expert 2 never routed again
    decayed = hot.scores(0)
    assert decayed[2] == pytest.approx(0.1 * 0.75 * alpha**46, rel=1e-12)
    assert decayed[0] == 0.0  # never routed: exactly zero
    assert (hot.scores(1) == 0).all()  # other layer untouched


def test_long_stream_no_overflow_and_converges():
    hot = EmaHotness([0], 3, 0.5)
    n = 5000  # 0.5**4999 underflows to 0: harmless
    ids = np.zeros((n, 1), dtype=np.int64)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        hot.update(0, ids, np.ones((n, 1)))
    s = hot.scores(0)
    assert np.isfinite(s).all()
    assert s[0] == pytest.approx(1.0) and s[1] == 0.0
    hot = EmaHotness([0], 3, 0.999)
    hot.update(0, np.zeros((20000, 1), dtype=np.int32), np.full((20000, 1), 0.5))
    assert hot.scores(0)[0] == pytest.approx(0.5 * (1 - 0.999**20000), rel=1e-9)


def test_snapshot_scores_copy_and_token_counts():
    hot = EmaHotness([5, 7], 3, 0.5)
    assert isinstance(hot, Hotness)  # structural: an MRS or frequency tracker fits the same slot
    hot.update(5, np.array([[0], [1]]), np.array([[1.0], [1.0]]))
    hot.update(7, np.array([[2]]), np.array([[1.0]]))
    snap = hot.snapshot()
    assert snap == {5: [0.25, 0.5, 0.0], 7: [0.0, 0.0, 0.5]}
    hot.scores(5)[:] = 99  # a copy
    assert hot.scores(5).tolist() == [0.25, 0.5, 0.0]
    assert hot.tokens_seen == 2 and hot.layer_tokens(7) == 1
    hot.update(5, np.zeros((0, 2), dtype=np.int64), np.zeros((0, 2)))  # empty call: no-op
    assert hot.snapshot() == snap


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.5, 1.5, float("nan")])
def test_alpha_outside_open_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        EmaHotness([0], 4, alpha)


def test_constructor_validation():
    with pytest.raises(ValueError, match="at least one layer"):
        EmaHotness([], 4, 0.9)
    with pytest.raises(ValueError, match="duplicates"):
        EmaHotness([1, 1], 4, 0.9)
    with pytest.raises(ValueError, match="num_experts"):
        EmaHotness([0], 0, 0.9)


@pytest.mark.parametrize(
    ("ids", "weights", "match"),
    [
        ([0, 1], [0.5, 0.5], r"shape \[T, k\]"),
        ([[0, 1]], [[0.5]], "does not match"),
        ([[0, 4]], [[0.5, 0.5]], "id 4 out of range"),
        ([[-2, 0]], [[0.5, 0.5]], "id -2 out of range"),
        ([[-1, 0]], [[0.5, 0.5]], r"skipped routing pair \(id -1\) must have weight 0"),
        ([[0, 1], [2, 2]], [[0.5, 0.5], [0.5, 0.5]], "token 1 selects an expert twice"),
        ([[0, 1]], [[0.5, float("nan")]], "NaN"),
        ([[0, 1]], [[0.5, -0.1]], ">= 0"),
        ([[0.0, 1.0]], [[0.5, 0.5]], "integers"),
    ],
)
def test_bad_routing_raises(ids, weights, match):
    hot = EmaHotness([0], 4, 0.9)
    with pytest.raises(ValueError, match=match):
        hot.update(0, np.array(ids), np.array(weights))
    assert hot.tokens_seen == 0 and (hot.scores(0) == 0).all()


def test_unknown_layer_and_bad_load():
    hot = EmaHotness([0, 2], 3, 0.9)
    with pytest.raises(ValueError, match="unknown layer 1"):
        hot.update(1, np.array([[0]]), np.array([[1.0]]))
    with pytest.raises(ValueError, match="unknown layer 1"):
        hot.scores(1)
    with pytest.raises(ValueError, match="expected 3 scores"):
        hot.load({0: [1.0, 2.0]})
    with pytest.raises(ValueError, match="finite and >= 0"):
        hot.load({0: [0.1, 0.2, 0.3], 2: [1.0, -1.0, 0.0]})
    assert (hot.scores(0) == 0).all()  # a bad layer leaves every layer untouched
