"""The eviction-policy protocol every cache policy implements.

A policy only ranks keys; the store (engine) or the replayer (simulator) owns slots and
bytes. The owner tells the policy about every insert, access and eviction, passes it the
router's scores of each layer call (`on_route`, before that call's accesses), and asks it
for a victim among the candidates it may evict (resident and not pinned). Pure Python,
no torch.

Policies that need no scores (LRU, LFU) ignore `on_route`. Belady's optimal policy needs
the future: the replayer gives it the whole access sequence up front (`cache_belady.py`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol


class CachePolicy(Protocol):
    def on_insert(self, key: Hashable) -> None: ...

    def on_access(self, key: Hashable) -> None: ...

    def on_evict(self, key: Hashable) -> None: ...

    def on_route(self, layer: int, scores: Sequence[float]) -> None:
        """Router scores of one layer call: probability per expert [E], summed over the call's
        tokens (so a prefill chunk weighs more than one decode token). Called before the call's
        accesses."""
        ...

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        """Return one of `candidates` to evict. `candidates` is never empty."""
        ...
