"""Pure decision code over plain data: no torch, no I/O (see DESIGN.md).

CACHE_POLICIES maps a policy name to its class; one file per variant.
"""

from __future__ import annotations

from collections.abc import Callable

from moetier.errors import ConfigError
from moetier.policies.cache_base import CachePolicy
from moetier.policies.cache_lru import LRUPolicy

CACHE_POLICIES: dict[str, Callable[[], CachePolicy]] = {
    "lru": LRUPolicy,
}


def make_cache_policy(name: str) -> CachePolicy:
    try:
        return CACHE_POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}; known: {', '.join(sorted(CACHE_POLICIES))}") from None


__all__ = ["CACHE_POLICIES", "CachePolicy", "LRUPolicy", "make_cache_policy"]
