"""Cache-only trace replay: known hit counts, count invariants, ratio bounds, scores fallback, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier import traces
from moetier.errors import ConfigError, TraceError
from moetier.policies import CACHE_POLICIES, LRUPolicy
from moetier.sim.cache_replay import ALL_POLICIES, call_scores, parse_policies, replay, replay_trace, slots_for
from moetier.traces import Call, TraceRecorder


def call(step: int, layer: int, ids: list[list[int]], num_experts: int, scores: bool = True) -> Call:
    """A call whose scores put 0.9 on each token's first expert and spread 0.1 over the rest."""
    ids_a = np.array(ids, dtype=np.int64)  # [T, k]
    w = np.full(ids_a.shape, 1.0 / ids_a.shape[1], dtype=np.float32)  # [T, k]
    s = None
    if scores:
        s = np.full((len(ids), num_experts), 0.1 / max(1, num_experts - 1), dtype=np.float32)  # [T, E]
        s[np.arange(len(ids)), ids_a[:, 0]] = 0.9
    return Call(step, layer, ids_a, w, s)


def random_calls(seed: int, steps: int, layers: int, E: int, k: int, prefill: int = 0) -> list[Call]:
    """Skewed routing with scores; step 0 is a prefill chunk of `prefill` tokens when > 0."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.5), size=layers)  # [L, E]
    out = []
    for step in range(steps):
        T = prefill if (step == 0 and prefill) else 1
        for layer in range(layers):
            logits = np.log(pop[layer] + 1e-9) + rng.gumbel(size=(T, E))  # [T, E]
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            ids = np.argsort(-p, axis=1)[:, :k]  # [T, k]
            out.append(Call(step, layer, ids, np.take_along_axis(p, ids, 1).astype(np.float32),
                            p.astype(np.float32)))  # fmt: skip
    return out


def test_lru_known_hits() -> None:
    # E=4, one layer, ratio 0.5 -> 2 slots; single-expert calls 0 1 0 2 0 1
    calls = [call(i + 1, 0, [[e]], 4) for i, e in enumerate([0, 1, 0, 2, 0, 1])]
    res = replay(calls, "lru", 0.5, num_experts=4)
    assert (res.slots, res.total_experts, res.accesses, res.hits, res.evictions) == (2, 4, 6, 2, 2)
    # Belady: keeps 0 and evicts 1 for 2 ... same here; LFU: 0 (count 3) stays, too
    assert replay(calls, "belady", 0.5, num_experts=4).hits == 2
    assert replay(calls, "lfu", 0.5, num_experts=4).hits == 2


def test_lfu_beats_lru_on_a_scan() -> None:
    # a hot expert 0 between scans of cold ones; 2 slots: LRU evicts 0 at each scan pair, LFU keeps it
    seq = [0, 1, 2, 0, 3, 4, 0, 5, 6, 0]
    calls = [call(i + 1, 0, [[e]], 8) for i, e in enumerate(seq)]
    assert replay(calls, "lru", 0.25, num_experts=8).hits == 0
    assert replay(calls, "lfu", 0.25, num_experts=8).hits == 2  # the 3rd and 4th access of 0


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_counts_are_consistent(policy: str) -> None:
    calls = random_calls(1, steps=40, layers=3, E=16, k=2, prefill=12)
    res = replay(calls, policy, 0.25, num_experts=16, top_k=2)
    unique = sum(len(np.unique(c.ids)) for c in calls)
    assert res.accesses == unique
    assert res.hits + res.misses == res.accesses
    assert sum(h.accesses for h in res.layers) == res.accesses
    assert sum(h.hits for h in res.layers) == res.hits
    decode = [c for c in calls if c.step > 0]
    assert res.decode_accesses == sum(len(np.unique(c.ids)) for c in decode)
    assert 0 <= res.decode_hits <= res.hits
    assert res.slots == 12  # floor(0.25 * 48)
    assert res.evictions == res.misses - res.slots  # the cache fills once, then every miss evicts
    d = res.as_dict()
    assert d["misses"] == res.misses and set(d["per_layer"]) == {"0", "1", "2"}


def test_belady_is_an_upper_bound_and_full_cache_only_cold_misses() -> None:
    calls = random_calls(2, steps=60, layers=2, E=12, k=3)
    rates = {p: replay(calls, p, 0.25, num_experts=12, top_k=3).hit_rate for p in ALL_POLICIES}
    assert rates["belady"] >= max(rates.values()) - 1e-12
    everything = replay(calls, "lru", 1.0, num_experts=12)
    distinct = len({(c.layer, int(e)) for c in calls for e in np.unique(c.ids)})
    assert everything.misses == distinct and everything.evictions == 0


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.01, float("nan")])
def test_ratio_bounds(ratio: float) -> None:
    calls = [call(1, 0, [[0]], 4)]
    with pytest.raises(ConfigError, match=r"cache ratio must lie in \(0, 1\]"):
        replay(calls, "lru", ratio, num_experts=4)


def test_tiny_ratio_gives_one_slot_and_oversized_calls_still_fit() -> None:
    assert slots_for(0.001, 100) == 1
    assert slots_for(0.5, 7) == 3
    calls = [call(0, 0, [[0, 1, 2], [3, 1, 2]], 8), call(1, 0, [[3, 0, 1]], 8)]  # a call of 4 experts, 1 slot
    res = replay(calls, "mrs", 0.125, num_experts=8, top_k=3)
    assert res.slots == 1 and res.accesses == 7 and res.hits == 1  # expert 3 fetched last in call 0, hit in call 1


def test_victim_never_from_the_current_call(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[set[Any], set[Any]]] = []
    current: set[Any] = set()

    class Spy(LRUPolicy):
        def on_route(self, layer: int, scores: Any) -> None:
            current.clear()

        def on_insert(self, key: Any) -> None:
            current.add(key)
            super().on_insert(key)

        def on_access(self, key: Any) -> None:
            current.add(key)
            super().on_access(key)

        def victim(self, candidates: Any) -> Any:
            seen.append((set(candidates), set(current)))
            return super().victim(candidates)

    monkeypatch.setitem(CACHE_POLICIES, "spy", Spy)
    calls = random_calls(3, steps=30, layers=2, E=8, k=3)
    res = replay(calls, "spy", 0.25, num_experts=8)
    assert res.evictions == len(seen) > 0
    for cands, in_call in seen:
        assert cands and not (cands & in_call)


def test_scores_fallback_uses_gate_weights() -> None:
    with_scores = random_calls(4, steps=30, layers=2, E=8, k=2)
    bare = [Call(c.step, c.layer, c.ids, c.weights, None) for c in with_scores]
    # scores equal to the scattered gate weights: the fallback must give the same replay
    scattered = []
    for c in with_scores:
        s = np.zeros((c.ids.shape[0], 8), dtype=np.float32)  # [T, E]
        np.put_along_axis(s, c.ids, c.weights, axis=1)
        scattered.append(Call(c.step, c.layer, c.ids, c.weights, s))
    a = replay(bare, "mrs", 0.25, num_experts=8, top_k=2, alpha=0.3)
    b = replay(scattered, "mrs", 0.25, num_experts=8, top_k=2, alpha=0.3)
    assert a.scores == "weights" and b.scores == "router"
    assert (a.hits, a.layers) == (b.hits, b.layers)
    assert replay(with_scores, "mrs", 0.25, num_experts=8, top_k=2).scores == "router"


def test_call_scores_is_the_summed_router_scores_or_scattered_weights() -> None:
    # sim/run.py routes its policies with call_scores too: scores summed over tokens, else gate weights
    # accumulated per expert in token order (np.add.at), bit for bit
    rng = np.random.default_rng(3)
    for T in (1, 2, 7):
        ids = np.stack([rng.choice(8, size=2, replace=False) for _ in range(T)])  # [T, 2]
        w = rng.random((T, 2)).astype(np.float32)  # [T, 2]
        sc = rng.random((T, 8)).astype(np.float32)  # [T, E]
        assert np.array_equal(call_scores(Call(0, 0, ids, w, sc), 8), sc.astype(np.float64).sum(axis=0))
        ref = np.zeros(8)  # [E]
        np.add.at(ref, ids.ravel(), w.astype(np.float64).ravel())
        got = call_scores(Call(0, 0, ids, w, None), 8)
        assert got.dtype == np.float64 and np.array_equal(got, ref)


def test_mrs_options_reported_and_validated() -> None:
    calls = random_calls(5, steps=5, layers=1, E=8, k=2)
    res = replay(calls, "mrs", 0.5, num_experts=8, top_k=2, alpha=0.25)
    assert dict(res.options) == {"alpha": 0.25, "top_p": 4, "normalize": False}
    with pytest.raises(ConfigError, match="'lru' takes no option alpha"):
        replay(calls, "lru", 0.5, num_experts=8, alpha=0.25)


def test_bad_input() -> None:
    calls = [call(1, 3, [[0]], 4)]
    with pytest.raises(ConfigError, match="unknown cache policy 'fifo'"):
        replay(calls, "fifo", 0.5, num_experts=4)
    with pytest.raises(TraceError, match=r"layer\(s\) \[3\] outside the MoE layers"):
        replay(calls, "lru", 0.5, num_experts=4, layers=[0, 1])
    with pytest.raises(TraceError, match="out of range"):
        replay([call(1, 0, [[5]], 8)], "lru", 0.5, num_experts=4)
    assert parse_policies("all") == list(ALL_POLICIES)
    assert parse_policies(" lru, mrs,lru") == ["lru", "mrs"]
    with pytest.raises(ConfigError, match="'x'"):
        parse_policies("lru,x")
    with pytest.raises(ConfigError, match="no cache policy"):
        parse_policies(" , ")


def test_replay_trace_reads_metadata(tmp_path: Path) -> None:
    """MoE layers from the metadata size the cache even when a layer never appears in the calls."""
    meta = {"model": "m", "num_experts": 4, "top_k": 1, "hidden_size": 8, "moe_intermediate_size": 8,
            "dtype": "float32", "moe_layers": [1, 2]}  # fmt: skip
    rec = TraceRecorder(meta, with_scores=True)
    for step, e in enumerate([0, 1, 0, 2]):
        rec.step = step
        rec.record(1, [[e]], [[1.0]], [[0.7 if i == e else 0.1 for i in range(4)]])
    path = rec.save(tmp_path / "t.parquet")
    res = replay_trace(traces.load(path), "lru", 0.25)
    assert (res.total_experts, res.slots, res.accesses, res.hits) == (8, 2, 4, 1)
    assert [h.layer for h in res.layers] == [1, 2] and res.layers[1].accesses == 0
    assert res.decode_accesses == 3 and res.decode_hits == 1


def test_belady_future_matches_replay_order() -> None:
    """Belady is consistent with the replayer's access order and never worse than the others."""
    calls = random_calls(6, steps=50, layers=4, E=16, k=4, prefill=20)
    best = replay(calls, "belady", 0.25, num_experts=16, top_k=4)
    for p in ("lru", "lfu", "mrs"):
        assert replay(calls, p, 0.25, num_experts=16, top_k=4).hits <= best.hits


def test_per_layer_caches_do_not_compete() -> None:
    # E=4, ratio 0.5: global cache 4 slots, per-layer 2 slots each. Layer 0 cycles 0 1 2, layer 1 always uses 3.
    seq0 = [0, 1, 2] * 4
    calls = [c for i, e in enumerate(seq0) for c in (call(i + 1, 0, [[e]], 4), call(i + 1, 1, [[3]], 4))]
    glob = replay(calls, "lru", 0.5, num_experts=4)
    per = replay(calls, "lru", 0.5, num_experts=4, per_layer=True)
    assert (glob.slots, per.slots) == (4, 4) and per.per_layer and not glob.per_layer
    assert [h.hits for h in glob.layers] == [len(seq0) - 3, len(seq0) - 1]  # everything fits after warm-up
    assert [h.hits for h in per.layers] == [0, len(seq0) - 1]  # LRU on a 3-cycle in 2 slots never hits
    assert per.evictions == len(seq0) - 2


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_per_layer_equals_each_layer_alone(policy: str) -> None:
    calls = random_calls(5, steps=40, layers=3, E=8, k=2, prefill=4)
    per = replay(calls, policy, 0.25, num_experts=8, top_k=2, per_layer=True)
    assert per.slots == 3 * 2  # floor(0.25 * 8) per layer
    for h in per.layers:
        alone = replay([c for c in calls if c.layer == h.layer], policy, 0.25, num_experts=8, top_k=2,
                       layers=[h.layer])  # fmt: skip
        assert (alone.slots, alone.accesses, alone.hits) == (2, h.accesses, h.hits)
    assert per.hits == sum(h.hits for h in per.layers) and per.hits + per.misses == per.accesses
