"""One tier's bookkeeping for ExpertStore (store/store.py), and how many expert slots a budget buys.

`TierState` is a tier's slot map, free list, pins, in-flight prefetch reservations and counters;
`slots_for_budget` sizes a tier's pool from its byte budget (or from the free memory
`available_bytes` reports when there is none). The store takes its lock around every TierState
call; TierState itself is not thread-safe.

Admission (a policy declaring `transient_slots` and `admit`, policies/cache_base.py): `reserve(n)` sets n
slots of the pool aside as transient. A demand `take_slot` that finds no free slot takes a transient one
without evicting anything; `insert` then asks the policy whether the new key may evict the policy's victim:
if so the victim goes and its slot becomes transient in place of the key's (the key is cached), else the key
stays in its transient slot as `bypassed` and `drop_bypassed` frees that slot at its last release. The admission's
victim is never one of `protect` (the layer call in progress, ExpertStore.pin_groups), so a call's resident
experts stay resident until their own group is pinned. A transient slot handed back on the free list (a failed
load) returns to the transient list at the next `take_slot`.

Invariants: a pinned key, or one in `exclude`, is never evicted by `take_slot` or `insert`; a key maps to at
most one slot; slots in use + free + transient == the pool's slots, and len(reserved) is constant; a bypassed
key is pinned from its insert to its drop; an evicted key the last prefetch registered and nobody accessed
counts as wasted, an accessed one as used (once each); `slots_for_budget` returns at least 1 slot and at most
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
    reserved: set[int] = field(default_factory=set)  # the transient slots (ids change as misses are admitted)
    transient: list[int] = field(default_factory=list)  # transient slots not in use
    bypassed: set[ExpertKey] = field(default_factory=set)  # keys held in a transient slot, not cached
    bypasses: int = 0  # demand misses computed from a transient slot and not cached
    protect: frozenset[ExpertKey] = frozenset()  # the layer call in progress: admission evicts none of them

    def reserve(self, n: int) -> None:
        """Set `n` free slots aside as transient (before any load); n = 0: none (every miss is cached)."""
        if n < 0 or n > len(self.free) or self.slots or self.inflight:
            raise ValueError(f"{self.tier.value} tier: cannot reserve {n} transient slots of {len(self.free)} free")
        taken = [self.free.pop(0) for _ in range(n)]  # the last ones handed out
        self.reserved, self.transient = set(taken), taken

    def take_slot(self, exclude: Collection[ExpertKey] = (), demand: bool = True) -> int | None:
        """A free slot, else (`demand`: a miss acquired now, not a prefetch) a transient slot, else the policy's
        victim among unpinned cached residents outside `exclude` (evicted here); None when there is none."""
        while self.free:
            slot = self.free.pop()
            if slot not in self.reserved:
                return slot
            self.transient.append(slot)  # a transient slot given back by a failed load
        if demand and self.transient:
            return self.transient.pop()  # whether the key is cached is decided at `insert`
        candidates = [k for k in self.slots if self.pins[k] == 0 and k not in exclude and k not in self.bypassed]
        if not candidates:
            return None
        victim = self.policy.victim(candidates)
        assert isinstance(victim, ExpertKey)
        return self._evict(victim)

    def _evict(self, victim: ExpertKey) -> int:
        """Evict the unpinned resident `victim`; its slot."""
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
        if slot in self.reserved:
            self._admit(key, slot)

    def _admit(self, key: ExpertKey, slot: int) -> None:
        """`key` was just written to transient `slot`: cache it in the place of the policy's victim when the
        policy admits it, else keep it bypassed (the caller pins it before the lock is released)."""
        admit = getattr(self.policy, "admit", None)
        protect = self.protect
        candidates = [k for k in self.slots if self.pins[k] == 0 and k not in self.bypassed and k not in protect
                      and k != key]  # fmt: skip
        if candidates:
            victim = self.policy.victim(candidates)
            if admit is None or admit(key, victim):
                assert isinstance(victim, ExpertKey)
                freed = self._evict(victim)
                self.reserved.discard(slot)
                self.reserved.add(freed)
                self.transient.append(freed)
                return
        self.bypassed.add(key)
        self.bypasses += 1

    def drop_bypassed(self, key: ExpertKey) -> None:
        """A bypassed key's last pin went: forget it and give its transient slot back."""
        self.bypassed.discard(key)
        self.transient.append(self.slots.pop(key))
        self.policy.on_evict(key)

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
            "bypasses": self.bypasses,
            "transient_slots": len(self.reserved),
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
