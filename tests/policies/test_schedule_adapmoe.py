"""AdapMoE's adaptive gating (policies/schedule_adapmoe.py): only confident tokens lose experts, the fitted
threshold drops the asked fraction, and the scheduler is GPU-only with on-demand moves."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies.schedule_adapmoe import AdapMoEScheduler, fit_gate_threshold, gated_counts
from moetier.policies.schedule_adapmoe_gated import AdapMoEGatedScheduler
from moetier.policies.schedule_base import ExpertWork
from moetier.types import ExpertKey


def test_gating_drops_experts_only_for_confident_tokens() -> None:
    ids = np.array([[3, 5], [1, 2], [4, 6]])
    w = np.array([[0.9, 0.1], [0.55, 0.45], [0.5, 0.5]])  # token 0 confident, tokens 1 and 2 not
    assert gated_counts(ids, w, 0.2) == {3: 1, 1: 1, 2: 1, 4: 1, 6: 1}  # only expert 5 (weight 0.1) dropped
    assert gated_counts(ids, w, 0.0) == {e: 1 for e in (1, 2, 3, 4, 5, 6)}  # threshold 0: nothing dropped
    assert gated_counts(ids, w, 1.0) == {3: 1, 1: 1, 4: 1}  # never fewer than the top-1 expert
    # unnormalised weights are renormalised per token; the top-1 is the largest weight, wherever it sits
    assert gated_counts([[7, 8]], [[0.02, 0.18]], 0.2) == {8: 1}


def test_fitted_threshold_drops_the_asked_fraction() -> None:
    rng = np.random.default_rng(0)
    w = [rng.dirichlet(np.ones(2), size=50) for _ in range(20)]  # 1000 tokens, top-2
    ids = [np.tile([0, 1], (50, 1)) for _ in range(20)]
    for drop in (0.1, 0.25, 0.4):
        thr = fit_gate_threshold(w, drop)
        kept = sum(sum(gated_counts(i, x, thr).values()) for i, x in zip(ids, w, strict=True))
        assert kept / 2000 == pytest.approx(1 - drop, abs=0.01)
    assert fit_gate_threshold(w, 0.0) == 0.0
    flat = [np.full((10, 6), 1 / 6)]  # placeholder weights (all equal): nothing can be dropped
    assert sum(gated_counts(np.tile(np.arange(6), (10, 1)), flat[0], fit_gate_threshold(flat, 0.25)).values()) == 60
    with pytest.raises(ConfigError, match="drop"):
        fit_gate_threshold(w, 1.0)
    with pytest.raises(ConfigError, match=r"\[T, k\]"):
        gated_counts([[1, 2]], [[0.5]], 0.1)


def test_adapmoe_schedule_is_gpu_only_on_demand() -> None:
    work = [ExpertWork(ExpertKey(0, 0), 1, True, 1.0, 2.0, 3.0), ExpertWork(ExpertKey(0, 1), 1, False, 1.0, 2.0, 3.0)]
    plan = AdapMoEScheduler().schedule(work)
    assert plan.moved == (ExpertKey(0, 1),) and plan.makespan == pytest.approx(4.0)
    assert not any(op.lane == "cpu" for op in plan.ops)
    s = AdapMoEScheduler()
    # HybriMoE's AdapMoE: "adaptive prefetching and caching", LRU (Table I); no gating by default
    assert not s.gates and s.admits and s.cache_policy == "lru" and s.cache_alloc == "dp"
    g = AdapMoEGatedScheduler()  # the labelled variant: the same schedule and cache, plus gating
    assert g.gates and g.name == "adapmoe-gated" and (g.admits, g.cache_policy, g.cache_alloc) == (True, "lru", "dp")
    assert g.schedule(work) == plan
