"""The fast tier's expert cache in the simulator: one global set of resident routed experts
with a fixed slot count, ranked for eviction by a `CachePolicy` (policies/cache_*.py) (`FastCache`),
or one such cache per MoE layer, each with its own slot count and policy instance, so that layers never
compete for slots (`LayerCaches`: AdapMoE's per-layer allocation, sized by policies/cache_alloc.py).
Both offer the same operations, so the simulator drives either.

Invariants:
- `len(resident) <= capacity` at all times (per layer for `LayerCaches`); capacity 0 admits nothing.
- The policy hears about every insert, access and eviction of this cache, in order.
- Pinned keys are never evicted: the experts of the layer call now running, and prefetched
  experts until the call they were fetched for has run (pins are counted, so a key may be
  pinned for both reasons). `evictable` = resident minus pinned, kept incrementally (no
  per-admission rebuild of the candidate set, which matters at a thousand slots).
- Prefetched experts are tracked until first accessed (counted `used`) or evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from numpy.typing import ArrayLike

from moetier.policies.cache_base import CachePolicy
from moetier.types import ExpertKey


class FastCache:
    def __init__(self, capacity: int, policy: CachePolicy) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.resident: set[ExpertKey] = set()
        self.evictable: set[ExpertKey] = set()
        self._pins: dict[ExpertKey, int] = {}
        self.prefetched: set[ExpertKey] = set()  # arrived by prefetch, not yet accessed
        self.used_prefetches = 0
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        """A layer call's router scores, for the policy."""
        self.policy.on_route(layer, scores)

    def warm(self, keys: Iterable[ExpertKey]) -> None:
        """Initial placement: insert up to `capacity` keys (in the given order)."""
        for key in keys:
            if len(self.resident) >= self.capacity:
                break
            if key not in self.resident:
                self._insert(key)

    def pin(self, keys: Collection[ExpertKey]) -> None:
        """Not evictable until unpinned as many times (resident or not)."""
        for k in keys:
            self._pins[k] = self._pins.get(k, 0) + 1
            self.evictable.discard(k)

    def unpin(self, keys: Collection[ExpertKey]) -> None:
        for k in keys:
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
                continue
            self._pins.pop(k, None)
            if k in self.resident:
                self.evictable.add(k)

    def access(self, key: ExpertKey) -> bool:
        """An access of the running call; True on a hit."""
        if key not in self.resident:
            return False
        self.policy.on_access(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.used_prefetches += 1
        return True

    def admit(self, key: ExpertKey, prefetched: bool = False) -> bool:
        """Insert `key`, evicting the policy's victim among unprotected residents when full.
        False when it cannot be placed (no slots, or every resident is pinned)."""
        if key in self.resident:
            return True
        if self.capacity == 0:
            return False
        if len(self.resident) >= self.capacity:
            if not self.evictable:
                return False
            victim = self.policy.victim(self.evictable)
            if victim not in self.evictable:
                raise RuntimeError(f"cache policy returned {victim!r}, not one of the candidates")
            self._evict(victim)
        self._insert(key)
        if prefetched:
            self.prefetched.add(key)
        return True

    def _insert(self, key: ExpertKey) -> None:
        self.resident.add(key)
        if key not in self._pins:
            self.evictable.add(key)
        self.policy.on_insert(key)

    def _evict(self, key: ExpertKey) -> None:
        self.resident.discard(key)
        self.evictable.discard(key)
        self.prefetched.discard(key)
        self.policy.on_evict(key)
        self.evictions += 1


class LayerCaches:
    """One `FastCache` per MoE layer: `slots[layer]` slots and a fresh policy from `make_policy` each; a key
    goes to its layer's cache. The policy of a layer hears that layer's routes and keys only."""

    def __init__(self, slots: Mapping[int, int], make_policy: Callable[[], CachePolicy]) -> None:
        self.caches = {int(layer): FastCache(n, make_policy()) for layer, n in slots.items()}
        self.capacity = sum(c.capacity for c in self.caches.values())

    def _cache(self, key: ExpertKey) -> FastCache:
        c = self.caches.get(key.layer)
        if c is None:
            raise KeyError(f"expert {tuple(key)}: layer {key.layer} has no cache (layers {sorted(self.caches)[:8]})")
        return c

    def __contains__(self, key: object) -> bool:
        return isinstance(key, ExpertKey) and key.layer in self.caches and key in self.caches[key.layer]

    def __len__(self) -> int:
        return sum(len(c) for c in self.caches.values())

    @property
    def resident(self) -> set[ExpertKey]:
        return set().union(*(c.resident for c in self.caches.values()))

    @property
    def used_prefetches(self) -> int:
        return sum(c.used_prefetches for c in self.caches.values())

    @property
    def evictions(self) -> int:
        return sum(c.evictions for c in self.caches.values())

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        self.caches[layer].on_route(layer, scores)

    def warm(self, keys: Iterable[ExpertKey]) -> None:
        """Initial placement: each key into its layer's cache while that one has room (in the given order)."""
        for key in keys:
            c = self._cache(key)
            if len(c) < c.capacity:
                c.warm([key])

    def pin(self, keys: Collection[ExpertKey]) -> None:
        for k in keys:
            self._cache(k).pin([k])

    def unpin(self, keys: Collection[ExpertKey]) -> None:
        for k in keys:
            self._cache(k).unpin([k])

    def access(self, key: ExpertKey) -> bool:
        return self._cache(key).access(key)

    def admit(self, key: ExpertKey, prefetched: bool = False) -> bool:
        return self._cache(key).admit(key, prefetched)
