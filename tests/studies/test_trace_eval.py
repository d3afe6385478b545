"""studies/trace_eval.py on synthetic and hand-made traces: the shuffled null keeps per-(layer, expert) counts
and destroys correlation, cache baselines and predictors give hand-counted figures, bad input is named."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.errors import ConfigError, TraceError
from moetier.policies.predictor import LoadPredictor
from moetier.studies import trace_eval as te
from moetier.studies.synthetic import SynthParams, generate
from moetier.traces import Call, iter_calls


def stream(rows: list[list[list[int]]]) -> list[Call]:
    """Batch-1 calls from rows[t][l] = token t's experts at layer l (layers 0..L-1, steps 1..N)."""
    out = []
    for t, per_layer in enumerate(rows):
        for layer, ids in enumerate(per_layer):
            a = np.array([ids], dtype=np.int64)  # [1, k]
            out.append(Call(t + 1, layer, a, np.full(a.shape, 1.0 / a.shape[1], np.float32), None))
    return out


def correlated_calls(temporal: float, steps: int = 300) -> list[Call]:
    p = SynthParams(num_layers=3, num_experts=16, top_k=2, temporal=temporal, layer_corr=0.9, seed=3)
    return iter_calls(generate(p, steps, prompt_len=4))


def test_shuffle_keeps_counts_and_call_shapes() -> None:
    calls = correlated_calls(0.9)
    null = te.shuffle_tokens(calls, seed=7)
    assert [(c.step, c.layer, c.ids.shape, c.scores.shape) for c in null] == \
        [(c.step, c.layer, c.ids.shape, c.scores.shape) for c in calls]  # fmt: skip
    real_counts, null_counts = te.expert_counts(calls, 16), te.expert_counts(null, 16)
    assert sorted(real_counts) == sorted(null_counts) == [0, 1, 2]
    for layer, cnt in real_counts.items():
        np.testing.assert_array_equal(cnt, null_counts[layer])
    for c in null:  # rows move whole: weights and scores travel with their ids
        np.testing.assert_allclose(np.take_along_axis(c.scores, c.ids, 1) / np.take_along_axis(c.scores, c.ids, 1)
                                   .sum(1, keepdims=True), c.weights, rtol=1e-5)  # fmt: skip
    again = te.shuffle_tokens(calls, seed=7)
    assert all(np.array_equal(a.ids, b.ids) for a, b in zip(null, again, strict=True))
    other = te.shuffle_tokens(calls, seed=8)
    assert not all(np.array_equal(a.ids, b.ids) for a, b in zip(null, other, strict=True))


def test_shuffle_destroys_temporal_and_layer_correlation() -> None:
    calls = correlated_calls(0.9)
    null = te.shuffle_tokens(calls, seed=0)
    real_prev, null_prev = te.prev_token_hits(calls, 16).hit_rate, te.prev_token_hits(null, 16).hit_rate
    assert real_prev > null_prev + 0.2
    x, xn = te.token_rows(calls), te.token_rows(null)
    co = te.next_layer_accuracy(x, te.predict_coactivation, 16, (1,))[1]
    co_null = te.next_layer_accuracy(xn, te.predict_coactivation, 16, (1,))[1]
    mf_null = te.next_layer_accuracy(xn, te.predict_most_frequent, 16, (1,))[1]
    assert co > co_null + 0.1
    assert abs(co_null - mf_null) < 0.08  # without layer correlation co-activation is popularity again


def test_prev_token_hits_by_hand() -> None:
    # one layer, k=2: {0,1} {1,2} {1,2} {3,4}: hits 0 + 1 + 2 + 0 = 3 of 8
    calls = stream([[[0, 1]], [[1, 2]], [[2, 1]], [[3, 4]]])
    res = te.prev_token_hits(calls, 8)
    assert (res.hits, res.accesses) == (3, 8) and res.hit_rate == pytest.approx(3 / 8)
    assert res.slots_per_layer == pytest.approx((0 + 2 + 2 + 2) / 4)
    # two layers interleaved: each layer compares with its own previous call only
    two = stream([[[0], [5]], [[0], [6]], [[1], [6]]])
    assert (te.prev_token_hits(two, 8).hits, te.prev_token_hits(two, 8).accesses) == (2, 6)


def test_most_frequent_hits_by_hand() -> None:
    # one layer, k=1, calls 0 0 1 1 1 0; counts before each call: {} {0:1} {0:2} {0:2,1:1} {0:2,1:2} {0:2,1:3};
    # one slot caches (ties to the lower id) none, 0, 0, 0, 0, 1: only call 2 hits
    seq = [0, 0, 1, 1, 1, 0]
    calls = stream([[[e]] for e in seq])
    assert te.most_frequent_hits(calls, 4, 1).hits == 1
    assert te.most_frequent_hits(calls, 4, 2).hits == 4  # both cached once seen: misses at the first 0 and 1
    with pytest.raises(ConfigError, match="slot"):
        te.most_frequent_hits(calls, 4, 0)


def test_load_predictor_wrappers() -> None:
    calls = correlated_calls(0.5, steps=80)
    layers = [0, 1, 2]
    pred = LoadPredictor(layers, 16)
    for c in calls:
        pred.update_routing(c.layer, c.ids)
    assert te.load_predictor_stats(calls, layers, 16) == pred.stats.as_dict()
    # a constant routing is predicted perfectly by the running counts and by the previous call
    const = stream([[[0, 1, 2, 3]]] * 10)
    for st in (te.running_count_stats(const, [0], 20), te.load_predictor_stats(const, [0], 20, alpha=1.0)):
        assert st["accuracy"] == 1.0 and st["calls"] == 9 and st["hot_recall"] == 1.0
    with pytest.raises(ConfigError, match="unknown layer 0"):
        te.running_count_stats(const, [1], 20)


def test_next_layer_predictors_by_hand() -> None:
    # layer 1 always repeats layer 0's experts shifted by 4; the stream alternates two patterns
    rows = [[[0, 1], [4, 5]] if t % 2 == 0 else [[2, 3], [6, 7]] for t in range(40)]
    x = te.token_rows(stream(rows))
    assert x.shape == (40, 2, 2)
    co = te.next_layer_accuracy(x, te.predict_coactivation, 8)
    assert set(co) == {1}  # d = 2, 3 exceed the layers
    assert co[1] == pytest.approx(38 / 39)  # token 1 sees pattern B first (no co-counts yet), then all right
    assert te.next_layer_accuracy(x, te.predict_prev_token, 8)[1] == 0.0  # alternation: the previous is wrong
    mf = te.next_layer_accuracy(x, te.predict_most_frequent, 8)[1]
    assert 0.0 < mf <= 0.55


def test_token_rows_and_predictor_shape_errors() -> None:
    calls = stream([[[0], [1]], [[0], [1]]])
    with pytest.raises(TraceError, match="different numbers of token rows"):
        te.token_rows(calls[:-1])
    with pytest.raises(ConfigError, match="expected"):
        te.next_layer_accuracy(te.token_rows(calls), lambda x, d, e: np.zeros((1, 1, 1), np.int64), 4)
    with pytest.raises(TraceError, match="out of range"):
        te.prev_token_hits(stream([[[9]]]), 4)
