"""Impact-driven prefetch choice, router-score prediction, and the prefetch counters (policies/prefetch.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import ConfigError
from moetier.policies.prefetch import PrefetchStats, choose_prefetch, predicted_counts, predicted_layers
from moetier.policies.schedule_base import ExpertWork
from moetier.policies.schedulers import make_scheduler
from moetier.types import ExpertKey

K = ExpertKey
HY = make_scheduler("hybrimoe")


def ew(layer: int, e: int, tokens: int, cached: bool, fast: float, slow: float | None, move: float) -> ExpertWork:
    return ExpertWork(K(layer, e), tokens, cached, fast, slow, move)


def two_layers() -> dict[int, list[ExpertWork]]:
    """Layer 10: a heavy miss (moved, ends at 1.1) and a light one (CPU, 0.5): caching the heavy one saves
    0.6 per link second (makespan 1.1 -> 0.5), then the light one 0.3 (0.5 -> 0.2; GPU 0.1 each).
    Layer 11: one miss, on the CPU at 0.8, moves for 2.0: caching saves 0.7 over 2 s = 0.35 per second."""
    return {
        10: [ew(10, 0, 4, False, 0.1, 2.0, 1.0), ew(10, 1, 1, False, 0.1, 0.5, 1.0)],
        11: [ew(11, 0, 2, False, 0.1, 0.8, 2.0)],
    }


def test_greedy_by_gain_per_link_second() -> None:
    layers = two_layers()
    assert HY.schedule(layers[10]).makespan == pytest.approx(1.1)
    assert choose_prefetch(layers, HY, 10.0, 8) == [K(10, 0), K(11, 0), K(10, 1)]
    assert choose_prefetch(layers, HY, 10.0, 1) == [K(10, 0)]  # max_experts
    assert choose_prefetch(layers, HY, 3.5, 8) == [K(10, 0), K(11, 0)]  # then 0.5 s left: nothing fits
    assert choose_prefetch(layers, HY, 2.0, 8) == [K(10, 0), K(10, 1)]  # layer 11's move does not fit; skip it
    assert choose_prefetch(layers, HY, 0.5, 8) == []
    assert choose_prefetch(layers, HY, 10.0, 0) == [] and choose_prefetch({}, HY, 10.0, 8) == []


def test_only_makespan_reductions_count() -> None:
    # a fast CPU hides the misses behind the GPU's cached work: caching one shortens nothing
    layer = [ew(0, 0, 8, True, 3.0, 9.0, 1.0), ew(0, 1, 1, False, 0.1, 0.5, 1.0), ew(0, 2, 1, False, 0.1, 0.5, 1.0)]
    assert choose_prefetch({0: layer}, HY, 10.0, 8) == []
    # with the kTransformers mapping the same misses cost CPU time only when the CPU is the bottleneck
    layer2 = [ew(0, 1, 1, False, 0.1, 0.5, 1.0), ew(0, 2, 2, False, 0.1, 0.7, 1.0)]
    assert choose_prefetch({0: layer2}, make_scheduler("ktransformers"), 10.0, 8) == [K(0, 2), K(0, 1)]


def test_identical_experts_are_picked_in_work_order_and_cached_or_shared_never() -> None:
    layer = [ew(5, -1, 4, True, 0.2, 1.0, 3.0)] + [ew(5, e, 1, e == 7, 0.01, 0.3, 0.25) for e in (9, 3, 7, 4)]
    picks = choose_prefetch({5: layer}, HY, 10.0, 8)
    assert HY.schedule(layer).makespan == pytest.approx(0.51)  # the CPU computes the three misses
    assert picks == [K(5, 9), K(5, 3), K(5, 4)]
    assert choose_prefetch({5: layer}, HY, 10.0, 8) == picks  # deterministic


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="budget"):
        choose_prefetch(two_layers(), HY, -1.0, 8)
    with pytest.raises(ConfigError, match="max_experts"):
        choose_prefetch(two_layers(), HY, 1.0, -1)
    with pytest.raises(ConfigError, match="layer 3 holds experts of another layer"):
        choose_prefetch({3: two_layers()[10]}, HY, 1.0, 8)


@st.composite
def predicted(draw: st.DrawFn) -> dict[int, list[ExpertWork]]:
    out = {}
    has_slow = draw(st.booleans())
    t = st.floats(0.001, 5.0)
    for layer in draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True)):
        n = draw(st.integers(1, 10))
        out[layer] = [
            ew(layer, e, draw(st.integers(1, 50)), draw(st.booleans()), draw(t), draw(t) if has_slow else None, draw(t))
            for e in range(n)
        ]
    return out


@settings(max_examples=150, deadline=None)
@given(predicted(), st.floats(0.0, 10.0), st.integers(0, 6), st.sampled_from(["hybrimoe", "gpu-lru", "fiddler"]))
def test_choice_properties(layers: dict[int, list[ExpertWork]], budget: float, mx: int, name: str) -> None:
    sched = make_scheduler(name)
    picks = choose_prefetch(layers, sched, budget, mx)
    by_key = {w.key: w for ws in layers.values() for w in ws}
    assert len(picks) == len(set(picks)) <= mx
    assert all(not by_key[k].cached and k.expert >= 0 for k in picks)
    assert sum(by_key[k].move_s for k in picks) <= budget + 1e-9
    if picks:  # the first pick shortens its layer's makespan
        lay = layers[picks[0].layer]
        after = [dataclasses.replace(w, cached=True) if w.key == picks[0] else w for w in lay]
        assert sched.schedule(after).makespan < sched.schedule(lay).makespan


def test_predicted_counts_top_k_per_token() -> None:
    scores = np.array([[0.1, 0.5, 0.3, 0.1], [0.6, 0.1, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])  # [T=3, E=4]
    # token 0 -> {1, 2}, token 1 -> {0, 2}, token 2 (all tied) -> the lower ids {0, 1}
    assert predicted_counts(scores, 2) == {0: 2, 1: 2, 2: 2}
    assert predicted_counts(scores[0], 1) == {1: 1}  # one token as [E]
    assert predicted_layers({4: scores, 5: scores[:1]}, 1) == {4: {1: 1, 0: 2}, 5: {1: 1}}
    with pytest.raises(ConfigError, match=r"top_k must be in 1\.\.4"):
        predicted_counts(scores, 5)
    with pytest.raises(ConfigError, match=r"\[T, E\]"):
        predicted_counts(np.zeros((2, 2, 2)), 1)
    with pytest.raises(ConfigError, match="NaN"):
        predicted_counts(np.array([np.nan, 1.0]), 1)


def test_prefetch_stats() -> None:
    st_ = PrefetchStats()
    assert st_.as_dict()["accuracy"] == 0.0 and st_.as_dict()["used_frac"] == 0.0
    st_.record_prediction([K(1, 0), K(1, 1), K(1, 2)], [K(1, 1), K(1, 2), K(1, 5)])
    st_.record_prediction([K(2, 0)], [K(2, 3)])
    st_.issued, st_.used = 4, 3
    assert st_.as_dict() == {
        "predicted": 4, "correct": 2, "issued": 4, "used": 3, "accuracy": 0.5, "used_frac": 0.75,
        "accuracy_by_distance": {}, "predicted_by_distance": {},
    }  # fmt: skip
    st_.record_distance(2, [K(1, 0), K(1, 1)], [K(1, 1)])
    st_.record_distance(1, [K(1, 1)], [K(1, 1)])
    st_.record_distance(2, [K(2, 0), K(2, 4)], [K(2, 3)])
    d = st_.as_dict()
    assert d["accuracy_by_distance"] == {"1": 1.0, "2": 0.25} and d["predicted_by_distance"] == {"1": 1, "2": 4}
    assert d["predicted"] == 4  # the per-distance records leave the nearest-prediction counters alone
