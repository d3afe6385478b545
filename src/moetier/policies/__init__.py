"""Pure decision code over plain data: no torch, no I/O (see DESIGN.md).

CACHE_POLICIES maps a policy name to its class; one file per variant. Every class builds with
no arguments except Belady's, which needs the future access sequence and raises ConfigError
without it (so `--cache-policy belady` fails clearly in the engine). `make_cache_policy` also
passes context a policy may use (`top_k`: MRS's p = 2k default; `future`: Belady) to the
classes that take it, and the policy's own knobs (MRS: alpha, top_p, normalize; mrs-admit also
transient_slots) to the class,
a knob it lacks being a ConfigError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from moetier.errors import ConfigError
from moetier.policies.cache_base import CachePolicy
from moetier.policies.cache_belady import BeladyPolicy
from moetier.policies.cache_lfu import LFUPolicy
from moetier.policies.cache_lru import LRUPolicy
from moetier.policies.cache_mrs import MRSPolicy
from moetier.policies.cache_mrs_admit import MRSAdmitPolicy

CACHE_POLICIES: dict[str, Callable[..., CachePolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "mrs": MRSPolicy,
    "mrs-admit": MRSAdmitPolicy,
    "belady": BeladyPolicy,
}


AUTO = "auto"  # the engine flags' default: cache_policy_for_batch picks the policy


def cache_policy_for_batch(max_batch: int) -> str:
    """The default eviction policy of an engine that decodes up to `max_batch` sequences together: LRU for one
    (it tracks one sequence's step-to-step reuse), mrs-admit for more (a batched layer call routes to most of the
    layer's experts, so a recency policy evicts everything before its next use; docs/hybrid.md, issue 29)."""
    return "mrs-admit" if max_batch > 1 else "lru"


def make_cache_policy(
    name: str, *, top_k: int | None = None, future: Sequence[Hashable] | None = None, **knobs: Any
) -> CachePolicy:
    """A fresh policy by name. `top_k` and `future` go to the classes that take them and are
    ignored by the others; `knobs` must all be parameters of the class."""
    try:
        cls = CACHE_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}; known: {', '.join(sorted(CACHE_POLICIES))}") from None
    params = inspect.signature(cls).parameters
    unknown = sorted(k for k in knobs if k not in params)
    if unknown:
        raise ConfigError(f"cache policy {name!r} takes no option {', '.join(unknown)}")
    context = {k: v for k, v in (("top_k", top_k), ("future", future)) if v is not None and k in params}
    return cls(**context, **knobs)


__all__ = [
    "AUTO",
    "CACHE_POLICIES",
    "BeladyPolicy",
    "CachePolicy",
    "LFUPolicy",
    "LRUPolicy",
    "MRSAdmitPolicy",
    "MRSPolicy",
    "cache_policy_for_batch",
    "make_cache_policy",
]
