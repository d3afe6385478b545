"""ExpertStore under an admitting policy (mrs-admit): transient slots, bypass, admission, pin groups, budgets.

Built directly on the tiny qwen3_moe checkpoint (2 MoE layers x 6 experts = 12 experts). Exact invariants: the pool
never grows, slots in use + free + transient == the pool, a bypassed expert is gone after its last release and
evicted nothing, an admitted one evicted exactly the policy's victim.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import read_config
from moetier.sim.cache_replay import call_scores, replay
from moetier.store.source import FullSource
from moetier.store.store import ExpertStore
from moetier.traces import Call
from moetier.types import ExpertKey

K = ExpertKey
CPU = torch.device("cpu")


def make_store(path: Path, slots: int | None, policy: str = "mrs-admit") -> ExpertStore:
    config, family = read_config(path)
    index = CheckpointIndex(path)
    block = family.ckpt_block
    layers = sorted({int(n.split(".")[2]) for n in index.names() if f".{block}.experts." in n})
    layout = ExpertLayout(int(config.hidden_size), int(getattr(config, family.intermediate_attr)), False)
    prefixes = {layer: f"model.layers.{layer}.{block}." for layer in layers}
    reader = ExpertReader(index, family.sources, layout, prefixes, int(config.num_experts), torch.float32)
    source = FullSource(reader, torch.float32)
    budget = None if slots is None else slots * source.slot_bytes + source.staging_bytes
    return ExpertStore(source, list(reader.plans), CPU, budget, None, policy=policy, top_k=2)


def balanced(store: ExpertStore) -> None:
    h = store.host
    assert len(h.slots) + len(h.free) + len(h.transient) + len(h.inflight) == h.pool.n_slots
    assert len(set(h.slots.values()) | set(h.free) | set(h.transient)) == len(h.slots) + len(h.free) + len(h.transient)
    assert h.bypassed <= set(h.pins)  # a bypassed expert is pinned until it is dropped
    assert set(h.transient) <= h.reserved


def fill(store: ExpertStore, keys: list[ExpertKey]) -> None:
    for key in keys:
        store.acquire(key)
        store.release(key)


def test_reserves_transient_slots_only_under_admission(tiny_ckpt: Callable[..., Path]) -> None:
    path = tiny_ckpt("qwen3_moe")
    admit, lru, fits = make_store(path, 8), make_store(path, 8, "lru"), make_store(path, None)
    assert (admit.host.pool.n_slots, len(admit.host.reserved), admit.pin_limit()) == (8, 2, 2)
    assert (lru.host.pool.n_slots, len(lru.host.reserved), lru.pin_limit()) == (8, 0, 8)
    assert len(fits.host.reserved) == 0 and fits.pin_limit() == 12  # every expert fits: nothing to bypass
    assert len(make_store(path, 3).host.reserved) == 0  # at most a quarter of the slots
    assert admit.preload() == 6 and len(admit.host.slots) == 6 and len(admit.host.transient) == 2
    for s in (admit, lru, fits):
        s.close()


def test_low_ranked_miss_is_bypassed_high_ranked_one_admitted(tiny_ckpt: Callable[..., Path]) -> None:
    store = make_store(tiny_ckpt("qwen3_moe"), 8)
    h = store.host
    store.on_route(0, [0.4, 0.3, 0.2, 0.05, 0.04, 0.01])
    store.on_route(1, [0.4, 0.3, 0.2, 0.05, 0.04, 0.01])
    cached = [K(0, 0), K(0, 1), K(0, 2), K(1, 0), K(1, 1), K(1, 2)]
    fill(store, cached)  # free slots: every miss is cached
    assert set(h.slots) == set(cached) and h.evictions == 0 and len(h.transient) == 2
    # a miss ranked below every cached expert: computed from a transient slot, dropped at its release
    views = store.acquire(K(0, 5))
    assert K(0, 5) in h.slots and K(0, 5) in h.bypassed and len(h.transient) == 1
    assert views is h.pool.views[h.slots[K(0, 5)]]
    balanced(store)
    store.release(K(0, 5))
    assert set(h.slots) == set(cached) and not h.bypassed and len(h.transient) == 2
    assert (h.hits, h.misses, h.evictions, h.bypasses) == (0, 7, 0, 1)
    # a miss ranked above the lowest cached one: cached in its place, transient slots stay 2
    store.on_route(0, [0.0, 0.0, 0.0, 0.0, 3.0, 0.0])
    low = min(cached, key=lambda k: (h.policy.score(k), k))
    store.acquire(K(0, 4))
    store.release(K(0, 4))
    assert K(0, 4) in h.slots and K(0, 4) not in h.bypassed and low not in h.slots
    assert (h.evictions, h.bypasses, len(h.transient), len(h.reserved)) == (1, 1, 2, 2)
    balanced(store)
    store.close()


def test_random_calls_keep_the_pool_balanced(tiny_ckpt: Callable[..., Path]) -> None:
    """Layer calls of random experts through acquire_many / release_many in groups of pin_limit, with scores:
    the pool never grows, nothing pinned is evicted, hits + misses == accesses, nothing stays bypassed."""
    store = make_store(tiny_ckpt("qwen3_moe"), 8)
    h, rng = store.host, random.Random(0)
    accesses = 0
    for _ in range(200):
        layer = rng.randrange(2)
        store.on_route(layer, [rng.random() ** 4 for _ in range(6)])
        experts = sorted(rng.sample(range(6), rng.randrange(1, 7)))
        for g0 in range(0, len(experts), store.pin_limit() or len(experts)):
            keys = [K(layer, e) for e in experts[g0 : g0 + store.pin_limit()]]
            views = store.acquire_many(keys)
            assert all(h.pins[k] == 1 and v is h.pool.views[h.slots[k]] for k, v in zip(keys, views, strict=True))
            balanced(store)
            store.release_many(keys)
            accesses += len(keys)
        assert not h.pins and not h.bypassed and len(h.transient) == 2 and len(h.slots) <= 6
    assert h.hits + h.misses == accesses and h.bypasses > 0 and h.evictions > 0 and h.hits > 0
    store.close()


def test_failed_read_returns_the_transient_slot(
    tiny_ckpt: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tiny_ckpt("qwen3_moe"), 8)
    h = store.host
    fill(store, [K(0, e) for e in range(6)])
    monkeypatch.setattr(store.source, "read_into", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(Exception, match=r"EIO|Input/output"):
        store.acquire(K(1, 0))
    monkeypatch.undo()
    assert K(1, 0) not in h.slots and not h.pins
    store.acquire(K(1, 0))  # the slot given back on the free list is transient again
    store.release(K(1, 0))
    assert len(h.reserved) == 2 and len(h.transient) == 2 and not h.free
    balanced(store)
    store.close()


def test_store_counts_equal_the_replay(tiny_ckpt: Callable[..., Path]) -> None:
    """The engine's store and the simulator's replay (sim/cache_replay.py) run the same admission: the same calls
    give the same hits, misses, evictions and bypasses."""
    rng = np.random.default_rng(7)
    pops = rng.dirichlet(np.full(6, 0.4), size=(3, 2))  # [phase, L, E] skewed routing that drifts twice
    calls = []
    for step in range(150):
        for layer in range(2):
            p = pops[step // 50, layer] * rng.gamma(1.0, size=(3, 6))  # [T, E] three tokens per call
            p /= p.sum(1, keepdims=True)
            ids = np.argsort(-p, axis=1)[:, :2]  # [T, k]
            calls.append(Call(step, layer, ids, np.take_along_axis(p, ids, 1).astype(np.float32),
                              p.astype(np.float32)))  # fmt: skip
    store = make_store(tiny_ckpt("qwen3_moe"), 8)
    for c in calls:
        store.on_route(c.layer, call_scores(c, 6))
        call = [K(c.layer, e) for e in np.unique(c.ids).tolist()]
        g0 = 0
        for size in store.pin_groups(call):  # as the native executor pins a call
            keys = call[g0 : g0 + size]
            assert sum(k not in store.host.slots for k in keys) <= 2  # a group's misses fit the transient slots
            store.acquire_many(keys)
            store.release_many(keys)
            g0 += size
        assert g0 == len(call)
    h = store.host
    res = replay(calls, "mrs-admit", 8 / 12, num_experts=6, top_k=2)
    assert res.slots == 8 and res.bypasses > 0 and res.evictions > 0
    assert (h.hits, h.misses, h.evictions, h.bypasses) == (res.hits, res.misses, res.evictions, res.bypasses)
    store.close()


def test_pin_groups_split_by_misses_and_protect_the_call(tiny_ckpt: Callable[..., Path]) -> None:
    path = tiny_ckpt("qwen3_moe")
    store, lru = make_store(path, 8), make_store(path, 8, "lru")
    fill(store, [K(0, 0), K(0, 1), K(0, 2)])
    call = [K(0, e) for e in range(6)]
    assert store.pin_groups(call) == [5, 1]  # misses 3, 4 | 5: at most 2 (the transient slots) per group
    assert store.host.protect == frozenset(call)
    assert store.pin_groups([K(1, 0), K(0, 0), K(1, 1), K(1, 2)]) == [3, 1]
    assert store.pin_groups([]) == []
    assert lru.pin_groups(call) == [6] and lru.pin_groups(call + [K(1, e) for e in range(4)]) == [8, 2]
    store.close()
    lru.close()
