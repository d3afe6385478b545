"""ExpertStore: which expert is in which slot of which tier, under fixed budgets.

Every expert is held at one precision, the one of its `source` (store/source.py): the
checkpoint's own weights, or a quantized disk tier. (DynamicStore in store/dynamic.py
holds two precisions at once.)

Tiers are disk -> host -> accelerator. The compute tier is the accelerator when the
engine runs on CUDA, else host. `acquire(key)` returns the slot views of `key` in the
compute tier, loading it on a miss (disk -> host, then host -> accelerator) and
evicting per the tier's cache policy; the expert stays pinned until `release(key)`.
`acquire(key, Tier.HOST)` pins host views without copying to the GPU (hybrid execution).
`on_route` passes a layer call's router scores to the tiers' policies (MRS).

`prefetch(keys, protect)` reserves a compute-tier slot per key at once (free, or an unpinned
victim outside `protect` that is no unused prefetch) and loads it in the background
(store/mover.py PrefetchLoads: disk -> host on a CPU machine, host -> GPU on a GPU one),
outside the store lock, registering it when complete. A forward needing an in-flight expert
waits for that load (no second read), never for one it does not need (except the disk: the
reader reads one expert at a time). A failed load frees its slot and is recorded. On a host compute tier
`acquire_many` reads a layer call's misses together (`source.read_many`: their disk reads in flight at once).

A failed read (EIO, a checkpoint file truncated or replaced under the engine) raises ExpertReadError
naming the file and the expert out of `acquire` (a demand load), or is recorded by the mover (a
prefetch); either way its slot goes back to the free list, the key is neither resident nor in flight,
and `faults` (store/source.py FaultLog) counts it. The next acquire of that key reads it again, so an
expert whose file is restored loads as before.

Per-tier bookkeeping (TierState) and pool sizing (slots_for_budget) are store/tier.py's.

Invariants (tested):
- each tier's pool is allocated once and holds floor((budget - staging) / slot) slots,
  so resident expert bytes plus in-flight loads plus the staging buffer never exceed the
  budget (an in-flight load holds a slot of the pool);
- provenance: an in-flight slot is in no index (`index`, `resident`, `views`) until it
  is fully written and registered;
- a pinned expert is never evicted; a key maps to at most one slot per tier;
- admission (a compute-tier policy declaring `transient_slots` and `admit`, policies/cache_base.py): that many
  slots of the pool (at most a quarter, none when every expert fits) are transient; a demand miss that finds
  no free slot is written to one and then either cached in place of the policy's victim or, refused, computed
  from it and dropped at its last release (store/tier.py); `pin_limit` is then the transient slots and
  `pin_groups` splits a call into contiguous groups of at most that many misses (its residents ride along), so
  the executors pin a call's experts in groups whose misses fit them;
- hits + misses of the compute tier == number of successful compute-tier acquires;
- prefetch issued == used + wasted + failed + (registered, not yet accessed or evicted)
  + in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any, ClassVar

import torch
from numpy.typing import ArrayLike

from moetier.errors import BudgetError, ExpertReadError
from moetier.policies import LFUPolicy, LRUPolicy, make_cache_policy
from moetier.policies.cache_base import admission_groups
from moetier.store.mover import PrefetchLoads
from moetier.store.source import ExpertSource, FaultLog, Pool, as_read_error
from moetier.store.tier import TierState, available_bytes, slots_for_budget
from moetier.types import ExpertKey, Precision, Tier

PRELOAD_GROUP = 16  # experts read together by `preload` (their requests in flight at once, formats/diskio.py)


class ExpertStore:
    # what the runtime may wire on this store (runtime/executors/base.py names them)
    capabilities: ClassVar[frozenset[str]] = frozenset({"static_precision", "prefetch", "route_scores", "domains"})

    def __init__(
        self,
        source: ExpertSource,
        keys: list[ExpertKey],
        device: torch.device,
        host_budget: int | None,
        accel_budget: int | None,
        policy: str = "lru",
        reserve: int = 0,  # bytes the non-expert weights will take on the compute device
        top_k: int | None = None,  # the model's top-k, for policies that rank by it (MRS)
    ) -> None:
        self.source, self.device, self.keys = source, device, keys
        self.precision: Precision = source.precision
        self.slot_bytes = source.slot_bytes
        self.staging_bytes = source.staging_bytes
        self._total, self._policy, self._reserve, self._top_k = len(keys), policy, reserve, top_k
        cpu = torch.device("cpu")
        self.host = self._tier(Tier.HOST, cpu, host_budget, self.staging_bytes, pin=device.type == "cuda")
        self.accel = self._tier(Tier.ACCEL, device, accel_budget, 0) if device.type != "cpu" else None
        self.compute = self.accel or self.host
        self.compute.reserve(_transient_slots(self.compute.policy, self.compute.pool.n_slots, len(keys)))
        self.disk_bytes = 0
        self.h2d_bytes = 0
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # notified when an in-flight load ends
        self._loads: PrefetchLoads | None = None  # the background thread, started by the first prefetch
        self.prefetch_issued = self.prefetch_failed = self.prefetch_waits = 0
        self.prefetch_wait_s = 0.0
        self.faults = FaultLog()  # failed expert reads, demand and background (Engine.health)
        self._resident = False  # every expert resident in the compute tier, for good (acquire_many)

    def _tier(
        self, tier: Tier, device: torch.device, budget: int | None, overhead: int, pin: bool = False
    ) -> TierState:
        """One tier's pool, sized from its budget (or, with none, from the device's free memory after
        the non-expert weights that will live there), all slots free."""
        free = available_bytes(device)
        if free is not None and device.type == self.device.type:
            free -= self._reserve
        n = slots_for_budget(tier, budget, self.slot_bytes, overhead, self._total, free)
        policy = make_cache_policy(self._policy, top_k=self._top_k)  # before the pool: Belady refuses here
        pool = self.source.make_pool(n, device, pin=pin)
        state = TierState(tier, pool, policy, _budget(budget, pool))
        state.free = list(range(n - 1, -1, -1))
        return state

    def _state(self, tier: Tier | None) -> TierState:
        if tier is None:
            return self.compute
        state = self.accel if tier is Tier.ACCEL else self.host if tier is Tier.HOST else None
        if state is None:
            raise ValueError(f"this store has no {tier.value} tier")
        return state

    # -- queries ---------------------------------------------------------------
    def resident(self, tier: Tier | None = None) -> set[ExpertKey]:
        state = self.compute if tier is None else (self.accel if tier is Tier.ACCEL else self.host)
        return set(state.slots) if state is not None else set()

    def inflight(self, tier: Tier | None = None) -> set[ExpertKey]:
        """Experts whose background load into `tier` (default: compute) has not registered yet."""
        with self._lock:
            return set(self._state(tier).inflight)

    def cached_keys(self) -> set[ExpertKey]:
        """Compute-tier experts resident or loading: a consistent snapshot for pricing."""
        with self._lock:
            return set(self.compute.slots) | set(self.compute.inflight)

    @property
    def index(self) -> dict[ExpertKey, int]:
        """Experts resident in the compute tier (key -> slot); planning puts these first."""
        return self.compute.slots

    @property
    def capacity(self) -> int:
        """Experts the compute tier can hold pinned at once (its slots)."""
        return self.compute.pool.n_slots

    def views(self, key: ExpertKey, tier: Tier | None = None) -> Any:
        """Views of a resident (acquired) expert in the compute tier (or `tier`)."""
        state = self._state(tier)
        return state.pool.views[state.slots[key]]

    # -- pipeline: route ------------------------------------------------------
    @property
    def wants_scores(self) -> bool:
        """Whether the policies use router scores (all but the recency/frequency ones)."""
        return not isinstance(self.compute.policy, (LRUPolicy, LFUPolicy))

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        """Router probabilities [E] of one layer call, summed over its tokens, before its accesses."""
        with self._lock:
            self.compute.policy.on_route(layer, scores)
            if self.accel is not None:
                self.host.policy.on_route(layer, scores)

    # -- pipeline: move --------------------------------------------------------
    def acquire(self, key: ExpertKey, tier: Tier | None = None) -> Any:
        """Make `key` resident in the compute tier (or `tier`) and pin it; loads on a miss, waits
        for its in-flight prefetch if one is running."""
        with self._cv:
            return self._acquire_locked(self._state(tier), key)

    def _acquire_locked(self, state: TierState, key: ExpertKey) -> Any:
        self._wait_inflight(state, key)
        slot = state.slots.get(key)
        if slot is not None:
            state.hit(key)
        else:
            slot = self._load_accel(key) if state is self.accel else self._load_host(key)
            state.misses += 1  # counted once the expert is resident, so a failed load is no miss
        state.pins[key] += 1
        return state.pool.views[slot]

    def acquire_many(self, keys: Sequence[ExpertKey]) -> list[Any]:
        """`acquire` of a layer call's experts (distinct keys) under one lock, in the resident-first order of
        the default plan: the resident ones are pinned first (hits), then the others are loaded in the order
        given (misses, waiting for in-flight prefetches), so a miss never evicts an expert this call needs.
        Returns the views in the order of `keys`. On a failure (ExpertReadError, BudgetError) the keys pinned
        so far are released and the error propagates."""
        state = self.compute
        with self._lock:  # the condition's own lock (a miss below may wait on self._cv while holding it)
            if self._resident or (len(state.slots) == self._total and not state.inflight and not state.prefetched):
                # every expert of the model resident: nothing can be evicted from now on (no miss needs a slot, no
                # prefetch has anything to load), so pins and recency no longer matter; only hits are counted, and
                # release_many has nothing to undo. Once true, for good.
                self._resident = True
                state.hits += len(keys)
                slot_of, views = state.slots, state.pool.views
                return [views[slot_of[key]] for key in keys]
            # every key resident and none loading (a decode step with its experts cached): one pass each
            slots = [state.slots.get(key) for key in keys]
            if None not in slots and not (state.inflight and any(key in state.inflight for key in keys)):
                state.hit_many(keys)
                pins, views = state.pins, state.pool.views
                for key in keys:
                    pins[key] += 1
                return [views[slot] for slot in slots]  # type: ignore[index]
            out: list[Any] = [None] * len(keys)
            pinned: list[ExpertKey] = []
            try:
                later = []
                for i, key in enumerate(keys):
                    slot = state.slots.get(key)
                    if slot is None or key in state.inflight:
                        later.append(i)
                        continue
                    state.hit(key)
                    state.pins[key] += 1
                    pinned.append(key)
                    out[i] = state.pool.views[slot]
                for i in self._read_misses(keys, later, out, pinned):
                    out[i] = self._acquire_locked(state, keys[i])
                    pinned.append(keys[i])
            except BaseException:
                for key in pinned:
                    self._unpin(state, key)
                raise
        return out

    def release(self, key: ExpertKey, tier: Tier | None = None) -> None:
        with self._lock:
            self._unpin(self._state(tier), key)

    def release_many(self, keys: Iterable[ExpertKey]) -> None:
        """`release` of every key `acquire_many` pinned, under one lock."""
        pins = self.compute.pins
        with self._lock:
            if self._resident:
                return  # acquire_many pinned nothing: every expert is resident for good (see there)
            for key in keys:
                n = pins[key] - 1
                if n > 0:
                    pins[key] = n
                else:
                    del pins[key]
                    if self.compute.bypassed and key in self.compute.bypassed:
                        self.compute.drop_bypassed(key)

    @staticmethod
    def _unpin(state: TierState, key: ExpertKey) -> None:
        pins = state.pins
        pins[key] -= 1
        if pins[key] <= 0:
            del pins[key]
            if key in state.bypassed:
                state.drop_bypassed(key)

    def compute_pools(self) -> list[Pool]:
        """The compute tier's pools (one here): what a native slot table is built from (kernels/step.py)."""
        return [self.compute.pool]

    def pin_limit(self) -> int | None:
        """How many distinct experts one `acquire_many` can pin at once: the compute tier's slots, or its transient
        slots under admission (each group's misses then fit them, so none evicts a cached expert to be computed)."""
        return len(self.compute.reserved) or self.compute.pool.n_slots

    def pin_groups(self, keys: Sequence[ExpertKey]) -> list[int]:
        """Sizes of the contiguous groups a layer call's experts `keys` (distinct, in computing order) are pinned in,
        one `acquire_many` each: groups of `pin_limit`; under admission each group holds at most as many keys that
        are not resident or loading as there are transient slots (residents ride along, up to the pool's slots), so
        each group's misses fit them and no group is split further than its misses need. Under admission `keys`
        also become the call in progress, which admission evicts nothing of (store/tier.py), so the counts hold."""
        transient = len(self.compute.reserved)
        n, limit = len(keys), transient or self.compute.pool.n_slots  # pin_limit
        if not transient:
            return [min(limit, n - g) for g in range(0, n, limit)]
        with self._lock:
            self.compute.protect = frozenset(keys)
        cached, loading, n_slots = self.compute.slots, self.compute.inflight, self.compute.pool.n_slots
        return admission_groups((key not in cached and key not in loading for key in keys), transient, n_slots)

    def preload(self) -> int:
        """Load experts into the compute tier until it is full (all of them when they fit), so
        steady-state runs do not pay first-touch reads; returns how many were loaded. Reads go in groups of up to
        PRELOAD_GROUP experts (one `acquire_many` each: their reads in flight together); they count as misses."""
        todo = [k for k in self.keys[: self.compute.pool.n_slots - len(self.compute.reserved)]
                if k not in self.compute.slots]  # fmt: skip
        step = max(1, min(PRELOAD_GROUP, self.pin_limit() or PRELOAD_GROUP))
        for i in range(0, len(todo), step):
            group = todo[i : i + step]
            self.acquire_many(group)
            self.release_many(group)
        return len(todo)

    def _wait_inflight(self, state: TierState, key: ExpertKey) -> None:
        """Lock held: if `key` is loading into `state` in the background, wait for that load."""
        if key not in state.inflight:
            return
        t0 = time.perf_counter()
        self.prefetch_waits += 1
        while key in state.inflight:
            self._cv.wait()
        self.prefetch_wait_s += time.perf_counter() - t0

    def _take_slot(self, state: TierState) -> int:
        """Lock held: a slot for a demand load; waits for an in-flight load when every other slot
        is pinned (it registers and becomes evictable)."""
        while True:
            slot = state.take_slot()
            if slot is not None:
                return slot
            if not state.inflight:
                raise BudgetError(
                    f"{state.tier.value} tier: all {state.pool.n_slots} expert slots are in use at once; "
                    f"raise the {state.tier.value} expert budget above {state.budget} bytes"
                )
            self._cv.wait()

    def _load_host(self, key: ExpertKey) -> int:
        host = self.host
        self._wait_inflight(host, key)
        if key in host.slots:  # registered by a prefetch while we waited
            return host.slots[key]
        slot = self._take_slot(host)
        try:
            self.disk_bytes += self.source.read_into(key, host.pool.views[slot])
        except BaseException as exc:
            host.free.append(slot)  # the slot holds a partial expert: never register it
            err = self.read_failed(key, exc)
            if err is None or err is exc:
                raise
            raise err from exc
        host.insert(key, slot)
        return slot

    def _read_misses(
        self, keys: Sequence[ExpertKey], later: list[int], out: list[Any], pinned: list[ExpertKey]
    ) -> list[int]:
        """Lock held, host compute tier, a source with `read_many`: the misses `later` (indices of `keys`) that are
        not loading in the background are read together (their disk reads in flight at once) into slots taken
        without waiting, then registered, pinned (into `out`, `pinned`) and counted as `_load_host` does. Returns
        the indices left for the one-at-a-time path (in flight, no slot free without waiting, or, under admission,
        no free or transient slot). A failed read frees its slot; the first one is raised once the others are
        registered."""
        read_many = getattr(self.source, "read_many", None)
        host = self.host
        if read_many is None or self.accel is not None or len(later) < 2:
            return later
        batch: list[tuple[int, int]] = []
        rest: list[int] = []
        for i in later:
            # under admission (reserved transient slots) only a free or transient slot: an eviction is the
            # admission's to decide, one miss at a time (`insert` gives the transient slot back)
            room = not host.reserved or host.free or host.transient
            new = keys[i] not in host.inflight and keys[i] not in host.slots
            slot = host.take_slot() if new and room else None
            if slot is None:
                rest.append(i)
            else:
                batch.append((i, slot))
        first: BaseException | None = None
        for (i, slot), got in zip(batch, read_many([(keys[i], host.pool.views[s]) for i, s in batch]), strict=True):
            key = keys[i]
            if isinstance(got, BaseException):
                host.free.append(slot)  # the slot holds a partial expert: never register it
                first = first or self.read_failed(key, got) or got
                continue
            self.disk_bytes += got
            host.insert(key, slot)
            host.misses += 1
            host.pins[key] += 1
            pinned.append(key)
            out[i] = host.pool.views[slot]
        if first is not None:
            raise first
        return rest

    def read_failed(self, key: ExpertKey, exc: BaseException) -> ExpertReadError | None:
        """A failed read of `key` (demand or prefetch) as its ExpertReadError, counted in `faults`; None (not
        counted) for an error that is no read failure."""
        err = as_read_error(key, exc)
        if err is not None:
            self.faults.record(err)
        return err

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        """Where expert `key` is read from (its source's file and tensor), for error messages."""
        return self.source.locate(key, piece)

    def _load_accel(self, key: ExpertKey) -> int:
        assert self.accel is not None
        host = self.host
        self._wait_inflight(host, key)
        host_slot = host.slots.get(key)
        if host_slot is None:
            host_slot = self._load_host(key)
            host.misses += 1
        else:
            host.hit(key)
        host.pins[key] += 1
        try:
            slot = self._take_slot(self.accel)
            try:
                # blocking on purpose: the host slot may be reused right after
                self.accel.pool.views[slot].row.copy_(host.pool.views[host_slot].row)
            except BaseException:
                self.accel.free.append(slot)  # never register a partial copy
                raise
            self.h2d_bytes += self.slot_bytes
            self.accel.insert(key, slot)
        finally:
            self.release(key, Tier.HOST)
        return slot

    # -- pipeline: prefetch (background) ------------------------------------------
    def prefetch(self, keys: Iterable[ExpertKey], protect: Collection[ExpertKey] = ()) -> list[ExpertKey]:
        """Start background loads of `keys` into the compute tier; returns the keys issued. A key
        already resident or in flight is skipped; a slot is a free one or an unpinned victim not in
        `protect` and not an unused prefetch; when none is left the rest are skipped."""
        if self._loads is None:
            self._loads = PrefetchLoads(self)
        return self._loads.issue(keys, protect)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued prefetch has registered or failed."""
        return self._loads.mover.drain(timeout) if self._loads is not None else True

    @property
    def prefetch_errors(self) -> list[str]:
        return list(self._loads.mover.errors) if self._loads is not None else []

    def prefetch_stats(self) -> dict[str, Any]:
        with self._lock:
            state = self.compute
            return {
                "issued": self.prefetch_issued, "used": state.pf_used, "wasted": state.pf_wasted,
                "failed": self.prefetch_failed, "pending": len(state.prefetched), "inflight": len(state.inflight),
                "waits": self.prefetch_waits, "wait_s": self.prefetch_wait_s, "errors": self.prefetch_errors[-5:],
            }  # fmt: skip

    # -- accounting ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "precision": {self.precision.value: {"experts": len(self.compute.slots),
                                                 "bytes": len(self.compute.slots) * self.slot_bytes}},
            "slot_bytes": self.slot_bytes,
            "staging_bytes": self.staging_bytes,
            "disk_bytes": self.disk_bytes,
            "h2d_bytes": self.h2d_bytes,
            "read_errors": self.faults.count,
            "host": self.host.stats(),
        }
        if self.accel is not None:
            out["accel"] = self.accel.stats()
        return out

    def close(self) -> None:
        if self._loads is not None:
            self._loads.mover.drain(30.0)
            self._loads.mover.close()
        self.source.close()


def _transient_slots(policy: object, n_slots: int, total: int) -> int:
    """Transient slots for a tier of `n_slots` under `policy`: its declared `transient_slots` (0 without), at most a
    quarter of the slots, none when every one of the `total` experts fits."""
    want = getattr(policy, "transient_slots", 0)
    return 0 if n_slots >= total else min(int(want), n_slots // 4)


def _budget(budget: int | None, pool: Pool) -> int:
    return pool.nbytes if budget is None else budget
