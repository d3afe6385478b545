"""ExpertStore background prefetch: provenance, budgets, waits, failures, used/wasted accounting, scores.

The store is built directly on the tiny qwen3_moe checkpoint (2 MoE layers x 6 experts) with a
source wrapper that can hold a read at a gate, fail it, and count reads per key.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import read_config
from moetier.store.source import FullSource
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

CPU = torch.device("cpu")
K = ExpertKey


class GatedSource:
    """FullSource whose reads of `gated` keys wait for `gate`, of `failing` keys raise; counts reads."""

    def __init__(self, inner: FullSource) -> None:
        self.inner = inner
        self.precision, self.slot_bytes, self.staging_bytes = inner.precision, inner.slot_bytes, inner.staging_bytes
        self.gate = threading.Event()
        self.gated: set[ExpertKey] = set()
        self.failing: set[ExpertKey] = set()
        self.reads: Counter[ExpertKey] = Counter()
        self.started = threading.Event()

    def read_into(self, key: ExpertKey, views: Any) -> int:
        self.reads[key] += 1
        if key in self.gated:
            self.started.set()
            assert self.gate.wait(10), "test gate never opened"
        if key in self.failing:
            raise OSError(f"injected read failure for {key}")
        return self.inner.read_into(key, views)

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> Any:
        return self.inner.make_pool(n_slots, device, pin=pin)

    def close(self) -> None:
        self.inner.close()


def make(path: Path, slots: int, policy: str = "lru") -> tuple[ExpertStore, GatedSource]:
    config, family = read_config(path)
    index = CheckpointIndex(path)
    layout = ExpertLayout(int(config.hidden_size), int(config.moe_intermediate_size), False)
    prefixes = {layer: f"model.layers.{layer}.mlp." for layer in (0, 1)}
    reader = ExpertReader(index, family.sources, layout, prefixes, 6, torch.float32)
    src = GatedSource(FullSource(reader, torch.float32))
    budget = slots * src.slot_bytes + src.staging_bytes
    store = ExpertStore(src, list(reader.plans), CPU, budget, None, policy=policy, top_k=2)
    assert store.capacity == slots
    return store, src


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `cond` until it holds (synchronisation that does not depend on how fast a busy machine gets there);
    fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.001)


def count_cv_waits(store: ExpertStore, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts the store's condition waits (acquire waiting for an in-flight load or for a slot). A waiter counts
    itself with the store's lock held, and the count is read under that lock: a count of n means n waiters have
    released the lock inside wait()."""
    n = [0]
    real = store._cv.wait

    def wait(timeout: float | None = None) -> bool:
        n[0] += 1
        return real(timeout)

    monkeypatch.setattr(store._cv, "wait", wait)

    def count() -> int:
        with store._lock:
            return n[0]

    return count


def check_budget(store: ExpertStore) -> None:
    st = store.compute
    used = list(st.slots.values()) + list(st.inflight.values())
    assert len(used) + len(st.free) == st.pool.n_slots  # every slot exactly once: resident, in flight or free
    assert len(set(used) | set(st.free)) == st.pool.n_slots
    assert not set(st.slots) & set(st.inflight)


def test_inflight_expert_is_invisible_until_registered(tiny_ckpt, canonical_experts):
    store, src = make(tiny_ckpt("qwen3_moe"), slots=3)
    src.gated = {K(0, 4)}
    assert store.prefetch([K(0, 4)]) == [K(0, 4)]
    assert src.started.wait(5)
    assert K(0, 4) not in store.index and K(0, 4) not in store.resident()
    assert store.inflight() == {K(0, 4)} and K(0, 4) in store.cached_keys()
    with pytest.raises(KeyError):
        store.views(K(0, 4))
    check_budget(store)
    assert store.prefetch([K(0, 4)]) == []  # already in flight: no second load
    src.gate.set()
    assert store.drain(5)
    assert K(0, 4) in store.index and store.inflight() == set()
    views = store.acquire(K(0, 4))
    torch.testing.assert_close(views.pieces["gate"], canonical_experts("qwen3_moe")[(0, 4)]["gate"], rtol=0, atol=0)
    store.release(K(0, 4))
    assert src.reads[K(0, 4)] == 1
    assert store.prefetch_stats()["used"] == 1 and store.compute.hits == 1
    store.close()


def test_forward_waits_for_the_inflight_load_without_a_second_read(tiny_ckpt):
    store, src = make(tiny_ckpt("qwen3_moe"), slots=2)
    src.gated = {K(1, 2)}
    store.prefetch([K(1, 2)])
    assert src.started.wait(5)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(store.acquire(K(1, 2))))
    t.start()
    # the store counts the wait (under its lock) before waiting: once it reads 1, t is waiting for the load
    wait_until(lambda: not t.is_alive() or store.prefetch_stats()["waits"] == 1, "acquire waiting for the load")
    assert t.is_alive() and not got  # waiting for the load it needs
    # a forward that does not need it is not held up
    store.acquire(K(0, 0))
    store.release(K(0, 0))
    src.gate.set()
    t.join(5)
    assert got and src.reads[K(1, 2)] == 1
    assert store.prefetch_stats()["waits"] == 1
    store.release(K(1, 2))
    store.close()


def test_demand_load_waits_for_inflight_slot_when_the_rest_are_pinned(tiny_ckpt, monkeypatch):
    store, src = make(tiny_ckpt("qwen3_moe"), slots=2)
    store.acquire(K(0, 0))  # pinned: one slot
    src.gated = {K(0, 1)}
    store.prefetch([K(0, 1)])  # the other slot, in flight
    assert src.started.wait(5)
    done: list[Any] = []
    cv_waits = count_cv_waits(store, monkeypatch)
    t = threading.Thread(target=lambda: done.append(store.acquire(K(0, 2))))
    t.start()
    wait_until(lambda: not t.is_alive() or cv_waits() == 1, "acquire waiting for a slot")
    assert t.is_alive() and not done  # no slot yet, and no BudgetError either: it waits for the in-flight load
    src.gate.set()
    t.join(5)
    assert done and K(0, 2) in store.index and K(0, 1) not in store.index  # the registered prefetch was evicted
    assert store.prefetch_stats()["wasted"] == 1
    check_budget(store)
    store.close()


def test_prefetch_evicts_only_unpinned_unprotected_and_stops_when_full(tiny_ckpt):
    store, _ = make(tiny_ckpt("qwen3_moe"), slots=3)
    for e in range(3):
        store.acquire(K(0, e))
        store.release(K(0, e))
    store.acquire(K(0, 0))  # pinned
    issued = store.prefetch([K(1, 0), K(1, 1), K(1, 2)], protect={K(0, 1)})
    assert issued == [K(1, 0)]  # only K(0, 2) could go; K(1, 0) now an unused prefetch, not evictable by prefetch
    assert store.drain(5)
    assert store.resident() == {K(0, 0), K(0, 1), K(1, 0)}
    check_budget(store)
    store.release(K(0, 0))
    store.close()


def test_failing_prefetch_read_frees_its_slot_and_the_store_serves(tiny_ckpt, canonical_experts):
    store, src = make(tiny_ckpt("qwen3_moe"), slots=2)
    src.failing = {K(0, 3)}
    assert store.prefetch([K(0, 3), K(0, 4)]) == [K(0, 3), K(0, 4)]
    assert store.drain(5)
    stats = store.prefetch_stats()
    assert stats["failed"] == 1 and "injected read failure" in stats["errors"][0]
    assert K(0, 3) not in store.index and K(0, 4) in store.index
    check_budget(store)
    src.failing = set()
    views = store.acquire(K(0, 3))  # a demand load of the same expert works
    torch.testing.assert_close(views.pieces["down"], canonical_experts("qwen3_moe")[(0, 3)]["down"], rtol=0, atol=0)
    store.release(K(0, 3))
    assert store.compute.misses == 1
    store.close()


def test_budget_holds_under_concurrent_prefetch_and_acquire(tiny_ckpt):
    store, _ = make(tiny_ckpt("qwen3_moe"), slots=3)
    keys = list(store.keys)
    gen = torch.Generator().manual_seed(3)
    violations: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with store._lock:
                st = store.compute
                if len(st.slots) + len(st.inflight) > st.pool.n_slots:
                    violations.append(f"{len(st.slots)} + {len(st.inflight)}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    for _ in range(60):
        i, j = torch.randint(len(keys), (2,), generator=gen).tolist()
        store.prefetch([keys[j]], protect={keys[i]})
        store.acquire(keys[i])
        check_budget(store)
        store.release(keys[i])
    store.drain(5)
    stop.set()
    watcher.join()
    assert not violations
    st = store.prefetch_stats()
    assert st["issued"] == st["used"] + st["wasted"] + st["failed"] + st["pending"] + st["inflight"]
    assert store.compute.hits + store.compute.misses == 60
    store.close()


def test_mrs_scores_pick_a_different_victim_than_lru(tiny_ckpt):
    victims = {}
    for policy in ("lru", "mrs"):
        store, _ = make(tiny_ckpt("qwen3_moe"), slots=2, policy=policy)
        assert store.wants_scores is (policy == "mrs")
        store.on_route(0, [0.9, 0.0, 0.05, 0.05, 0.0, 0.0])  # expert 0 scores high, 1 low
        for e in (0, 1):  # 0 is the least recently used
            store.acquire(K(0, e))
            store.release(K(0, e))
        store.acquire(K(0, 2))
        store.release(K(0, 2))
        victims[policy] = ({K(0, 0), K(0, 1)} - store.resident()).pop()
        store.close()
    assert victims == {"lru": K(0, 0), "mrs": K(0, 1)}
