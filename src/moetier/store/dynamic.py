"""DynamicStore: every expert resident at a high or a low precision, switched online (DynaExq 3.3-3.5).

Two pools of fixed-size slots live in the compute tier: `hi` (n_hot + transient slots) and `lo`
(n_experts - n_hot + spare slots), plus the sources' staging buffers. The `transient` high slots
and the `spare` low slots are the transient buffer of paper 3.4 ("a small transient buffer absorbs
transfer bursts, allowing multiple in-flight promotions without exceeding the memory budget"): the
controller keeps at most n_hot experts at hi between switches, so they are free then. All of it is
allocated once and sized so that pool bytes + staging bytes <= the expert budget; a switch
allocates no pool memory. A CPU-side index maps each expert to its registered `Version`
(precision, slot).

A switch of expert e to precision p runs in two halves, so that several can be in flight
(store/mover.py SwitchPipeline calls `begin_switch` in plan order on one thread and `finish_switch`
on worker threads; `switch` does both at once):
1. `begin_switch` takes a free slot of pool p; if none is free it waits for one that a switch in
   flight (into the other pool) or a forward holding a retired version will free, and fails at once
   if nothing will (moves come in pairs from policies.precision.order_switches, so that means a
   paired move failed). A second switch of an expert waits for its first to register;
2. `finish_switch` fills that slot: from the host DRAM cache when it holds e at p (store/dram.py,
   the paper's SSD -> DRAM -> HBM hierarchy), else from p's disk tier, keeping a copy in the cache;
   the slot is registered to nobody, so no forward can see it half-written;
3. then registers it under the lock: the index now points at the new version, and the old
   one is reclaimed at once, or when the last forward holding it releases it.

A failed read (EIO, a file truncated or replaced under the engine) raises ExpertReadError naming the
file and the expert out of `acquire` on a first touch (the slot goes back to the free list); a
switch's or a stage's failure goes to the mover's record (the slot is freed, the old version stays
registered); `faults` (store/source.py FaultLog) counts every one.

Invariants (tested, also with several switches in flight):
- every slot is in exactly one state: free, registered, in flight, or retired-but-pinned;
- a forward reads only registered versions (acquire pins the version it returns);
- a key has exactly one registered version and at most one switch in flight;
- pool bytes (transient slots included) + staging bytes <= budget, so resident bytes never exceed
  it; the DRAM cache's blocks + its scratch slot <= the host cache budget.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moetier.config import format_size
from moetier.errors import BudgetError
from moetier.store.dram import DramCache
from moetier.store.source import FaultLog, as_read_error
from moetier.types import ExpertKey, Precision

if TYPE_CHECKING:
    from moetier.store.source import ExpertSource, Pool


@dataclass(frozen=True)
class Version:
    precision: Precision
    slot: int


@dataclass(frozen=True)
class Ticket:
    """A switch begun: `slot` of pool `precision` is reserved (in flight) for `key`."""

    key: ExpertKey
    precision: Precision
    slot: int


@dataclass
class _PoolState:
    source: ExpertSource
    pool: Pool
    free: list[int]
    inflight: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    peak_used: int = 0

    def used(self) -> int:
        return self.pool.n_slots - len(self.free)


class DynamicStore:
    # what the runtime may wire on this store (runtime/executors/base.py names them)
    capabilities: ClassVar[frozenset[str]] = frozenset({"precision_switching"})

    def __init__(
        self,
        hi: ExpertSource,
        lo: ExpertSource,
        keys: list[ExpertKey],
        n_hot: int,
        spare: int,
        device: torch.device,
        budget: int,
        per_layer: dict[int, int] | None = None,  # how the n_hot slots split over layers (the controller's quotas)
        transient: int = 0,  # high slots of the transient buffer, beyond the n_hot quota
        cache_bytes: int = 0,  # host DRAM cache of both precisions (0: none)
    ) -> None:
        # 1. pool sizes: n_hot + transient high slots, the rest low plus spares; refuse what cannot fit
        self.keys, self.device, self.budget = keys, device, budget
        self.per_layer = per_layer if per_layer is not None else {}
        self.hi_precision, self.lo_precision = hi.precision, lo.precision
        self.n_hot, self.transient, self.spare = n_hot, transient, spare
        n_lo = len(keys) - n_hot + spare
        if not 1 <= n_hot <= len(keys):
            raise BudgetError(
                f"dynamic precision needs between 1 and {len(keys)} high-precision slots, got {n_hot}; "
                f"with no room for one {hi.precision} expert, use the static {lo.precision} precision instead"
            )
        if transient < 0:
            raise ValueError(f"transient slots must be >= 0, got {transient}")
        self.staging_bytes = hi.staging_bytes + lo.staging_bytes
        self.transient_bytes = transient * hi.slot_bytes + spare * lo.slot_bytes
        need = (n_hot + transient) * hi.slot_bytes + n_lo * lo.slot_bytes + self.staging_bytes
        if need > budget:
            raise BudgetError(
                f"dynamic precision: {n_hot} + {transient} transient {hi.precision} and {n_lo} {lo.precision} "
                f"expert slots and {format_size(self.staging_bytes)} staging need {format_size(need)}, over the "
                f"budget of {format_size(budget)}"
            )
        # 2. the pools, allocated once; a slot on CUDA is filled through a pinned host slot
        self.pools: dict[Precision, _PoolState] = {}
        for src, n in ((hi, n_hot + transient), (lo, n_lo)):
            pool = src.make_pool(n, device)
            free = list(range(n - 1, -1, -1))
            self.pools[src.precision] = _PoolState(src, pool, free)
        self._stage = (
            {p: st.source.make_pool(1, torch.device("cpu"), pin=True) for p, st in self.pools.items()}
            if device.type == "cuda" else {}
        )  # fmt: skip
        self._stage_locks = {p: threading.Lock() for p in self.pools}  # several fills in flight share a stage
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # unverified on GPU here
        # 3. the host DRAM cache (both precisions) and the scratch slot a prefetch reads into
        self.cache: DramCache | None = None
        self._scratch: Pool | None = None
        self._scratch_lock = threading.Lock()
        if cache_bytes:
            self.cache = DramCache(cache_bytes, {p: st.pool.slot_bytes for p, st in self.pools.items()},
                                   reserve=hi.slot_bytes)  # fmt: skip
            self._scratch = hi.make_pool(1, torch.device("cpu"))
        # 4. the index and counters
        self.index: dict[ExpertKey, Version] = {}
        self._moving: set[ExpertKey] = set()  # keys with a switch in flight
        self.peak_inflight = 0  # most switches in flight at once
        self._pins: Counter[Version] = Counter()
        self._held: dict[ExpertKey, list[Version]] = {}
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._count_lock = threading.Lock()
        self.closed = False
        self.promotions = self.demotions = self.hits = self.misses = 0
        self.disk_bytes = self.h2d_bytes = 0
        self.prefetch_issued = 0  # high-precision experts staged disk -> DRAM ahead of a predicted promotion
        self.faults = FaultLog()  # failed expert reads: first touches, switches and stages (Engine.health)

    # -- forward side --------------------------------------------------------------
    def acquire(self, key: ExpertKey) -> Any:
        """Views of the registered version of `key`, pinned until release(key); loads the low
        version on the first touch."""
        with self._lock:
            return self._acquire_locked(key)

    def _acquire_locked(self, key: ExpertKey) -> Any:
        version = self.index.get(key)
        if version is None:
            version = self._load_locked(key, self.lo_precision)
            self.misses += 1
        else:
            self.hits += 1
        self._pins[version] += 1
        self._held.setdefault(key, []).append(version)
        return self.pools[version.precision].pool.views[version.slot]

    def acquire_many(self, keys: Sequence[ExpertKey]) -> list[Any]:
        """`acquire` of a layer call's experts under one lock (registered versions first: a first touch loads
        its low version); views in the order of `keys`. On a failure the versions pinned so far are released."""
        out: list[Any] = []
        with self._lock:
            try:
                for key in keys:
                    out.append(self._acquire_locked(key))
            except BaseException:
                for key in keys[: len(out)]:
                    self._release_locked(key)
                raise
        return out

    def release(self, key: ExpertKey) -> None:
        with self._lock:
            self._release_locked(key)

    def release_many(self, keys: Iterable[ExpertKey]) -> None:
        """`release` of every key `acquire_many` pinned, under one lock."""
        with self._lock:
            for key in keys:
                self._release_locked(key)

    def _release_locked(self, key: ExpertKey) -> None:
        version = self._held[key].pop()
        self._pins[version] -= 1
        if self._pins[version] <= 0:
            del self._pins[version]
            st = self.pools[version.precision]
            if version.slot in st.retired:  # replaced while this forward used it
                st.retired.discard(version.slot)
                st.free.append(version.slot)
                self._slot_freed.notify_all()

    def compute_pools(self) -> list[Pool]:
        """Both precisions' pools: what a native slot table is built from (kernels/step.py)."""
        return [st.pool for st in self.pools.values()]

    def pin_limit(self) -> int | None:
        """None: every expert is resident in one of the pools, so any number can be pinned at once."""
        return None

    def _load_locked(self, key: ExpertKey, precision: Precision) -> Version:
        """Demand load under the lock (first touch only: the pools hold every expert)."""
        st = self.pools[precision]
        if not st.free:
            raise BudgetError(
                f"no free {precision} slot to load {key} on first touch; the pools were sized for "
                f"{len(self.keys)} experts"
            )
        slot = st.free.pop()
        try:
            self._fill(st, key, slot)
        except BaseException as exc:
            st.free.append(slot)  # never register a partial expert
            err = as_read_error(key, exc)  # the forward's error names file and expert (counted by _read_source)
            if err is None or err is exc:
                raise
            raise err from exc
        version = Version(precision, slot)
        self.index[key] = version
        st.peak_used = max(st.peak_used, st.used())
        return version

    def preload(self, hot: Iterable[ExpertKey] = ()) -> None:
        """Make every expert resident (paper 3.5): `hot` at hi, the rest at lo. The lo pool has
        room for all but n_hot experts, so `hot` should fill the hi pool."""
        hot = set(hot)
        if len(hot) > self.pools[self.hi_precision].pool.n_slots:
            raise BudgetError(f"{len(hot)} experts to preload at {self.hi_precision} but only "
                              f"{self.pools[self.hi_precision].pool.n_slots} slots")
        for key in self.keys:
            with self._lock:
                if key not in self.index:
                    self._load_locked(key, self.hi_precision if key in hot else self.lo_precision)

    # -- mover side ----------------------------------------------------------------
    def switch(self, key: ExpertKey, precision: Precision, timeout: float = 60.0) -> bool:
        """Move `key` to `precision` now (begin and finish). False if nothing to do."""
        ticket = self.begin_switch(key, precision, timeout)
        if ticket is None:
            return False
        self.finish_switch(ticket)
        return True

    def begin_switch(self, key: ExpertKey, precision: Precision, timeout: float = 60.0) -> Ticket | None:
        """Reserve a slot of pool `precision` for `key` (waiting as the module docstring says); None if
        there is nothing to do or the store is closed."""
        st = self.pools[precision]
        other = next(s for p, s in self.pools.items() if p != precision)
        with self._lock:
            while key in self._moving:  # its earlier switch registers first
                if self.closed:
                    return None
                if not self._slot_freed.wait(timeout):
                    raise TimeoutError(f"{key}: its earlier switch did not finish in {timeout:.0f} s")
            current = self.index.get(key)
            if current is None or current.precision == precision:
                return None
            while not st.free:
                if self.closed:
                    return None
                if not st.retired and not other.inflight:  # nothing in flight or held will free one
                    raise BudgetError(
                        f"no free {precision} slot for {key}: every one holds a registered expert "
                        "(a demotion this promotion was paired with must have failed)"
                    )
                if not self._slot_freed.wait(timeout):
                    raise TimeoutError(f"no free {precision} slot for {key} after {timeout:.0f} s")
            slot = st.free.pop()
            st.inflight.add(slot)
            self._moving.add(key)
            st.peak_used = max(st.peak_used, st.used())
            self.peak_inflight = max(self.peak_inflight, sum(len(s.inflight) for s in self.pools.values()))
            return Ticket(key, precision, slot)

    def finish_switch(self, ticket: Ticket) -> None:
        """Fill the reserved slot (outside the lock: nobody can see an unregistered slot), register it,
        reclaim the old version at once unless a forward holds it. On failure the slot is freed and the
        old version stays registered."""
        key, precision, slot = ticket.key, ticket.precision, ticket.slot
        st = self.pools[precision]
        try:
            self._fill(st, key, slot)
        except BaseException:
            with self._lock:
                st.inflight.discard(slot)
                st.free.append(slot)
                self._moving.discard(key)
                self._slot_freed.notify_all()
            raise
        with self._lock:
            st.inflight.discard(slot)
            self._moving.discard(key)
            old = self.index[key]
            self.index[key] = Version(precision, slot)
            old_st = self.pools[old.precision]
            if self._pins[old]:
                old_st.retired.add(old.slot)
            else:
                old_st.free.append(old.slot)
            self._slot_freed.notify_all()
            if precision == self.hi_precision:
                self.promotions += 1
            else:
                self.demotions += 1

    def _fill(self, st: _PoolState, key: ExpertKey, slot: int) -> None:
        views = st.pool.views[slot]
        if self._stream is None:
            self._read(st, key, views)
            return
        with self._stage_locks[st.source.precision]:  # unverified on GPU here
            stage = self._stage[st.source.precision]
            self._read(st, key, stage.views[0])
            with torch.cuda.stream(self._stream):
                views.row.copy_(stage.views[0].row, non_blocking=True)
            self._stream.synchronize()
        with self._count_lock:
            self.h2d_bytes += st.pool.slot_bytes

    def _read(self, st: _PoolState, key: ExpertKey, views: Any) -> None:
        """Host views of one slot <- the DRAM cache on a hit, else the disk tier (then cached)."""
        precision = st.source.precision
        row = views.row.view(torch.uint8)  # [slot_bytes]
        if self.cache is not None and self.cache.read(key, precision, row):
            return
        n = self._read_source(st.source, key, views)
        with self._count_lock:  # not self._lock: a demand load reads under it
            self.disk_bytes += n
        if self.cache is not None:
            self.cache.write(key, precision, row)

    def stage(self, key: ExpertKey) -> bool:
        """Prefetch (paper 3.3): read `key` at the high precision from disk into the DRAM cache ahead of a
        predicted promotion. False when there is no cache, it is cached already, or `key` is at hi."""
        if self.cache is None or self._scratch is None or (key, self.hi_precision) in self.cache:
            return False
        if self.precision_of(key) == self.hi_precision:
            return False
        st = self.pools[self.hi_precision]
        with self._scratch_lock:
            views = self._scratch.views[0]
            n = self._read_source(st.source, key, views)
            wrote = self.cache.write(key, self.hi_precision, views.row.view(torch.uint8), prefetched=True)
        with self._count_lock:
            self.disk_bytes += n
            self.prefetch_issued += 1
        return wrote

    def _read_source(self, source: ExpertSource, key: ExpertKey, views: Any) -> int:
        """source.read_into, a failed read counted in `faults` (and raised as it came: the first touch turns it
        into an ExpertReadError, a switch or stage leaves it to the mover's record)."""
        try:
            return source.read_into(key, views)
        except BaseException as exc:
            err = as_read_error(key, exc)
            if err is not None:
                self.faults.record(err)
            raise

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        """Where the registered version of `key` (else its low precision) is read from, for error messages."""
        precision = self.precision_of(key) or self.lo_precision
        return self.pools[precision].source.locate(key, piece)

    # -- accounting ------------------------------------------------------------------
    def precision_of(self, key: ExpertKey) -> Precision | None:
        version = self.index.get(key)
        return version.precision if version is not None else None

    def used_bytes(self) -> int:
        """Bytes of slots in use (registered, in flight, retired) plus staging."""
        with self._lock:
            return sum(st.used() * st.pool.slot_bytes for st in self.pools.values()) + self.staging_bytes

    def check(self) -> None:
        """Assert the slot-state invariants (tests call this between and during switches)."""
        with self._lock:
            for p, st in self.pools.items():
                registered = [v.slot for v in self.index.values() if v.precision == p]
                states = [set(st.free), set(registered), st.inflight, st.retired]
                assert len(registered) == len(set(registered)), f"two experts share a {p} slot"
                union = set().union(*states)
                assert len(union) == sum(len(s) for s in states), f"a {p} slot is in two states"
                assert union == set(range(st.pool.n_slots)), f"a {p} slot is in no state"
                assert st.used() * st.pool.slot_bytes <= self.budget
            inflight = sum(len(st.inflight) for st in self.pools.values())
            assert inflight == len(self._moving), "an in-flight slot without its switch (or the reverse)"
            pools = sum(st.pool.n_slots * st.pool.slot_bytes for st in self.pools.values())
            assert pools + self.staging_bytes <= self.budget, "the pools and staging exceed the budget"
        if self.cache is not None:
            self.cache.check()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            mix = {
                p.value: {"experts": sum(v.precision == p for v in self.index.values()),
                          "bytes": sum(v.precision == p for v in self.index.values()) * st.pool.slot_bytes}
                for p, st in self.pools.items()
            }  # fmt: skip
            pool_bytes = sum(st.pool.n_slots * st.pool.slot_bytes for st in self.pools.values())
            peak = sum(st.peak_used * st.pool.slot_bytes for st in self.pools.values())
            tier = {
                "hits": self.hits, "misses": self.misses, "evictions": 0,
                "slots": sum(st.pool.n_slots for st in self.pools.values()),
                "resident_bytes": sum(m["bytes"] for m in mix.values()),
                "peak_resident_bytes": peak, "pool_bytes": pool_bytes, "budget_bytes": self.budget,
                "pools": {p.value: [st.pool.n_slots, st.pool.slot_bytes] for p, st in self.pools.items()},
            }  # fmt: skip
            out: dict[str, Any] = {
                "precision": mix, "promotions": self.promotions, "demotions": self.demotions,
                "slot_bytes": {p.value: st.pool.slot_bytes for p, st in self.pools.items()},
                "staging_bytes": self.staging_bytes, "disk_bytes": self.disk_bytes, "h2d_bytes": self.h2d_bytes,
                "read_errors": self.faults.count,
                "host": tier if self.device.type == "cpu" else _empty_tier(),
                "transient": {"hi_slots": self.transient, "lo_slots": self.spare, "bytes": self.transient_bytes,
                              "inflight": sum(len(st.inflight) for st in self.pools.values()),
                              "peak_inflight": self.peak_inflight},
                "prefetch_issued": self.prefetch_issued,
            }  # fmt: skip
            if self.device.type != "cpu":
                out["accel"] = tier
        if self.cache is not None:
            out["dram"] = self.cache.stats()
        return out

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._slot_freed.notify_all()
        for st in self.pools.values():
            st.source.close()


def _empty_tier() -> dict[str, int]:
    keys = ("hits", "misses", "evictions", "slots", "resident_bytes", "peak_resident_bytes", "pool_bytes")
    return dict.fromkeys(keys, 0) | {"budget_bytes": 0}
