"""AdapMoE's per-layer cache allocation in the simulator (SimConfig.cache_alloc): adapmoe sizes one cache per
MoE layer by the DP on the warm-up window and no layer ever holds more than its share; "global" is the one
global LRU cache it had before; the other schedulers keep one global cache."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from moetier.errors import ConfigError
from moetier.policies.costmodel import load_profile
from moetier.sim import SimConfig, simulate
from moetier.sim.residency import FastCache, LayerCaches
from moetier.specs import load_spec
from moetier.studies.synthetic import generate, preset
from moetier.traces import Call, iter_calls
from moetier.types import ExpertKey

# the gated variant (adapmoe-gated): the recorded figures below were taken with AdapMoE's gating on; the DP
# allocation is the same in adapmoe (no gating), whose default it also is
BASE = SimConfig(scheduler="adapmoe-gated", cache_ratio=0.25, prefetch_depth=1, warmup_steps=16, precision="int4")


def calls_of(model: str) -> list[Call]:
    """48 decode steps after an 8-token prompt of the fitted synthetic preset (the first 16 are the warm-up)."""
    return iter_calls(generate(preset(load_spec(model), stats="hybrimoe"), 48, prompt_len=8))


def test_adapmoe_splits_the_budget_per_layer_and_no_layer_exceeds_its_share(monkeypatch: Any) -> None:
    spec = load_spec("deepseek-v2-lite")
    budget = round(0.25 * len(spec.moe_layers) * spec.num_experts)
    peak: dict[int, int] = {}
    admit, warm = LayerCaches.admit, LayerCaches.warm

    def record(caches: LayerCaches) -> None:
        for layer, c in caches.caches.items():
            peak[layer] = max(peak.get(layer, 0), len(c))
        assert len(caches) <= budget

    def checked_admit(self: LayerCaches, key: ExpertKey, prefetched: bool = False) -> bool:
        placed = admit(self, key, prefetched)
        record(self)
        return placed

    def checked_warm(self: LayerCaches, keys: Any) -> None:
        warm(self, keys)
        record(self)

    monkeypatch.setattr(LayerCaches, "admit", checked_admit)
    monkeypatch.setattr(LayerCaches, "warm", checked_warm)
    r = simulate(spec, load_profile("a6000-5220r"), calls_of("deepseek-v2-lite"), replace(BASE, prefetch=True))
    assert r.config.cache_alloc == "dp"  # adapmoe's own allocation, the paper's
    assert set(r.layer_slots) == set(spec.moe_layers)
    assert sum(r.layer_slots.values()) == r.cache_slots == budget  # non-increasing curves: the whole budget
    assert all(0 <= n <= spec.num_experts for n in r.layer_slots.values())
    assert len(set(r.layer_slots.values())) > 1  # the layers differ (not the even split)
    assert peak and all(peak[layer] <= r.layer_slots[layer] for layer in peak)
    assert r.moves["prefetch"] > 0 and r.accesses > r.hits > 0
    assert r.as_dict()["layer_slots"] == {str(k): v for k, v in r.layer_slots.items()}


def test_global_reproduces_the_single_lru_cache() -> None:
    # recorded with the code before the per-layer allocation (one global LRU cache for adapmoe, commit f2443c6)
    prof = load_profile("a6000-5220r")
    r = simulate(load_spec("mixtral-8x7b"), prof, calls_of("mixtral-8x7b"),
                 replace(BASE, prefetch=True, cache_alloc="global"))  # fmt: skip
    assert (r.hits, r.accesses, r.evictions, r.moves["demand"], r.moves["prefetch"]) == (481, 1776, 1328, 1072, 427)
    assert (r.tbt_s, r.ttft_s) == pytest.approx((0.3039475123724288, 1.340788354518083), rel=1e-12)
    r = simulate(load_spec("deepseek-v2-lite"), prof, calls_of("deepseek-v2-lite"), replace(BASE, cache_alloc="global"))
    assert (r.hits, r.accesses, r.evictions, r.moves["demand"], r.cache_slots) == (2344, 4371, 1759, 2027, 416)
    assert (r.tbt_s, r.ttft_s) == pytest.approx((0.02279897649193654, 0.09644100464516175), rel=1e-12)
    assert r.layer_slots == {} and r.config.cache_alloc == "global"


def test_other_schedulers_keep_one_global_cache(monkeypatch: Any) -> None:
    made: list[str] = []
    init = FastCache.__init__

    def spy(self: FastCache, *a: Any, **kw: Any) -> None:
        made.append("fast")
        init(self, *a, **kw)

    monkeypatch.setattr(FastCache, "__init__", spy)
    spec, calls = load_spec("mixtral-8x7b"), calls_of("mixtral-8x7b")
    r = simulate(spec, load_profile("a6000-5220r"), calls, replace(BASE, scheduler="gpu-lru"))
    assert r.config.cache_alloc == "global" and r.layer_slots == {} and made == ["fast"]
    # a dynamic cache may ask for the DP; a static placement may not
    r = simulate(spec, load_profile("a6000-5220r"), calls, replace(BASE, scheduler="gpu-lru", cache_alloc="dp"))
    assert sum(r.layer_slots.values()) == r.cache_slots == 64
    with pytest.raises(ConfigError, match="static placement"):
        simulate(spec, load_profile("a6000-5220r"), calls, replace(BASE, scheduler="ktransformers", cache_alloc="dp"))
    with pytest.raises(ConfigError, match="cache_alloc"):
        SimConfig(cache_alloc="knapsack")
