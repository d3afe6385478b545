"""The trace-side history predictor (policies/route_history.py): learns a deterministic transition pattern
to 100% per distance, stays at chance on random routing, uses the same token's previous step, checks input."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies.route_history import RouteHistoryPredictor

E, K, L = 16, 2, 6


def _run(pred: RouteHistoryPredictor, route: object, steps: int, warm: int, tokens: int = 1) -> None:
    """Feed `steps` steps of route(step, layer) -> [tokens, K] ids, predicting d = 1..3 after each call;
    the accuracy counters are reset after `warm` steps."""
    for s in range(steps):
        if s == warm:
            pred.reset_stats()
        for layer in range(L):
            pred.feed(layer, route(s, layer))  # type: ignore[operator]
            for d in (1, 2, 3):
                if layer + d < L:
                    assert pred.predict(layer, d).shape == (tokens, K)


def test_learns_a_deterministic_cross_layer_pattern_to_100_percent() -> None:
    rng = np.random.default_rng(0)
    perms = [rng.permutation(E) for _ in range(L)]
    first: dict[int, np.ndarray] = {}

    def route(s: int, layer: int) -> np.ndarray:
        if layer == 0:
            first[s] = np.stack([rng.choice(E, K, replace=False) for _ in range(2)])  # [2 tokens, K]
        ids = first[s]
        for j in range(1, layer + 1):
            ids = perms[j][ids]
        return ids

    pred = RouteHistoryPredictor(range(L), E, K)
    _run(pred, route, 300, warm=100, tokens=2)
    st = pred.stats()
    assert all(st[d]["accuracy"] == 1.0 and st[d]["predicted"] > 0 for d in (1, 2, 3))


def test_is_at_chance_on_random_routing() -> None:
    rng = np.random.default_rng(1)
    pred = RouteHistoryPredictor(range(L), E, K)
    _run(pred, lambda s, layer: rng.choice(E, K, replace=False)[None], 600, warm=100)
    for d, v in pred.stats().items():
        assert abs(v["accuracy"] - K / E) < 0.04, (d, v)


def test_uses_the_same_tokens_previous_step() -> None:
    # every layer repeats what it routed one step earlier, with no cross-layer relation: temporal term only
    rng = np.random.default_rng(2)
    seq = {layer: [rng.choice(E, K, replace=False) for _ in range(8)] for layer in range(L)}
    pred = RouteHistoryPredictor(range(L), E, K)
    _run(pred, lambda s, layer: seq[layer][(s // 40) % 8][None], 400, warm=200)  # a new pattern every 40 steps
    assert all(v["accuracy"] > 0.9 for v in pred.stats().values())


def test_api_and_errors() -> None:
    pred = RouteHistoryPredictor([3, 5, 9], 4, 2, depth=2)
    pred.feed(3, [0, 1])
    assert pred.predict(3, 1).shape == (1, 2)
    assert sum(pred.predict_counts(3, 2).values()) == 2
    pred.feed(5, [[2, 3], [0, 1]])  # two tokens
    assert pred.predict(5, 2).shape == (2, 0) and pred.predict_counts(5, 2) == {}  # past the last MoE layer
    with pytest.raises(ConfigError, match="not one of"):
        pred.feed(4, [0, 1])
    with pytest.raises(ConfigError, match=r"\[0, 4\)"):
        pred.feed(9, [0, 7])
    with pytest.raises(ConfigError, match="distance"):
        pred.predict(3, 3)
    with pytest.raises(ConfigError, match="not fed"):
        RouteHistoryPredictor([0, 1], 4, 2).predict(0, 1)
    with pytest.raises(ConfigError, match="top_k"):
        RouteHistoryPredictor([0], 4, 5)
