"""ExpertStore: which expert is in which slot of which tier, under fixed budgets.

Every expert is held at one precision, the one of its `source` (store/source.py): the
checkpoint's own weights, or a quantized disk tier. (DynamicStore in store/dynamic.py
holds two precisions at once.)

Tiers are disk -> host -> accelerator. The compute tier is the accelerator when the
engine runs on CUDA, else host. `acquire(key)` returns the slot views of `key` in the
compute tier, loading it on a miss (disk -> host, then host -> accelerator) and
evicting per the tier's cache policy; the expert stays pinned until `release(key)`.

Invariants (tested):
- each tier's pool is allocated once and holds floor((budget - staging) / slot) slots,
  so resident expert bytes plus the staging buffer never exceed the budget;
- a pinned expert is never evicted; a key maps to at most one slot per tier;
- hits + misses of the compute tier == number of acquires.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.config import format_size
from moetier.errors import BudgetError
from moetier.policies import CachePolicy, make_cache_policy
from moetier.store.source import ExpertSource, Pool
from moetier.types import ExpertKey, Precision, Tier


@dataclass
class TierState:
    tier: Tier
    pool: Pool
    policy: CachePolicy
    budget: int
    slots: dict[ExpertKey, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    pins: Counter[ExpertKey] = field(default_factory=Counter)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    peak_slots: int = 0

    def take_slot(self) -> int:
        """A free slot, evicting the policy's victim among unpinned residents if needed."""
        if self.free:
            return self.free.pop()
        candidates = [k for k in self.slots if self.pins[k] == 0]
        if not candidates:
            raise BudgetError(
                f"{self.tier.value} tier: all {self.pool.n_slots} expert slots are in use at once; "
                f"raise the {self.tier.value} expert budget above {self.budget} bytes"
            )
        victim = self.policy.victim(candidates)
        assert isinstance(victim, ExpertKey)
        slot = self.slots.pop(victim)
        self.policy.on_evict(victim)
        self.evictions += 1
        return slot

    def insert(self, key: ExpertKey, slot: int) -> None:
        self.slots[key] = slot
        self.policy.on_insert(key)
        self.peak_slots = max(self.peak_slots, len(self.slots))

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "slots": self.pool.n_slots,
            "resident_bytes": len(self.slots) * self.pool.slot_bytes,
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


class ExpertStore:
    def __init__(
        self,
        source: ExpertSource,
        keys: list[ExpertKey],
        device: torch.device,
        host_budget: int | None,
        accel_budget: int | None,
        policy: str = "lru",
        reserve: int = 0,  # bytes the non-expert weights will take on the compute device
    ) -> None:
        self.source, self.device, self.keys = source, device, keys
        self.precision: Precision = source.precision
        self.slot_bytes = source.slot_bytes
        self.staging_bytes = source.staging_bytes
        self._total, self._policy, self._reserve = len(keys), policy, reserve
        cpu = torch.device("cpu")
        self.host = self._tier(Tier.HOST, cpu, host_budget, self.staging_bytes, pin=device.type == "cuda")
        self.accel = self._tier(Tier.ACCEL, device, accel_budget, 0) if device.type != "cpu" else None
        self.compute = self.accel or self.host
        self.disk_bytes = 0
        self.h2d_bytes = 0
        self._lock = threading.RLock()

    def _tier(
        self, tier: Tier, device: torch.device, budget: int | None, overhead: int, pin: bool = False
    ) -> TierState:
        """One tier's pool, sized from its budget (or, with none, from the device's free memory after
        the non-expert weights that will live there), all slots free."""
        free = available_bytes(device)
        if free is not None and device.type == self.device.type:
            free -= self._reserve
        n = slots_for_budget(tier, budget, self.slot_bytes, overhead, self._total, free)
        pool = self.source.make_pool(n, device, pin=pin)
        state = TierState(tier, pool, make_cache_policy(self._policy), _budget(budget, pool))
        state.free = list(range(n - 1, -1, -1))
        return state

    # -- queries ---------------------------------------------------------------
    def resident(self, tier: Tier | None = None) -> set[ExpertKey]:
        state = self.compute if tier is None else (self.accel if tier is Tier.ACCEL else self.host)
        return set(state.slots) if state is not None else set()

    @property
    def index(self) -> dict[ExpertKey, int]:
        """Experts resident in the compute tier (key -> slot); planning puts these first."""
        return self.compute.slots

    @property
    def capacity(self) -> int:
        """Experts the compute tier can hold pinned at once (its slots)."""
        return self.compute.pool.n_slots

    def views(self, key: ExpertKey) -> Any:
        """Views of a resident (acquired) expert in the compute tier."""
        return self.compute.pool.views[self.compute.slots[key]]

    # -- pipeline: move --------------------------------------------------------
    def acquire(self, key: ExpertKey) -> Any:
        """Make `key` resident in the compute tier and pin it; loads on a miss."""
        with self._lock:
            state = self.compute
            slot = state.slots.get(key)
            if slot is not None:
                state.hits += 1
                state.policy.on_access(key)
            else:
                slot = self._load_accel(key) if self.accel is not None else self._load_host(key)
                state.misses += 1  # counted once the expert is resident, so a failed load is no miss
            state.pins[key] += 1
            return state.pool.views[slot]

    def preload(self) -> int:
        """Load experts into the compute tier until it is full (all of them when they fit), so
        steady-state runs do not pay first-touch reads; returns how many were loaded."""
        n = 0
        for key in self.keys[: self.compute.pool.n_slots]:
            if key not in self.compute.slots:
                self.acquire(key)
                self.release(key)
                n += 1
        return n

    def release(self, key: ExpertKey) -> None:
        with self._lock:
            pins = self.compute.pins
            pins[key] -= 1
            if pins[key] <= 0:
                del pins[key]

    def _load_host(self, key: ExpertKey) -> int:
        host = self.host
        slot = host.take_slot()
        try:
            self.disk_bytes += self.source.read_into(key, host.pool.views[slot])
        except BaseException:
            host.free.append(slot)  # the slot holds a partial expert: never register it
            raise
        host.insert(key, slot)
        return slot

    def _load_accel(self, key: ExpertKey) -> int:
        assert self.accel is not None
        host = self.host
        host_slot = host.slots.get(key)
        if host_slot is None:
            host_slot = self._load_host(key)
            host.misses += 1
        else:
            host.hits += 1
            host.policy.on_access(key)
        host.pins[key] += 1
        try:
            slot = self.accel.take_slot()
            try:
                # blocking on purpose: the host slot may be reused right after; the async mover
                # (a CUDA stream with per-slot events) comes with the precision issue
                self.accel.pool.views[slot].row.copy_(host.pool.views[host_slot].row)
            except BaseException:
                self.accel.free.append(slot)  # never register a partial copy
                raise
            self.h2d_bytes += self.slot_bytes
            self.accel.insert(key, slot)
        finally:
            host.pins[key] -= 1
            if host.pins[key] <= 0:
                del host.pins[key]
        return slot

    # -- accounting ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "precision": {self.precision.value: {"experts": len(self.compute.slots),
                                                 "bytes": len(self.compute.slots) * self.slot_bytes}},
            "slot_bytes": self.slot_bytes,
            "staging_bytes": self.staging_bytes,
            "disk_bytes": self.disk_bytes,
            "h2d_bytes": self.h2d_bytes,
            "host": self.host.stats(),
        }
        if self.accel is not None:
            out["accel"] = self.accel.stats()
        return out

    def close(self) -> None:
        self.source.close()


def _budget(budget: int | None, pool: Pool) -> int:
    return pool.nbytes if budget is None else budget
