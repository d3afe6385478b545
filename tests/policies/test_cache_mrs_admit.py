"""mrs-admit (policies/cache_mrs_admit.py): MRS's ranking and victims, plus the admission test and its knob."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies import AUTO, CACHE_POLICIES, MRSAdmitPolicy, MRSPolicy, cache_policy_for_batch, make_cache_policy
from moetier.policies.cache_mrs_admit import TRANSIENT_SLOTS_DEFAULT
from moetier.types import ExpertKey

K = ExpertKey


def test_registered_with_its_knobs() -> None:
    assert CACHE_POLICIES["mrs-admit"] is MRSAdmitPolicy
    pol = make_cache_policy("mrs-admit", top_k=3, transient_slots=4)
    assert isinstance(pol, MRSAdmitPolicy)
    assert pol.top_p == 6 and pol.transient_slots == 4
    assert pol.options == {"alpha": 0.05, "top_p": 6, "normalize": False, "transient_slots": 4}
    default = make_cache_policy("mrs-admit")
    assert isinstance(default, MRSAdmitPolicy) and default.transient_slots == TRANSIENT_SLOTS_DEFAULT
    with pytest.raises(ConfigError, match="takes no option"):
        make_cache_policy("mrs", transient_slots=2)  # plain MRS declares no transient slots
    assert not hasattr(make_cache_policy("mrs"), "admit")


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_transient_slots_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="transient_slots"):
        MRSAdmitPolicy(transient_slots=bad)  # type: ignore[arg-type,unused-ignore]


def test_admit_compares_scores_and_the_newer_wins_a_tie() -> None:
    pol = MRSAdmitPolicy(alpha=0.5)
    pol.on_route(0, [0.6, 0.3, 0.1, 0.0])
    for e in range(4):
        pol.on_insert(K(0, e))
    assert pol.admit(K(0, 0), K(0, 1)) and not pol.admit(K(0, 2), K(0, 1))
    assert pol.admit(K(0, 3), K(1, 0))  # 0 >= 0: an unrouted layer's expert has S = 0, a tie admits
    assert not pol.admit(K(1, 0), K(0, 2))


def test_victims_and_scores_are_mrs_exactly() -> None:
    """Same events -> same S and same victims as MRSPolicy (admission is only a question the store asks)."""
    rng = random.Random(3)
    a, b = MRSAdmitPolicy(top_k=2), MRSPolicy(top_k=2)
    resident: set[ExpertKey] = set()
    for _ in range(300):
        layer = rng.randrange(3)
        scores = np.asarray([rng.random() ** 3 for _ in range(8)])
        a.on_route(layer, scores)
        b.on_route(layer, scores)
        key = K(layer, rng.randrange(8))
        if key in resident:
            a.on_access(key)
            b.on_access(key)
        else:
            if len(resident) >= 6:
                cands = set(rng.sample(sorted(resident), 4))
                victim = a.victim(cands)
                assert victim == b.victim(cands) and victim in cands
                resident.discard(victim)
                a.on_evict(victim)
                b.on_evict(victim)
            resident.add(key)
            a.on_insert(key)
            b.on_insert(key)
        assert a.score(key) == b.score(key)


def test_default_policy_by_batch_size() -> None:
    """--cache-policy auto: LRU for one sequence, mrs-admit for a server that batches (cli/serve.py resolves it)."""
    assert cache_policy_for_batch(1) == "lru"
    assert cache_policy_for_batch(2) == cache_policy_for_batch(8) == "mrs-admit"
    assert AUTO == "auto" and AUTO not in CACHE_POLICIES
