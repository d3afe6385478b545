"""Least-frequently-used eviction: evict the candidate accessed least often, ties -> least recently.

Frequency is counted over the whole history: every insert (a miss) and every access (a hit)
adds one, and counts SURVIVE eviction, so an expert that was popular, evicted and fetched
again comes back with its old count. This is "perfect" LFU. The alternative, "in-cache" LFU
(counts reset on eviction), lets a freshly inserted expert with count 1 be evicted at the next
miss of any other expert, which in MoE traces (a steady stream of one-off cold experts) turns
it into a FIFO over the cold experts and lets a popular expert that was once evicted starve;
whole-history counts rank experts by their long-run popularity, which is what LFU is meant to
measure (HybriMoE IV-D cites LFU as the frequency-based baseline).

Ties in count go to the least recently used (insert or access) candidate.

Invariants: the victim is always one of the candidates; each candidate that is resident
(inserted and not evicted since) is ranked by (count, last use), lower first. Victim search
is a lazy heap: O(log n) amortised per access and per eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable

from numpy.typing import ArrayLike

from moetier.policies.cache_base import heap_victim


class LFUPolicy:
    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}  # whole-history accesses (survives eviction)
        self._last: dict[Hashable, int] = {}  # tick of the last insert/access
        self._resident: set[Hashable] = set()
        self._heap: list[tuple[int, int, Hashable]] = []  # (count, last, key); stale entries allowed
        self._tick = 0

    def _touch(self, key: Hashable) -> None:
        self._tick += 1
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = self._tick
        if key in self._resident:
            heapq.heappush(self._heap, (self._count[key], self._tick, key))
            if len(self._heap) > 4 * len(self._resident) + 64:
                self._rebuild()

    def _rebuild(self) -> None:
        """Drop stale entries: one entry per resident key."""
        self._heap = [(self._count[k], self._last[k], k) for k in self._resident]
        heapq.heapify(self._heap)

    def count(self, key: Hashable) -> int:
        """Accesses (inserts + hits) of `key` so far; 0 if never seen."""
        return self._count.get(key, 0)

    def on_insert(self, key: Hashable) -> None:
        self._resident.add(key)
        self._touch(key)

    def on_access(self, key: Hashable) -> None:
        self._touch(key)

    def on_evict(self, key: Hashable) -> None:
        self._resident.discard(key)  # its count stays

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        pass  # frequency only

    def _current(self, entry: tuple[int, int, Hashable]) -> bool:
        """False for a stale heap entry: its key was evicted, or touched since."""
        count, last, key = entry
        return key in self._resident and count == self._count[key] and last == self._last[key]

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return heap_victim(self._heap, candidates, self._current)
