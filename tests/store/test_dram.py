"""DramCache: fixed blocks, LRU over whole entries, hit/miss and prefetch accounting (store/dram.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import BudgetError
from moetier.store.dram import DramCache
from moetier.types import ExpertKey, Precision

HI, LO = Precision.INT4, Precision.INT2


def row(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_entries_span_blocks_and_round_trip_exactly() -> None:
    cache = DramCache(1000, {HI: 250, LO: 64})  # block 64: a hi entry takes 4 blocks, the last partial
    assert cache.block == 64 and cache.n_blocks == 15
    a, b = row(250, 1), row(64, 2)
    assert cache.write(ExpertKey(0, 1), HI, a) and cache.write(ExpertKey(0, 2), LO, b)
    assert not cache.write(ExpertKey(0, 1), HI, a)  # already cached
    out = torch.zeros(250, dtype=torch.uint8)
    assert cache.read(ExpertKey(0, 1), HI, out) and torch.equal(out, a)
    out = torch.zeros(64, dtype=torch.uint8)
    assert cache.read(ExpertKey(0, 2), LO, out) and torch.equal(out, b)
    assert not cache.read(ExpertKey(0, 2), HI, torch.zeros(250, dtype=torch.uint8))  # other precision: a miss
    assert cache.used_bytes() == 5 * 64
    s = cache.stats()
    assert s["precisions"]["int4"] == {"hits": 1, "misses": 1, "hit_rate": 0.5, "inserts": 1, "evictions": 0,
                                       "experts": 1, "entry_bytes": 250}  # fmt: skip
    cache.check()


def test_lru_evicts_whole_entries_and_counts_prefetch_use() -> None:
    cache = DramCache(4 * 64, {HI: 128, LO: 64})  # 4 blocks: two hi entries
    k = [ExpertKey(1, e) for e in range(4)]
    cache.write(k[0], HI, row(128, 0), prefetched=True)
    cache.write(k[1], HI, row(128, 1), prefetched=True)
    assert cache.read(k[0], HI, torch.empty(128, dtype=torch.uint8))  # k[0] used, now most recent
    cache.write(k[2], LO, row(64, 2))  # evicts k[1] (least recent), unread: wasted
    cache.write(k[3], LO, row(64, 3))  # fits in k[1]'s second block
    assert (k[1], HI) not in cache and (k[0], HI) in cache
    s = cache.stats()
    assert (s["prefetch_used"], s["prefetch_wasted"], s["prefetch_pending"]) == (1, 1, 0)
    assert s["precisions"]["int4"]["evictions"] == 1 and cache.used_bytes() == 4 * 64
    cache.check()


def test_a_budget_below_one_entry_is_refused_with_the_flag() -> None:
    with pytest.raises(BudgetError, match="--host-cache-mem"):
        DramCache(300, {HI: 256, LO: 64}, reserve=100)
    with pytest.raises(ValueError, match="slot sizes"):
        DramCache(300, {})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.booleans()), min_size=1, max_size=60),
       st.integers(3, 12))  # fmt: skip
def test_blocks_are_never_lost_and_reads_return_what_was_written(ops, n_blocks: int) -> None:
    sizes = {HI: 100, LO: 40}
    cache = DramCache(n_blocks * 40, sizes)
    written: dict[tuple[ExpertKey, Precision], torch.Tensor] = {}
    looks = 0
    for e, hi, write in ops:
        key, p = ExpertKey(0, e), HI if hi else LO
        if write:
            data = row(sizes[p], e * 2 + hi)
            if cache.write(key, p, data):
                written[(key, p)] = data
        else:
            out = torch.zeros(sizes[p], dtype=torch.uint8)
            looks += 1
            if cache.read(key, p, out):
                assert torch.equal(out, written[(key, p)])
        cache.check()
        assert cache.used_bytes() <= cache.budget
    s = cache.stats()["precisions"]
    assert sum(v["hits"] + v["misses"] for v in s.values()) == looks
