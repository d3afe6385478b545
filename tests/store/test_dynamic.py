"""DynamicStore + Mover: budgets, provenance and accounting under concurrent switches.

Sources here are fakes that write a per-(expert, precision) signature into a slot in two
halves with a pause between, so a forward that saw an unregistered (half-written) slot
would read a mixed row.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.errors import BudgetError
from moetier.policies.precision import Decision, ExpertState, order_switches
from moetier.store.dynamic import DynamicStore
from moetier.store.mover import Mover, SwitchPipeline
from moetier.types import ExpertKey, Move, MoveKind, Precision, Tier

CODES = {Precision.FULL: 1, Precision.INT8: 2, Precision.INT4: 3, Precision.INT2: 4}


def signature(key: ExpertKey, precision: Precision) -> float:
    return float(key.layer * 1000 + key.expert * 10 + CODES[precision])


@dataclass
class _Views:
    row: torch.Tensor


class _Pool:
    def __init__(self, n_slots: int, numel: int) -> None:
        self.n_slots, self.slot_bytes = n_slots, numel * 4
        self.buf = torch.zeros(n_slots, numel)
        self.views = [_Views(self.buf[s]) for s in range(n_slots)]
        self.nbytes = n_slots * self.slot_bytes


class FakeSource:
    def __init__(self, precision: Precision, numel: int, pause: float = 0.0, fail_on: set[ExpertKey] | None = None):
        self.precision, self.numel, self.pause = precision, numel, pause
        self.slot_bytes, self.staging_bytes = numel * 4, 64
        self.fail_on = fail_on or set()
        self.reads = 0

    def read_into(self, key: ExpertKey, views: _Views) -> int:
        half = self.numel // 2
        views.row[:half] = signature(key, self.precision)
        if self.pause:
            time.sleep(self.pause)
        if key in self.fail_on:
            raise OSError(f"disk error reading {key}")
        views.row[half:] = signature(key, self.precision)
        self.reads += 1
        return self.slot_bytes

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> _Pool:
        return _Pool(n_slots, self.numel)

    def close(self) -> None:
        pass


def make_store(layers: int, experts: int, n_hot: int, spare: int = 1, pause: float = 0.0, fail=None,
               transient: int = 0, cache_bytes: int = 0):  # fmt: skip
    """A store and its keys, its budget exactly the pools (transient slots included) and staging;
    `preload(hot=keys[:n_hot])` fills it."""
    hi = FakeSource(Precision.FULL, 64, pause)
    lo = FakeSource(Precision.INT4, 16, pause, fail)
    keys = [ExpertKey(layer, e) for layer in range(layers) for e in range(experts)]
    n_lo = len(keys) - n_hot + spare
    budget = (n_hot + transient) * hi.slot_bytes + n_lo * lo.slot_bytes + hi.staging_bytes + lo.staging_bytes
    store = DynamicStore(hi, lo, keys, n_hot, spare, torch.device("cpu"), budget, transient=transient,
                         cache_bytes=cache_bytes)  # fmt: skip
    return store, keys


def pipeline(store: DynamicStore, workers: int) -> SwitchPipeline:
    return SwitchPipeline(lambda m: store.begin_switch(m.key, m.precision, timeout=10), store.finish_switch, workers)


def read_row(store: DynamicStore, key: ExpertKey) -> tuple[float, float]:
    views = store.acquire(key)
    try:
        row = views.row.clone()
    finally:
        store.release(key)
    return float(row.min()), float(row.max())


def test_first_touch_loads_low_and_preload_fills_everything() -> None:
    store, keys = make_store(2, 4, n_hot=2)
    lo, hi = read_row(store, keys[0])
    assert lo == hi == signature(keys[0], Precision.INT4)
    assert store.misses == 1
    store.preload(hot=[keys[1], keys[5]])
    assert set(store.index) == set(keys)
    assert {k for k, v in store.index.items() if v.precision == Precision.FULL} == {keys[1], keys[5]}
    store.check()


def test_switch_promotes_then_demotes_and_reclaims_at_once() -> None:
    store, keys = make_store(1, 4, n_hot=1)
    store.preload(hot=keys[:1])
    assert store.switch(keys[0], Precision.INT4)  # demote the preloaded hot one (into the spare)
    lo_free = len(store.pools[Precision.INT4].free)
    assert store.switch(keys[2], Precision.FULL)
    assert read_row(store, keys[2]) == (signature(keys[2], Precision.FULL),) * 2
    assert len(store.pools[Precision.INT4].free) == lo_free + 1  # the low version was reclaimed
    assert not store.switch(keys[2], Precision.FULL)  # already there: nothing to do
    # the one hot slot is taken: a demotion (using the spare low slot) must come first
    assert store.switch(keys[2], Precision.INT4)
    assert store.switch(keys[3], Precision.FULL)
    assert store.promotions == 2 and store.demotions == 2
    store.check()


def test_version_held_by_a_forward_is_reclaimed_on_release() -> None:
    store, keys = make_store(1, 3, n_hot=1)
    store.preload(hot=keys[2:])
    assert store.switch(keys[2], Precision.INT4)
    views = store.acquire(keys[0])  # a forward holds the low version
    assert store.switch(keys[0], Precision.FULL)
    assert float(views.row.max()) == signature(keys[0], Precision.INT4)  # still intact while held
    assert store.pools[Precision.INT4].retired
    store.release(keys[0])
    assert not store.pools[Precision.INT4].retired
    store.check()


def test_pools_over_budget_are_refused() -> None:
    hi, lo = FakeSource(Precision.FULL, 64), FakeSource(Precision.INT4, 16)
    keys = [ExpertKey(0, e) for e in range(4)]
    with pytest.raises(BudgetError, match="over the budget"):
        DynamicStore(hi, lo, keys, 2, 1, torch.device("cpu"), budget=100)
    with pytest.raises(BudgetError, match="high-precision slots"):
        DynamicStore(hi, lo, keys, 0, 1, torch.device("cpu"), budget=10**6)


def test_failed_switch_keeps_the_stable_version_and_is_reported() -> None:
    bad = ExpertKey(0, 1)
    store, _ = make_store(1, 3, n_hot=1)
    store.preload()  # all low but one: the hot slot stays free
    store.pools[Precision.FULL].source.fail_on = {bad}  # type: ignore[attr-defined]
    failed: list[Move] = []
    mover = Mover(lambda m: store.switch(m.key, m.precision), on_error=lambda m, e: failed.append(m))
    mover.submit([Move(MoveKind.PROMOTE, bad, Tier.DISK, Tier.HOST, Precision.FULL)])
    assert mover.drain(10)
    assert failed and "disk error" in mover.errors[0]
    assert store.precision_of(bad) == Precision.INT4
    assert read_row(store, bad) == (signature(bad, Precision.INT4),) * 2
    # the mover goes on serving later moves, into the slot the failed one gave back
    mover.submit([Move(MoveKind.PROMOTE, ExpertKey(0, 2), Tier.DISK, Tier.HOST, Precision.FULL)])
    assert mover.drain(10)
    assert store.precision_of(ExpertKey(0, 2)) == Precision.FULL
    mover.close()
    store.check()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    experts=st.integers(2, 8),
    hot_frac=st.floats(0.1, 0.9),
    spare=st.integers(1, 3),
    transient=st.integers(0, 3),
    seed=st.integers(0, 10**6),
)
def test_concurrent_switches_keep_budget_provenance_and_accounting(
    layers: int, experts: int, hot_frac: float, spare: int, transient: int, seed: int
) -> None:
    """Several switches in flight (SwitchPipeline, up to transient + spare at once) against forwards."""
    rng = random.Random(seed)
    n_hot = max(1, int(hot_frac * layers * experts))
    store, keys = make_store(layers, experts, n_hot, spare, pause=0.0005, transient=transient,
                             cache_bytes=rng.choice([0, 600, 10**4]))  # fmt: skip
    hot = set(keys[:n_hot])
    store.preload(hot)
    mover = pipeline(store, transient + spare)
    stop = threading.Event()
    violations: list[str] = []

    def watch() -> None:  # budget checked continuously, while switches run
        while not stop.is_set():
            if store.used_bytes() > store.budget:
                violations.append(f"{store.used_bytes()} > {store.budget}")
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(30):
            # a decision: a random new hot set, fitted to the slots as the engine does
            new_hot = set(rng.sample(keys, rng.randint(0, n_hot)))
            decision = Decision(upgrades=tuple(new_hot - hot), downgrades=tuple(hot - new_hot), step=0)
            plan = order_switches(decision, n_hot - len(hot), transient)
            moves = []
            for key, state in plan.moves:
                high = state is ExpertState.HIGH
                moves.append(Move(MoveKind.PROMOTE if high else MoveKind.DEMOTE, key, Tier.DISK, Tier.HOST,
                                  Precision.FULL if high else Precision.INT4))
                hot = hot | {key} if high else hot - {key}
            assert len(hot) <= n_hot
            mover.submit(moves)
            for key in rng.sample(keys, min(4, len(keys))):  # a forward, while the mover runs
                lo, hi = read_row(store, key)
                assert lo == hi, f"{key}: forward read a half-written version"
                assert lo in (signature(key, Precision.INT4), signature(key, Precision.FULL))
            store.check()
        assert mover.drain(30)
    finally:
        stop.set()
        watcher.join()
        mover.close()
    assert not violations, violations[:3]
    assert not mover.errors
    store.check()
    # every byte accounted for at shutdown: each expert has exactly one registered version,
    # the hot set is what was asked for, and no slot is in flight or retired
    assert set(store.index) == set(keys)
    assert {k for k, v in store.index.items() if v.precision == Precision.FULL} == hot
    for p, state in store.pools.items():
        assert not state.inflight and not state.retired
        registered = sum(v.precision == p for v in store.index.values())
        assert registered + len(state.free) == state.pool.n_slots
    mix = store.stats()["precision"]
    assert mix["full"]["experts"] + mix["int4"]["experts"] == len(keys)
    assert store.peak_inflight <= transient + spare


class GatedSource(FakeSource):
    """A FakeSource whose reads of experts in `gated` block until `gate` is set."""

    def __init__(self, precision: Precision, numel: int) -> None:
        super().__init__(precision, numel)
        self.gate, self.gated, self.started = threading.Event(), set(), threading.Semaphore(0)

    def read_into(self, key: ExpertKey, views: _Views) -> int:
        if key in self.gated:
            self.started.release()
            assert self.gate.wait(10)
        return super().read_into(key, views)


def test_several_promotions_in_flight_through_the_transient_buffer() -> None:
    """Three promotions in flight at once, into the 3 transient high slots, before any demotion has run;
    the forwards meanwhile read the stable low versions, the budget holds, and the demotions then
    give the transient slots back."""
    hi, lo = GatedSource(Precision.FULL, 64), GatedSource(Precision.INT4, 16)
    keys = [ExpertKey(0, e) for e in range(8)]
    n_hot, spare, transient = 3, 1, 3
    budget = (n_hot + transient) * hi.slot_bytes + (8 - n_hot + spare) * lo.slot_bytes + 128
    store = DynamicStore(hi, lo, keys, n_hot, spare, torch.device("cpu"), budget, transient=transient)
    store.preload(keys[:3])
    ups, downs = keys[5:], keys[:3]
    hi.gated = set(ups)
    plan = order_switches(Decision(upgrades=tuple(ups), downgrades=tuple(downs), step=0), 0, transient)
    assert [s for _, s in plan.moves] == [ExpertState.HIGH] * 3 + [ExpertState.LOW] * 3  # promotions first
    mover = SwitchPipeline(lambda m: store.begin_switch(m.key, m.precision, timeout=10), store.finish_switch,
                           workers=transient + spare)  # fmt: skip
    mover.submit(Move(MoveKind.PROMOTE if st_ is ExpertState.HIGH else MoveKind.DEMOTE, k, Tier.DISK, Tier.HOST,
                      Precision.FULL if st_ is ExpertState.HIGH else Precision.INT4) for k, st_ in plan.moves)
    try:
        for _ in ups:
            assert hi.started.acquire(timeout=10)  # all three promotions are reading at once
        assert len(store.pools[Precision.FULL].inflight) == 3
        assert store.peak_inflight >= 3
        store.check()
        assert store.used_bytes() <= budget
        for key in ups:  # in flight: invisible, the low version is what a forward reads
            assert store.precision_of(key) == Precision.INT4
            assert read_row(store, key) == (signature(key, Precision.INT4),) * 2
        hi.gate.set()
        assert mover.drain(10)
    finally:
        hi.gate.set()
        mover.close()
    assert not mover.errors
    store.check()
    assert {k for k, v in store.index.items() if v.precision == Precision.FULL} == set(ups)
    hs = store.pools[Precision.FULL]
    assert len(hs.free) == transient and not hs.inflight  # the transient slots are free again
    assert store.stats()["transient"] == {"hi_slots": 3, "lo_slots": 1, "bytes": 3 * hi.slot_bytes + lo.slot_bytes,
                                          "inflight": 0, "peak_inflight": store.peak_inflight}


def test_without_transient_slots_switches_run_one_at_a_time() -> None:
    store, keys = make_store(1, 6, n_hot=2, spare=1, pause=0.002)
    store.preload(keys[:2])
    plan = order_switches(Decision(upgrades=tuple(keys[4:]), downgrades=tuple(keys[:2]), step=0), 0, 0)
    mover = pipeline(store, 1)
    mover.submit(Move(MoveKind.PROMOTE if s is ExpertState.HIGH else MoveKind.DEMOTE, k, Tier.DISK, Tier.HOST,
                      Precision.FULL if s is ExpertState.HIGH else Precision.INT4) for k, s in plan.moves)
    assert mover.drain(10)
    mover.close()
    assert store.peak_inflight == 1 and not mover.errors
    assert {k for k, v in store.index.items() if v.precision == Precision.FULL} == set(keys[4:])


def test_promotion_with_no_slot_and_nothing_in_flight_fails_at_once() -> None:
    store, keys = make_store(1, 4, n_hot=1, spare=1)
    store.preload(keys[:1])
    with pytest.raises(BudgetError, match="no free full slot"):
        store.begin_switch(keys[2], Precision.FULL)
    store.check()


def test_dram_cache_serves_re_promotions_and_prefetched_experts_without_disk_reads() -> None:
    store, keys = make_store(1, 4, n_hot=1, spare=1, cache_bytes=10**4)
    store.preload(keys[:1])  # every expert read once from disk, kept in the cache
    hi_src, lo_src = store.pools[Precision.FULL].source, store.pools[Precision.INT4].source
    reads = (hi_src.reads, lo_src.reads)  # type: ignore[attr-defined]
    assert store.switch(keys[0], Precision.INT4)  # preloaded at hi: its low version comes from disk
    assert store.switch(keys[1], Precision.FULL)  # a first promotion: disk
    assert store.switch(keys[1], Precision.INT4)  # back to low: cached
    assert store.switch(keys[0], Precision.FULL)  # hi again: cached
    assert (hi_src.reads, lo_src.reads) == (reads[0] + 1, reads[1] + 1)  # type: ignore[attr-defined]
    assert store.stats()["dram"]["precisions"]["full"]["misses"] == 2  # keys[0] at preload, keys[1]
    assert read_row(store, keys[0]) == (signature(keys[0], Precision.FULL),) * 2
    # prefetch: stage keys[2] at hi, then its promotion reads no disk
    assert store.stage(keys[2]) and not store.stage(keys[2]) and not store.stage(keys[0])
    assert store.switch(keys[0], Precision.INT4)
    disk = store.disk_bytes
    assert store.switch(keys[2], Precision.FULL)
    assert store.disk_bytes == disk and read_row(store, keys[2]) == (signature(keys[2], Precision.FULL),) * 2
    dram = store.stats()["dram"]
    assert dram["prefetch_used"] == 1 and store.prefetch_issued == 1
    assert dram["precisions"]["full"]["hits"] == 2  # keys[0] re-promoted, keys[2] prefetched
    assert dram["precisions"]["int4"]["hits"] == 2  # keys[1] and keys[0] demoted again
    store.check()
