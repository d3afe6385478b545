"""One tier's bookkeeping for ExpertStore (store/store.py), and how many expert slots a budget buys.

`TierState` is a tier's slot map, free list, pins, in-flight prefetch reservations and counters;
`slots_for_budget` sizes a tier's pool from its byte budget (or from the free memory
`available_bytes` reports when there is none). The store takes its lock around every TierState
call; TierState itself is not thread-safe.

Invariants: a pinned key, or one in `exclude`, is never evicted by `take_slot`; a key maps to at
most one slot; an evicted key the last prefetch registered and nobody accessed counts as wasted,
an accessed one as used (once each); `slots_for_budget` returns at least 1 slot and at most
`total`, or raises BudgetError with the flag to set.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from moetier.config import format_size
from moetier.errors import BudgetError
from moetier.policies import CachePolicy
from moetier.store.source import Pool
from moetier.types import ExpertKey, Tier


@dataclass
class TierState:
    tier: Tier
    pool: Pool
    policy: CachePolicy
    budget: int
    slots: dict[ExpertKey, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    pins: Counter[ExpertKey] = field(default_factory=Counter)
    inflight: dict[ExpertKey, int] = field(default_factory=dict)  # key -> reserved slot, not yet registered
    prefetched: set[ExpertKey] = field(default_factory=set)  # registered by a prefetch, not accessed since
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    peak_slots: int = 0
    pf_used: int = 0  # prefetched experts accessed before eviction
    pf_wasted: int = 0  # prefetched experts evicted unaccessed

    def take_slot(self, exclude: Collection[ExpertKey] = ()) -> int | None:
        """A free slot, else the policy's victim among unpinned residents outside `exclude`
        (evicted here); None when there is neither."""
        if self.free:
            return self.free.pop()
        candidates = [k for k in self.slots if self.pins[k] == 0 and k not in exclude]
        if not candidates:
            return None
        victim = self.policy.victim(candidates)
        assert isinstance(victim, ExpertKey)
        slot = self.slots.pop(victim)
        self.policy.on_evict(victim)
        self.evictions += 1
        if victim in self.prefetched:
            self.prefetched.discard(victim)
            self.pf_wasted += 1
        return slot

    def insert(self, key: ExpertKey, slot: int) -> None:
        self.slots[key] = slot
        self.policy.on_insert(key)
        self.peak_slots = max(self.peak_slots, len(self.slots) + len(self.inflight))

    def hit(self, key: ExpertKey) -> None:
        self.hits += 1
        self.policy.on_access(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.pf_used += 1

    def hit_many(self, keys: Sequence[ExpertKey]) -> None:
        """`hit` of each key in order (one layer call's resident experts): the same counts and policy calls."""
        self.hits += len(keys)
        access = self.policy.on_access
        for key in keys:
            access(key)
        if self.prefetched:
            for key in keys:
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    self.pf_used += 1

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "slots": self.pool.n_slots,
            "resident_bytes": len(self.slots) * self.pool.slot_bytes,
            "inflight_bytes": len(self.inflight) * self.pool.slot_bytes,
            "peak_resident_bytes": self.peak_slots * self.pool.slot_bytes,
            "pool_bytes": self.pool.nbytes,
            "budget_bytes": self.budget,
        }


def available_bytes(device: torch.device) -> int | None:
    """Free memory where a pool would go: MemAvailable for the host, free CUDA memory on a GPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def slots_for_budget(
    tier: Tier, budget: int | None, slot_bytes: int, overhead: int, total: int, free: int | None = None
) -> int:
    """How many expert slots fit in `budget` after `overhead` bytes; None -> every expert, if that fits `free`."""
    if budget is None:
        if free is not None and total * slot_bytes + overhead > free:
            flag = "--host-expert-mem" if tier is Tier.HOST else "--gpu-expert-mem"
            raise BudgetError(
                f"holding all {total} experts in the {tier.value} tier needs {format_size(total * slot_bytes)} "
                f"but only {format_size(free)} is free; set a {tier.value} expert budget ({flag})"
            )
        return total
    n = (budget - overhead) // slot_bytes
    if n < 1:
        extra = f" plus the {format_size(overhead)} staging buffer" if overhead else ""
        raise BudgetError(
            f"{tier.value} expert budget of {budget} bytes ({format_size(budget)}) is smaller than one expert "
            f"slot of {slot_bytes} bytes ({format_size(slot_bytes)}){extra}; need at least {slot_bytes + overhead} "
            "bytes"
        )
    return min(n, total)


__all__ = ["TierState", "available_bytes", "slots_for_budget"]
