"""The eviction-policy protocol every cache policy implements.

A policy only ranks keys; the store (engine) or the replayer (simulator) owns slots and
bytes. The owner tells the policy about every insert, access and eviction, passes it the
router's scores of each layer call (`on_route`, before that call's accesses), and asks it
for a victim among the candidates it may evict (resident and not pinned). Pure Python,
no torch.

Policies that need no scores (LRU, LFU) ignore `on_route`. Belady's optimal policy needs
the future: the replayer gives it the whole access sequence up front (`cache_belady.py`).
Admission (optional, declared): a policy with an int attribute `transient_slots` > 0 and a method
`admit(key, victim) -> bool` (cache_mrs_admit.py) makes the store reserve that many slots of the pool for
demand misses and, once such a miss is written, ask whether it may evict `victim` (the policy's own pick among
the evictable residents); if not, the miss is computed from its transient slot and dropped at its last release.
Policies without these attributes get no transient slots and always admit.

`heap_victim` is the lazy-heap victim search LFU and Belady share (the victim is always a candidate).
`admission_groups` is how a layer call's experts are split for pinning under admission, one rule for the store
(ExpertStore.pin_groups) and the replayer (sim/cache_replay.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

from numpy.typing import ArrayLike


class CachePolicy(Protocol):
    def on_insert(self, key: Hashable) -> None: ...

    def on_access(self, key: Hashable) -> None: ...

    def on_evict(self, key: Hashable) -> None: ...

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        """Router scores of one layer call: probability per expert [E] (a list or a numpy vector),
        summed over the call's tokens (so a prefill chunk weighs more than one decode token). Called
        before the call's accesses."""
        ...

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        """Return one of `candidates` to evict. `candidates` is never empty."""
        ...


# Helper shared by the lazy-heap policies (LFU, Belady) -------------------------------------------------------------
def heap_victim(heap: list[Any], candidates: Iterable[Hashable], current: Callable[[Any], bool]) -> Hashable:
    """Victim search over a lazy min-heap whose entries are tuples ending in the key: pop entries in order,
    dropping stale ones (`current(entry)` False) for good, up to the first current entry whose key is a
    candidate; every current entry popped goes back (the victim too: on_evict makes it stale).
    ValueError when `candidates` is empty or none of them has a current entry."""
    allowed = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
    if not allowed:
        raise ValueError("victim() needs at least one candidate")
    skipped: list[Any] = []
    found: Hashable | None = None
    while heap:
        entry = heapq.heappop(heap)
        if not current(entry):
            continue  # stale: evicted, or touched since
        skipped.append(entry)
        if entry[-1] in allowed:
            found = entry[-1]
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    if found is None:
        raise ValueError(f"none of the candidates {sorted(map(str, allowed))[:4]} is tracked by the policy")
    return found


def admission_groups(misses: Iterable[bool], transient: int, limit: int) -> list[int]:
    """Sizes of the contiguous groups a call's experts are pinned in under admission, given per expert (in
    computing order) whether it misses: a group closes before a miss that would make it hold more than `transient`
    misses, or when it holds `limit` experts (the pool's slots); residents ride along."""
    sizes: list[int] = []
    size = held = 0
    for miss in misses:
        if size and (size == limit or (miss and held == transient)):
            sizes.append(size)
            size = held = 0
        size += 1
        held += miss
    if size:
        sizes.append(size)
    return sizes
