"""Initial fast-tier placements (policies/placement.py)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies.placement import PLACEMENTS, by_frequency, by_layers, count_tokens, initial_placement
from moetier.policies.schedulers import SCHEDULERS, make_scheduler
from moetier.types import ExpertKey

K = ExpertKey


class Call(NamedTuple):  # the shape of traces.iter_calls' Call that placement reads
    layer: int
    ids: np.ndarray


def test_count_tokens_over_a_window() -> None:
    calls = [Call(1, np.array([[0, 2], [2, 3]])), Call(3, np.array([[1, 0]])), Call(1, np.array([[2, 0]]))]
    assert count_tokens(calls) == {K(1, 0): 2, K(1, 2): 3, K(1, 3): 1, K(3, 1): 1, K(3, 0): 1}
    with pytest.raises(ConfigError, match=r"shape \(2,\)"):
        count_tokens([Call(0, np.array([1, 2]))])


def test_by_frequency_hottest_first_then_spread() -> None:
    counts = {K(1, 2): 5, K(3, 1): 5, K(1, 0): 9, K(3, 3): 1}
    got = by_frequency([1, 3], 4, 6, counts)
    # ties (count 5, and the never-seen 0s) go by expert id, then layer: unseen experts spread over layers
    assert got == [K(1, 0), K(3, 1), K(1, 2), K(3, 3), K(3, 0), K(1, 1)]
    assert by_frequency([1, 3], 4, 100, counts)[:2] == [K(1, 0), K(3, 1)]
    assert len(by_frequency([1, 3], 4, 100, counts)) == 8  # never more than exists
    assert by_frequency([1, 3], 4, 0, counts) == []


def test_by_layers_whole_layers_last_first_like_llamacpp() -> None:
    assert by_layers([0, 2, 4], 3, 7) == [K(4, 0), K(4, 1), K(4, 2), K(2, 0), K(2, 1), K(2, 2)]  # 1 slot unused
    assert by_layers([0, 2, 4], 3, 4, from_end=False) == [K(0, 0), K(0, 1), K(0, 2)]
    assert by_layers([0, 2, 4], 3, 2) == []  # less than a layer: nothing
    assert len(by_layers([0, 2, 4], 3, 99)) == 9


def test_dispatch_and_errors() -> None:
    for name in SCHEDULERS:
        keys = initial_placement(make_scheduler(name).placement, [0, 1], 8, 8, {K(0, 5): 3})
        assert len(keys) == len(set(keys)) == 8
    assert initial_placement("layers", [0, 1], 8, 8) == [K(1, e) for e in range(8)]
    assert initial_placement("frequency", [0, 1], 8, 1, {K(0, 5): 3}) == [K(0, 5)]
    assert set(PLACEMENTS) == {"frequency", "layers"}
    with pytest.raises(ConfigError, match="unknown placement 'lfu'; known: frequency, layers"):
        initial_placement("lfu", [0], 8, 8)
    with pytest.raises(ConfigError, match="capacity must be >= 0"):
        by_layers([0], 8, -1)
    with pytest.raises(ConfigError, match="num_experts must be > 0"):
        by_frequency([0], 0, 1)
    with pytest.raises(ConfigError, match="layers must be distinct"):
        by_frequency([0, 0], 4, 1)
