"""Replay of an admitting policy (mrs-admit: transient slots, pin groups, bypass) and batched_calls."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_replay import random_calls

from moetier.errors import ConfigError, TraceError
from moetier.sim.cache_replay import batched_calls, replay
from moetier.traces import Call


def test_admitting_replay_counts() -> None:
    calls = random_calls(1, steps=60, layers=3, E=16, k=2, prefill=12)
    res = replay(calls, "mrs-admit", 0.25, num_experts=16, top_k=2)
    assert res.slots == 12 and res.hits + res.misses == res.accesses
    assert dict(res.options)["transient_slots"] == 2
    # every miss filled a free cached slot (10 = 12 - 2 transient, filled once), evicted one, or was bypassed
    assert res.misses == 10 + res.evictions + res.bypasses
    assert res.bypasses > 0 and res.as_dict()["bypasses"] == res.bypasses
    plain = replay(calls, "mrs", 0.25, num_experts=16, top_k=2)
    assert plain.bypasses == 0 and plain.evictions == plain.misses - 12


def test_no_transient_slots_when_everything_fits_or_too_few_slots() -> None:
    calls = random_calls(2, steps=30, layers=2, E=8, k=2)
    full = replay(calls, "mrs-admit", 1.0, num_experts=8, top_k=2)
    assert full.bypasses == 0 and full.evictions == 0
    tiny = replay(calls, "mrs-admit", 0.2, num_experts=8, top_k=2)  # 3 slots: 3 // 4 = 0 transient -> MRS
    assert tiny.bypasses == 0 and tiny.hits == replay(calls, "mrs", 0.2, num_experts=8, top_k=2).hits


def one(step: int, layer: int, expert: int) -> Call:
    scores = np.zeros((1, 4), dtype=np.float32)
    scores[0, expert] = 1.0
    return Call(step, layer, np.array([[expert]]), np.ones((1, 1), dtype=np.float32), scores)


def test_batched_calls_merges_offset_cursors() -> None:
    stream = [Call(0, 0, np.array([[0], [1]]), np.ones((2, 1), dtype=np.float32), None)]  # prefill: skipped
    stream += [one(s, layer, (s + layer) % 4) for s in range(1, 5) for layer in (0, 1)]
    out = batched_calls(stream, 2)
    assert [(c.step, c.layer) for c in out] == [(s, layer) for s in range(1, 5) for layer in (0, 1)]
    # cursors at steps 1 and 3 of the 4-step stream, advancing together and wrapping
    assert [c.ids[:, 0].tolist() for c in out if c.layer == 0] == [[1, 3], [2, 0], [3, 1], [0, 2]]
    assert out[0].scores is not None and out[0].scores.shape == (2, 4)
    assert len(batched_calls(stream, 3, steps=7)) == 14
    assert [c.ids.tolist() for c in batched_calls(stream, 1)] == [c.ids.tolist() for c in stream[1:]]
    with pytest.raises(ConfigError, match="batch"):
        batched_calls(stream, 0)
    with pytest.raises(TraceError, match="batch-1"):
        batched_calls([Call(1, 0, np.array([[0], [1]]), np.ones((2, 1), dtype=np.float32), None)], 2)
