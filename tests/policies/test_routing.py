"""policies/routing.py: the per-token reduction (top-k cap, weight threshold, renormalisation), the router of a
pruned model, and REAP's pruning choice, against routings computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.policies.routing import NO_EXPERT, choose_pruned, reap_saliency, reduce_routing, route_pruned


def _routing() -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[3, 1, 7, 0], [2, 5, 4, 6]], dtype=np.int32)
    w = np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.3, 0.2]], dtype=np.float32)
    return ids, w


def test_noop_leaves_the_routing_bit_for_bit() -> None:
    ids, w = _routing()
    i0, w0 = ids.copy(), w.copy()
    assert reduce_routing(ids, w, 0.0, 0, True) == 0
    assert reduce_routing(ids, w, 0.0, 4, False) == 0
    assert np.array_equal(ids, i0) and np.array_equal(w, w0)


def test_cap_keeps_the_heaviest_in_place_and_renormalises() -> None:
    ids, w = _routing()
    assert reduce_routing(ids, w, 0.0, 2, True) == 4
    assert ids.tolist() == [[3, 1, NO_EXPERT, NO_EXPERT], [2, NO_EXPERT, 4, NO_EXPERT]]  # ties: earlier position
    np.testing.assert_allclose(w[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(w[1], [0.25 / 0.55, 0, 0.3 / 0.55, 0], rtol=1e-6)


def test_threshold_on_renormalised_weights_without_renormalising() -> None:
    ids = np.array([[0, 1, 2, 3]], dtype=np.int32)
    w = np.array([[0.2, 0.1, 0.06, 0.04]], dtype=np.float32)  # renormalised: 0.5, 0.25, 0.15, 0.1
    assert reduce_routing(ids, w, 0.2, 0, False) == 2
    assert ids.tolist() == [[0, 1, NO_EXPERT, NO_EXPERT]]
    assert w[0].tolist() == pytest.approx([0.2, 0.1, 0.0, 0.0])


def test_the_heaviest_pair_is_always_kept() -> None:
    ids = np.array([[4, 5, 6, 7]], dtype=np.int32)
    w = np.full((1, 4), 0.25, dtype=np.float32)
    reduce_routing(ids, w, 0.9, 0, True)
    assert ids.tolist() == [[4, NO_EXPERT, NO_EXPERT, NO_EXPERT]]
    assert w[0, 0] == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.floats(0.0, 0.99), st.integers(0, 8), st.booleans(), st.integers(0, 99))
def test_reduction_invariants(t: int, k: int, thr: float, cap: int, renorm: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(16)[:k] for _ in range(t)]).astype(np.int32)
    w = rng.dirichlet(np.ones(k), size=t).astype(np.float32)
    i0, w0 = ids.copy(), w.copy()
    reduce_routing(ids, w, thr, cap, renorm)
    kept = ids >= 0
    assert kept.any(axis=1).all()  # every token computes an expert
    assert np.array_equal(ids[kept], i0[kept])  # kept pairs keep their place
    assert (w[~kept] == 0).all()
    if 0 < cap < k:
        assert (kept.sum(axis=1) <= cap).all()
    heaviest = w0.argmax(axis=1)
    assert kept[np.arange(t), heaviest].all()
    if renorm:
        np.testing.assert_allclose(w.sum(axis=1), w0.sum(axis=1), rtol=1e-5)
    else:
        assert np.array_equal(w[kept], w0[kept])


def test_route_pruned_is_the_router_without_the_pruned_experts() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 8)).astype(np.float32)
    pruned = np.zeros(8, dtype=np.bool_)
    pruned[[1, 6]] = True
    ids, w = route_pruned(logits, pruned, 3, "softmax_topk", True)
    for t in range(5):
        keep = [e for e in range(8) if not pruned[e]]
        p = np.exp(logits[t, keep] - logits[t, keep].max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:3]
        assert ids[t].tolist() == [keep[j] for j in top]
        np.testing.assert_allclose(w[t], p[top] / p[top].sum(), rtol=1e-2)  # weights rounded to bf16
        assert not pruned[ids[t]].any()
    # nothing pruned: the plain router (softmax, top-k, renormalised)
    ids0, w0 = route_pruned(logits, np.zeros(8, dtype=np.bool_), 3, "softmax_topk_renorm", True)
    assert ids0.tolist() == np.argsort(-logits, axis=1, kind="stable")[:, :3].tolist()
    np.testing.assert_allclose(w0.sum(axis=1), 1.0, rtol=1e-6)


def test_reap_choice_prunes_the_least_salient_up_to_e_minus_k() -> None:
    sums = np.array([4.0, 0.0, 1.0, 9.0, 2.0, 0.5])
    tokens = np.array([2, 0, 4, 3, 1, 1])
    s = reap_saliency(sums, tokens)
    assert s.tolist() == [2.0, 0.0, 0.25, 3.0, 2.0, 0.5]
    assert choose_pruned({3: s}, 0.5, 2) == {3: [1, 2, 5]}
    assert choose_pruned({3: s}, 0.9, 2) == {3: [0, 1, 2, 5]}  # at most E - k = 4


def test_hotness_and_token_counts_skip_the_pairs_an_override_dropped() -> None:
    from moetier.policies.costmodel import token_counts
    from moetier.policies.hotness import EmaHotness, check_routing

    ids = np.array([[3, NO_EXPERT, 5], [NO_EXPERT, NO_EXPERT, 3]])
    w = np.array([[0.6, 0.0, 0.4], [0.0, 0.0, 1.0]])
    check_routing(ids, w, 8)
    with pytest.raises(ValueError, match="weight 0"):
        check_routing(ids, np.array([[0.6, 0.1, 0.3], [0.0, 0.0, 1.0]]), 8)
    with pytest.raises(ValueError, match="out of range"):
        check_routing(np.array([[-2, 1]]), np.array([[0.5, 0.5]]), 8)
    h = EmaHotness([0], 8, 0.5)
    h.update(0, ids, w)
    s = h.scores(0)
    assert s[3] > 0 and s[5] > 0 and s[7] == 0 and s.sum() == pytest.approx(0.5 * 0.5 * 1.0 + 0.5 * 1.0)
    assert token_counts(ids.tolist()) == {3: 2, 5: 1}
