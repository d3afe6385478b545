"""Cache policies LFU, MRS, Belady (and the registry): known victims, reference models, optimality."""

from __future__ import annotations

import itertools
import random
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import ConfigError
from moetier.policies import (
    CACHE_POLICIES,
    BeladyPolicy,
    CachePolicy,
    LFUPolicy,
    LRUPolicy,
    MRSPolicy,
    make_cache_policy,
)
from moetier.types import ExpertKey

K = ExpertKey


def build(name: str, future: list[ExpertKey]) -> CachePolicy:
    return make_cache_policy(name, top_k=2, future=future)


# -- registry and protocol -------------------------------------------------------
def test_registry_names_and_classes() -> None:
    assert set(CACHE_POLICIES) >= {"lru", "lfu", "mrs", "belady"}
    assert isinstance(make_cache_policy("lfu"), LFUPolicy)
    assert isinstance(make_cache_policy("mrs"), MRSPolicy)
    assert isinstance(make_cache_policy("lru"), LRUPolicy)
    assert make_cache_policy("mrs", top_k=3).top_p == 6  # type: ignore[attr-defined]  # p = 2k
    assert make_cache_policy("mrs").top_p is None  # type: ignore[attr-defined]  # k unknown: keep all
    assert make_cache_policy("mrs", top_k=3, top_p=4, alpha=0.2).options == {  # type: ignore[attr-defined]
        "alpha": 0.2, "top_p": 4, "normalize": False}  # fmt: skip


def test_belady_without_future_fails_clearly() -> None:
    with pytest.raises(ConfigError, match=r"belady.*future"):
        make_cache_policy("belady")
    with pytest.raises(ConfigError, match="future"):
        BeladyPolicy()


def test_unknown_names_and_knobs() -> None:
    with pytest.raises(ConfigError, match=r"'nope'.*belady"):
        make_cache_policy("nope")
    with pytest.raises(ConfigError, match="'lru' takes no option alpha"):
        make_cache_policy("lru", alpha=0.5)
    # context a policy does not use is ignored, not an error
    assert isinstance(make_cache_policy("lfu", top_k=4, future=[K(0, 0)]), LFUPolicy)


@pytest.mark.parametrize("name", sorted(CACHE_POLICIES))
def test_protocol_conformance(name: str) -> None:
    """Every registered policy: the five methods, victims among the candidates, clear errors."""
    rng = random.Random(name)
    seq = [K(rng.randrange(2), rng.randrange(4)) for _ in range(200)]
    policy = build(name, seq)
    for method in ("on_insert", "on_access", "on_evict", "on_route", "victim"):
        assert callable(getattr(policy, method))
    resident: list[ExpertKey] = []
    for key in seq:
        policy.on_route(key.layer, [0.1, 0.2, 0.3, 0.4])
        if key in resident:
            policy.on_access(key)
            continue
        if len(resident) == 3:
            cands = [k for k in resident if rng.random() < 0.7] or resident[:1]
            v = policy.victim(cands)
            assert v in cands
            resident.remove(v)
            policy.on_evict(v)
        resident.append(key)
        policy.on_insert(key)
    with pytest.raises(ValueError, match="at least one"):
        policy.victim([])
    with pytest.raises(ValueError, match="none of the candidates"):
        policy.victim([K(9, 9)])


# -- LFU ---------------------------------------------------------------------------
def test_lfu_counts_survive_eviction_and_ties_go_to_least_recent() -> None:
    a, b, c = K(0, 0), K(0, 1), K(0, 2)
    p = LFUPolicy()
    for key in (a, b, c):
        p.on_insert(key)
    assert p.victim([a, b, c]) == a  # all count 1: least recent
    p.on_access(a)
    p.on_access(a)
    assert p.victim([a, b, c]) == b
    p.on_access(b)
    assert p.victim([a, b, c]) == c  # counts a=3 b=2 c=1
    p.on_evict(a)
    assert p.victim([b, c]) == c
    p.on_insert(a)  # back with count 4 (history kept), so b and c are still lower
    assert p.count(a) == 4
    assert p.victim([a, b]) == b
    assert p.victim([a]) == a


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["touch", "evict"]), st.integers(0, 6)), max_size=80), st.data())
def test_lfu_matches_reference(ops: list[tuple[str, int]], data: st.DataObject) -> None:
    """Victim = candidate with the smallest (whole-history count, last use)."""
    p, count, last, resident = LFUPolicy(), dict[int, int](), dict[int, int](), set[int]()
    for tick, (op, k) in enumerate(ops):
        if op == "touch":
            if k in resident:
                p.on_access(k)
            else:
                p.on_insert(k)
                resident.add(k)
            count[k] = count.get(k, 0) + 1
            last[k] = tick
        elif k in resident:
            resident.discard(k)
            p.on_evict(k)
        if resident:
            cands = data.draw(st.lists(st.sampled_from(sorted(resident)), min_size=1, unique=True))
            assert p.victim(cands) == min(cands, key=lambda x: (count[x], last[x]))


# -- MRS ---------------------------------------------------------------------------
def test_mrs_eq3_update_with_top_p() -> None:
    p = MRSPolicy(alpha=0.5, top_p=2)
    p.on_route(0, [0.1, 0.6, 0.3, 0.0])  # top-2: experts 1, 2
    assert [p.score(K(0, e)) for e in range(4)] == pytest.approx([0.0, 0.3, 0.15, 0.0])
    p.on_route(0, [0.5, 0.1, 0.0, 0.4])  # top-2: experts 0, 3
    assert [p.score(K(0, e)) for e in range(4)] == pytest.approx([0.25, 0.15, 0.075, 0.2])
    assert p.score(K(1, 0)) == 0.0  # other layer untouched
    q = MRSPolicy(alpha=0.5, top_p=2, normalize=True)
    q.on_route(0, [0.2, 1.2, 0.6, 0.0])  # sum 2 (two tokens) -> divided by 2
    assert q.score(K(0, 1)) == pytest.approx(0.3)


def test_mrs_victim_lowest_score_ties_least_recent() -> None:
    p = MRSPolicy(alpha=1.0)  # S = the last call's scores
    keys = [K(0, e) for e in range(4)]
    for key in keys:
        p.on_insert(key)
    p.on_route(0, [0.4, 0.1, 0.1, 0.4])
    assert p.victim(keys) == K(0, 1)  # 1 and 2 tie at 0.1; 1 was used less recently
    p.on_access(K(0, 1))
    assert p.victim(keys) == K(0, 2)
    assert p.victim([K(0, 0), K(0, 3)]) == K(0, 0)  # tie 0.4: 0 is older
    p.on_route(1, [0.05, 0.9])  # a layer call of layer 1: its experts compete with layer 0's
    p.on_insert(K(1, 0))
    assert p.victim([*keys, K(1, 0)]) == K(1, 0)
    p.on_evict(K(1, 0))
    assert p.victim(keys) == K(0, 2)


def test_mrs_keeps_high_score_unrouted_expert() -> None:
    """The paper's point: an expert with high score stays although it was not accessed lately."""
    p, lru = MRSPolicy(alpha=0.5, top_p=4), LRUPolicy()
    hot, cold = K(0, 0), K(0, 1)
    for pol in (p, lru):
        pol.on_insert(hot)
        pol.on_insert(cold)
    for _ in range(3):
        p.on_route(0, [0.45, 0.05, 0.5, 0.0])  # expert 0 scores high without being the top-1
    assert p.victim([hot, cold]) == cold
    assert lru.victim([hot, cold]) == hot


@pytest.mark.parametrize("seed", [0, 1])
def test_mrs_vs_lru_depends_on_step_to_step_reuse(seed: int) -> None:
    """The regime behind MRS's loss on synthetic Mixtral (see cache_mrs's docstring): with 8 experts,
    top-2 and a 25% global cache, MRS's long memory (popularity) beats LRU when routing does not repeat
    from step to step, and LRU wins clearly when it does (AR(1) temporal correlation 0.4)."""
    import dataclasses

    from moetier.sim.cache_replay import replay_trace
    from moetier.studies import synthetic

    base = synthetic.SynthParams(num_layers=8, num_experts=8, top_k=2, hot_frac=0.0, warm_frac=0.5, hot_share=0.0,
                                 warm_share=0.62, spread=0.3, layer_corr=0.93, seed=seed)  # fmt: skip
    rate = {}
    for temporal in (0.0, 0.4):
        tr = synthetic.generate(dataclasses.replace(base, temporal=temporal), 500)
        rate[temporal] = {pol: replay_trace(tr, pol, 0.25).hit_rate for pol in ("lru", "mrs")}
    assert rate[0.0]["mrs"] > rate[0.0]["lru"] + 0.005  # measured: +1.6 / +2.0 points (seeds 0 / 1)
    assert rate[0.4]["lru"] > rate[0.4]["mrs"] + 0.05  # measured: -10.1 / -11.2 points


def test_mrs_bad_input() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        MRSPolicy(alpha=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        MRSPolicy(top_p=0)
    p = MRSPolicy()
    with pytest.raises(ValueError, match="finite"):
        p.on_route(0, [0.1, float("nan")])
    with pytest.raises(ValueError, match="vector"):
        p.on_route(0, [])
    with pytest.raises(ValueError, match="layer, expert"):
        p.on_insert("a")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "touch", "evict"]), st.integers(0, 1), st.integers(0, 4)),
                max_size=60), st.floats(0.05, 1.0), st.data())  # fmt: skip
def test_mrs_matches_reference(ops: list[tuple[str, int, int]], alpha: float, data: st.DataObject) -> None:
    E, top_p = 5, 2
    p = MRSPolicy(alpha=alpha, top_p=top_p)
    S = np.zeros((2, E))  # [L, E]
    last: dict[ExpertKey, int] = {}
    resident: set[ExpertKey] = set()
    for tick, (op, layer, e) in enumerate(ops):
        key = K(layer, e)
        if op == "route":
            s = np.array(data.draw(st.permutations(range(E))), dtype=float) / 4  # [E] distinct: no tie at the cut
            p.on_route(layer, s.tolist())
            kept = np.where(s >= np.sort(s)[-top_p], s, 0.0)  # [E] TopP
            S[layer] *= 1 - alpha  # same operation order as the policy: bitwise equal scores
            S[layer] += alpha * kept
        elif op == "touch":
            (p.on_access if key in resident else p.on_insert)(key)
            resident.add(key)
            last[key] = tick
        elif key in resident:
            resident.discard(key)
            p.on_evict(key)
        if resident:
            cands = data.draw(st.lists(st.sampled_from(sorted(resident)), min_size=1, unique=True))
            assert p.victim(cands) == min(cands, key=lambda k: (S[k.layer, k.expert], last[k]))


# -- Belady --------------------------------------------------------------------------
def misses_with(policy: CachePolicy, seq: list[str], slots: int) -> int:
    resident: set[str] = set()
    misses = 0
    for key in seq:
        if key in resident:
            policy.on_access(key)
            continue
        misses += 1
        if len(resident) == slots:
            v = policy.victim(set(resident))
            resident.discard(v)
            policy.on_evict(v)
        resident.add(key)
        policy.on_insert(key)
    return misses


def brute_force_misses(seq: list[str], slots: int) -> int:
    """Fewest misses over every eviction choice (demand paging)."""

    @cache
    def go(i: int, cache: frozenset[str]) -> int:
        if i == len(seq):
            return 0
        key = seq[i]
        if key in cache:
            return go(i + 1, cache)
        if len(cache) < slots:
            return 1 + go(i + 1, cache | {key})
        return 1 + min(go(i + 1, (cache - {v}) | {key}) for v in cache)

    return go(0, frozenset())


def test_belady_known_example() -> None:
    seq = list("abcdabeabcde")  # the classic: 3 frames, MIN has 7 misses (LRU 10)
    assert misses_with(BeladyPolicy(seq), seq, 3) == 7
    assert misses_with(LRUPolicy(), seq, 3) == 10
    p = BeladyPolicy(list("abcab"))
    for key in "abc":
        p.on_insert(key)
    assert p.next_use("a") == 3 and p.next_use("c") == 5  # 5: never again
    assert p.victim(["a", "b", "c"]) == "c"
    assert p.victim(["a", "b"]) == "b"  # b is used after a


def test_belady_is_optimal_on_small_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(60):
        n_keys, slots, length = rng.randint(2, 6), rng.randint(1, 3), rng.randint(1, 14)
        seq = [rng.choice("abcdef"[:n_keys]) for _ in range(length)]
        best = brute_force_misses(seq, slots)
        assert misses_with(BeladyPolicy(seq), seq, slots) == best, (trial, seq, slots)
        for name in ("lru", "lfu"):
            assert misses_with(make_cache_policy(name), seq, slots) >= best


def test_belady_access_beyond_future_raises() -> None:
    p = BeladyPolicy(["a"])
    p.on_insert("a")
    with pytest.raises(ValueError, match="beyond the future"):
        p.on_access("a")


def test_every_policy_evicts_within_candidates_under_pins() -> None:
    """A victim never comes from outside the candidates even when the best overall key is excluded."""
    seq = [K(0, e) for e in itertools.chain(range(4), [0, 1, 2, 3, 0])]
    for name in sorted(CACHE_POLICIES):
        p = build(name, seq)
        for key in seq[:4]:
            p.on_route(0, [0.4, 0.3, 0.2, 0.1])
            p.on_insert(key)
        for k in range(4):
            cands = [K(0, e) for e in range(4) if e != k]
            assert p.victim(cands) in cands
