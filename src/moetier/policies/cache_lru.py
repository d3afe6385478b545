"""Least-recently-used eviction: evict the candidate touched longest ago."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from numpy.typing import ArrayLike


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def on_evict(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def on_route(self, layer: int, scores: ArrayLike) -> None:
        pass  # recency only

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        allowed = set(candidates)
        if not allowed:
            raise ValueError("victim() needs at least one candidate")
        for key in self._order:
            if key in allowed:
                return key
        raise ValueError(f"none of the candidates {sorted(map(str, allowed))[:4]} is tracked by the policy")
