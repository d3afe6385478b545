"""Belady's optimal eviction (MIN): evict the candidate whose next use lies furthest in the future.

It needs the whole future access sequence, so only a trace replayer can use it
(`sim/cache_replay.py` builds the sequence of (layer, expert) accesses and passes it here); it is
the upper bound the online policies are measured against. Built without the future (the
registry entry, e.g. `--cache-policy belady` in the engine) it raises ConfigError at once.

Position tracking: the policy keeps, per key, the queue of positions at which the key occurs in
`future`. Every insert (a miss) or access (a hit) consumes the key's next position, so the
owner must report the accesses of `future` in order, each exactly once (as on_insert or
on_access); the key's next use is then the head of its queue (never again: after the end).
Reporting more accesses of a key than `future` holds raises ValueError.

Invariants: the victim is the resident candidate with the largest next use; among keys never
used again, the one inserted/accessed earliest. Lazy max-heap: O(log n) amortised per access
and eviction. For demand paging (fetch on miss, one access at a time) this is optimal: no
policy has fewer misses on the same sequence and cache size (tested against brute force).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Sequence

from numpy.typing import ArrayLike

from moetier.errors import ConfigError
from moetier.policies.cache_base import heap_victim


class BeladyPolicy:
    def __init__(self, future: Sequence[Hashable] | None = None) -> None:
        if future is None:
            raise ConfigError(
                "cache policy 'belady' needs the future access sequence; it exists only in trace replay "
                "(`moetier replay`, moetier.sim.cache_replay), not in the engine"
            )
        self._never = len(future)  # next use of a key not accessed again
        self._queue: dict[Hashable, deque[int]] = {}
        for pos, key in enumerate(future):
            self._queue.setdefault(key, deque()).append(pos)
        self._next: dict[Hashable, int] = {}  # resident key -> position of its next use
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, tick, key); stale entries allowed
        self._tick = 0

    def _consume(self, key: Hashable) -> int:
        """Consume the key's current position; return its next use."""
        queue = self._queue.get(key)
        if not queue:
            raise ValueError(f"Belady: access of {key!r} beyond the future sequence given at construction")
        queue.popleft()
        return queue[0] if queue else self._never

    def _push(self, key: Hashable, nxt: int) -> None:
        self._tick += 1
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, self._tick, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [entry for entry in self._heap if self._next.get(entry[2]) == -entry[0]]
            heapq.heapify(self._heap)

    def next_use(self, key: Hashable) -> int:
        """Position of the key's next use in the future sequence (len(future) if never)."""
        queue = self._queue.get(key)
        return queue[0] if queue else self._never

    def on_insert(self, key: Hashable) -> None:
        self._push(key, self._consume(key))

    def on_access(self, key: Hashable) -> None:
        nxt = self._consume(key)
        if key in self._next:
            self._push(key, nxt)

    def on_evict(self, key: Hashable) -> None:
        self._next.pop(key, None)

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        pass  # knows the future; needs no scores

    def _current(self, entry: tuple[int, int, Hashable]) -> bool:
        """False for a stale heap entry: its key was evicted, or used since."""
        return self._next.get(entry[2]) == -entry[0]

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return heap_victim(self._heap, candidates, self._current)
