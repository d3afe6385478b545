"""The eviction-policy protocol every cache policy implements.

A policy only ranks keys; the store owns slots and bytes. The store tells the policy
about every insert, access and eviction, and asks it for a victim among the
candidates it may evict (resident and not pinned). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol


class CachePolicy(Protocol):
    def on_insert(self, key: Hashable) -> None: ...

    def on_access(self, key: Hashable) -> None: ...

    def on_evict(self, key: Hashable) -> None: ...

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        """Return one of `candidates` to evict. `candidates` is never empty."""
        ...
