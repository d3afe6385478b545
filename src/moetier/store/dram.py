"""DramCache: the host-DRAM level between the disk tiers and the compute pools (DynaExq 3.3).

The paper: "High-precision and low-precision weights are stored on SSD and cached in DRAM"; an upgrade
fetches the high-precision weight "from SSD (if not cached), buffered in DRAM, and streamed into HBM".
This cache holds experts of both precisions in their slot format (the bytes a pool slot holds), so a
hit fills a slot with one copy and no disk read; a miss reads the disk tier into the slot and keeps a
copy ("buffered in DRAM").

Memory: one uint8 buffer of fixed-size blocks, allocated once from the host cache budget. An entry
(expert, precision) takes ceil(slot_bytes / block) blocks, not necessarily adjacent: every block is
interchangeable, so the cache never fragments (an entry fits whenever that many blocks are free or can
be evicted). Eviction is least recently used over whole entries. The block is the smallest slot size of
the precisions cached, so a low-precision entry is one block and a high one wastes less than a block.

Invariants (tested): blocks in use + free blocks == all blocks; an entry is only readable once fully
written (writes and reads copy under the lock); bytes held <= budget; hits + misses == lookups per
precision; prefetched entries are counted used (read before eviction) or wasted (evicted unread) once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from moetier.config import format_size
from moetier.errors import BudgetError
from moetier.types import ExpertKey, Precision

CacheKey = tuple[ExpertKey, Precision]


class DramCache:
    def __init__(self, budget: int, slot_bytes: Mapping[Precision, int], reserve: int = 0) -> None:
        """`slot_bytes`: the entry size of each precision cached; `reserve`: bytes of the budget taken
        elsewhere (the prefetch scratch slot)."""
        if not slot_bytes or min(slot_bytes.values()) < 1:
            raise ValueError(f"slot sizes must be >= 1 byte, got {dict(slot_bytes)}")
        self.slot_bytes = dict(slot_bytes)
        self.block = min(self.slot_bytes.values())
        self.budget = budget
        n_blocks = (budget - reserve) // self.block
        largest = max(self._blocks(p) for p in self.slot_bytes)
        if n_blocks < largest:
            need = largest * self.block + reserve
            raise BudgetError(
                f"host cache budget {format_size(budget)} cannot hold one expert of every precision cached "
                f"({format_size(need)} with the prefetch scratch slot); raise --host-cache-mem or set it to 0"
            )
        self.n_blocks = n_blocks
        self.buf = torch.empty((n_blocks, self.block), dtype=torch.uint8)  # [N, block]
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))
        self.entries: OrderedDict[CacheKey, list[int]] = OrderedDict()  # LRU first
        self.prefetched: set[CacheKey] = set()  # written by a prefetch, not read since
        self._lock = threading.Lock()
        zero = dict.fromkeys(self.slot_bytes, 0)
        self.hits, self.misses, self.inserts, self.evictions = dict(zero), dict(zero), dict(zero), dict(zero)
        self.pf_used = self.pf_wasted = 0

    def _blocks(self, precision: Precision) -> int:
        return -(-self.slot_bytes[precision] // self.block)

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self.entries

    def read(self, key: ExpertKey, precision: Precision, dst: torch.Tensor) -> bool:
        """Copy the cached bytes of (key, precision) into `dst` (uint8 [slot_bytes], contiguous): a hit.
        False (a miss) when not cached."""
        ck = (key, precision)
        with self._lock:
            blocks = self.entries.get(ck)
            if blocks is None:
                self.misses[precision] += 1
                return False
            self.entries.move_to_end(ck)
            self.hits[precision] += 1
            if ck in self.prefetched:
                self.prefetched.discard(ck)
                self.pf_used += 1
            self._copy(blocks, dst, out=True)
            return True

    def write(self, key: ExpertKey, precision: Precision, src: torch.Tensor, prefetched: bool = False) -> bool:
        """Keep a copy of `src` (uint8 [slot_bytes]) as (key, precision), evicting least recently used
        entries for room; False if already cached."""
        ck = (key, precision)
        n = self._blocks(precision)
        with self._lock:
            if ck in self.entries:
                return False
            while len(self.free) < n:
                victim, blocks = self.entries.popitem(last=False)
                self.free += blocks
                self.evictions[victim[1]] += 1
                if victim in self.prefetched:
                    self.prefetched.discard(victim)
                    self.pf_wasted += 1
            blocks = [self.free.pop() for _ in range(n)]
            self._copy(blocks, src, out=False)
            self.entries[ck] = blocks
            self.inserts[precision] += 1
            if prefetched:
                self.prefetched.add(ck)
            return True

    def _copy(self, blocks: list[int], row: torch.Tensor, out: bool) -> None:
        """Lock held: blocks -> row (out) or row -> blocks. row: uint8 [nbytes]; the last block is partial."""
        nbytes, b = row.numel(), self.block
        full = nbytes // b
        if full:
            idx = torch.tensor(blocks[:full], dtype=torch.long)
            whole = row[: full * b].view(full, b)  # [full, block]
            if out:
                torch.index_select(self.buf, 0, idx, out=whole)
            else:
                self.buf.index_copy_(0, idx, whole)
        tail = nbytes - full * b
        if tail:
            if out:
                row[full * b :].copy_(self.buf[blocks[full], :tail])
            else:
                self.buf[blocks[full], :tail].copy_(row[full * b :])

    def used_bytes(self) -> int:
        with self._lock:
            return (self.n_blocks - len(self.free)) * self.block

    def check(self) -> None:
        """Assert the block invariants (tests)."""
        with self._lock:
            used = [b for blocks in self.entries.values() for b in blocks]
            assert len(used) == len(set(used)), "a block is in two entries"
            assert not set(used) & set(self.free), "a block is both free and in use"
            assert len(used) + len(self.free) == self.n_blocks, "a block is lost"
            assert self.prefetched <= set(self.entries)
            assert self.n_blocks * self.block <= self.budget

    def stats(self) -> dict[str, Any]:
        with self._lock:
            per: dict[str, Any] = {}
            for p in self.slot_bytes:
                looks = self.hits[p] + self.misses[p]
                per[p.value] = {
                    "hits": self.hits[p], "misses": self.misses[p], "hit_rate": self.hits[p] / looks if looks else 0.0,
                    "inserts": self.inserts[p], "evictions": self.evictions[p],
                    "experts": sum(k[1] == p for k in self.entries), "entry_bytes": self.slot_bytes[p],
                }  # fmt: skip
            looks = sum(self.hits.values()) + sum(self.misses.values())
            return {
                "budget_bytes": self.budget, "block_bytes": self.block, "blocks": self.n_blocks,
                "used_bytes": (self.n_blocks - len(self.free)) * self.block,
                "hit_rate": sum(self.hits.values()) / looks if looks else 0.0,
                "prefetch_used": self.pf_used, "prefetch_wasted": self.pf_wasted,
                "prefetch_pending": len(self.prefetched),
                "precisions": per,
            }  # fmt: skip
