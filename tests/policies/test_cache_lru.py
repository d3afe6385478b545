"""LRU eviction policy: pure ranking over keys, victim always among the candidates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetier.errors import ConfigError
from moetier.policies import CACHE_POLICIES, LRUPolicy, make_cache_policy
from moetier.types import ExpertKey


def filled(*keys):
    policy = LRUPolicy()
    for k in keys:
        policy.on_insert(k)
    return policy


def test_victim_is_least_recently_used():
    a, b, c = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(1, 0)
    policy = filled(a, b, c)
    assert policy.victim([a, b, c]) == a
    policy.on_access(a)
    assert policy.victim([a, b, c]) == b
    policy.on_access(b)
    assert policy.victim([a, b, c]) == c
    policy.on_evict(c)
    assert policy.victim([a, b]) == a


def test_victim_only_among_candidates():
    a, b, c = "a", "b", "c"
    policy = filled(a, b, c)
    assert policy.victim([c, b]) == b  # a is older but not a candidate (e.g. pinned)
    assert policy.victim([c]) == c


def test_reinsert_moves_to_newest():
    policy = filled("a", "b")
    policy.on_evict("a")
    policy.on_insert("a")
    assert policy.victim(["a", "b"]) == "b"


def test_empty_or_unknown_candidates_raise():
    policy = filled("a")
    with pytest.raises(ValueError, match="at least one"):
        policy.victim([])
    with pytest.raises(ValueError, match=r"none of the candidates"):
        policy.victim(["zzz"])


def test_registry():
    assert isinstance(make_cache_policy("lru"), LRUPolicy)
    assert make_cache_policy("lru") is not make_cache_policy("lru")  # one instance per tier
    assert "lru" in CACHE_POLICIES
    with pytest.raises(ConfigError, match="'nope'") as err:
        make_cache_policy("nope")
    assert "lru" in str(err.value)


@given(st.lists(st.tuples(st.sampled_from(["touch", "evict"]), st.integers(0, 7)), max_size=60), st.data())
def test_matches_reference_order(ops, data):
    """Against a plain list: the victim is the candidate whose last insert/access is oldest."""
    policy, order = LRUPolicy(), []  # order: oldest first
    for op, k in ops:
        if op == "touch":
            if k in order:
                order.remove(k)
                policy.on_access(k)
            else:
                policy.on_insert(k)
            order.append(k)
        elif k in order:
            order.remove(k)
            policy.on_evict(k)
        if order:
            cands = data.draw(st.lists(st.sampled_from(order), min_size=1, unique=True))
            assert policy.victim(cands) == next(x for x in order if x in cands)
