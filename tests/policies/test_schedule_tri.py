"""The three-domain schedulers (policies/schedule_tri_base.py protocol; klotski, ktransformers-plus, monde, gpu-ndp,
trimoe, one file each) and their registry (policies.schedulers.TRI_SCHEDULERS): declared capabilities,
hand-checked baselines, and the protocol's invariants on random calls for every scheduler."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.errors import ConfigError
from moetier.policies.schedule_tri_base import TriExpert, domain_totals
from moetier.policies.schedule_trimoe import schedule_trimoe
from moetier.policies.schedulers import SCHEDULERS, TRI_SCHEDULERS, make_tri_scheduler
from moetier.types import Domain, ExpertKey, ExpertTask, Layout

A, H, N = Domain.ACCEL, Domain.HOST, Domain.NDP
S, L = Layout.STRIPED, Layout.LOCALISED


def _te(e: int, resident: bool, calc: float, pcie: float, dram: float, dimm: int = -1) -> TriExpert:
    lay = L if dimm >= 0 else S
    return TriExpert(ExpertKey(0, e), 1, resident, lay, dimm, calc, 1.0, 0.5, pcie, dram, 0.1)


# Registry and capabilities ------------------------------------------------------------------------------------------
def test_registry_names_and_capabilities() -> None:
    assert list(TRI_SCHEDULERS) == ["klotski", "ktransformers-plus", "ktransformers-plus-split", "monde", "gpu-ndp",
                                    "trimoe"]  # fmt: skip
    assert not set(TRI_SCHEDULERS) & set(SCHEDULERS)  # one name, one machine
    caps = {}
    for name in TRI_SCHEDULERS:
        s = make_tri_scheduler(name)
        assert s.name == name and s.domains and s.domains <= {A, H, N}
        caps[name] = (set(s.domains), s.prefetches, s.relayouts, s.rebalances, s.refines)
    assert caps == {
        "klotski": ({A}, True, False, False, False),
        "ktransformers-plus": ({A, H}, True, False, False, False),
        "ktransformers-plus-split": ({A, H}, True, False, False, False),
        "monde": ({A, N}, True, False, False, False),
        "gpu-ndp": ({A, N}, True, True, True, True),
        "trimoe": ({A, H, N}, True, True, True, True),
    }
    with pytest.raises(ConfigError, match=r"unknown scheduler 'hybrimoe'; known: klotski.*trimoe"):
        make_tri_scheduler("hybrimoe")


# Hand-checked baselines ---------------------------------------------------------------------------------------------
def test_klotski_pipelines_transfers_under_compute() -> None:
    ex = [_te(0, True, 3.0, 1.0, 0.5), _te(1, False, 1.0, 2.0, 0.5), _te(2, False, 0.5, 1.5, 2.5, dimm=1)]
    out = make_tri_scheduler("klotski").schedule(ex, 2, frozenset(), 0)
    t, g = out.totals, out.greedy
    assert set(out.plan.domains.values()) == {A} and out.moves == 0 and t == g
    # compute 3 + 1 + 0.5 = 4.5; streams max(2, .5) + max(1.5, 2.5) = 4.5; DIMM 1: .5 striped + 2.5 local = 3
    assert t.gpu_s == pytest.approx(4.5) and t.dimm_s == pytest.approx((0.5, 3.0)) and t.makespan == pytest.approx(4.5)
    assert out.plan.makespan == t.makespan and out.plan.moved == (ex[1].key, ex[2].key)


def _tk(e: int, tokens: int, resident: bool, gpu: float, cpu: float, pcie: float, dimm: int = -1,
        ndp: float = 0.5) -> TriExpert:  # fmt: skip
    lay = L if dimm >= 0 else S
    return TriExpert(ExpertKey(0, e), tokens, resident, lay, dimm, gpu, cpu, ndp, pcie, 0.5, 0.1)


def test_ktransformers_split_loads_hot_experts_on_demand_until_the_gpu_would_lead() -> None:
    # the labelled upper bound (issue 17's reading): the balancing prefix of the hottest misses
    # e0 resident (GPU 1); e1 the hottest miss (CPU 4, PCIe 2); e2 a cold miss (CPU 1, PCIe 1.5)
    ex = [_tk(0, 5, True, 1.0, 9.0, 1.0), _tk(1, 9, False, 0.2, 4.0, 2.0), _tk(2, 1, False, 0.1, 1.0, 1.5)]
    plus = make_tri_scheduler("ktransformers-plus").schedule(ex, 2, frozenset(), 0)
    assert [plus.plan.domains[e.key] for e in ex] == [A, H, H]  # the paper's reading: nothing hot, all on the CPU
    assert make_tri_scheduler("ktransformers-plus").schedule(ex, 2, frozenset({1}), 0).plan.moved == (ex[1].key,)
    out = make_tri_scheduler("ktransformers-plus-split").schedule(ex, 2, frozenset(), 0)
    # k = 0: GPU 1, CPU 5 -> 5; k = 1 (e1 on demand): GPU 1 + 2, CPU 1 -> 3; k = 2: GPU 4.5, CPU 0 -> 4.5
    assert [out.plan.domains[e.key] for e in ex] == [A, A, H]
    assert out.totals.gpu_s == pytest.approx(3.0) and out.totals.cpu_s == pytest.approx(1.0)
    assert out.plan.on(H) == (ExpertTask(ex[2].key, 1),) and out.plan.moved == (ex[1].key,)
    assert out.totals == domain_totals(ex, [A, A, H], 2) and out.moves == 0
    # hottest first, whatever the predictor says: the cold miss never goes before the hot one
    slow_pcie = [ex[0], _tk(1, 9, False, 0.2, 4.0, 9.0), ex[2]]
    assert make_tri_scheduler("ktransformers-plus-split").schedule(slow_pcie, 2, frozenset({2}), 0).plan.moved == ()
    # a CPU that is never worse than loading: all misses stay on the CPU (k = 0 wins ties)
    cheap = [ex[0], _tk(1, 9, False, 0.2, 0.5, 2.0), _tk(2, 1, False, 0.1, 0.5, 1.5)]
    assert make_tri_scheduler("ktransformers-plus-split").schedule(cheap, 2, frozenset(), 0).plan.moved == ()


def test_monde_moves_hot_weights_to_the_gpu_and_cold_activations_to_ndp() -> None:
    # e0 resident; e1 striped miss (GPU only); e2, e3 localised on DIMM 0 (NDP 3 and 1); e4 localised on DIMM 1
    ex = [_tk(0, 9, True, 1.0, 9.0, 1.0), _tk(1, 8, False, 0.1, 9.0, 1.0), _tk(2, 6, False, 0.1, 9.0, 1.0, 0, 3.0),
          _tk(3, 2, False, 0.1, 9.0, 1.0, 0, 1.0), _tk(4, 1, False, 0.1, 9.0, 1.0, 1, 0.5)]  # fmt: skip
    out = make_tri_scheduler("monde").schedule(ex, 2, frozenset(), 5)
    # k = 0: GPU 1 + 1 = 2, DIMM 0: .5 (e1's striped read) + 3 + 1 = 4.5 -> 4.5;
    # k = 1 (e2, the hottest localised, to the GPU): GPU 3, DIMM 0: .5 + .5 (its host read) + 1 = 2 -> 3;
    # k = 2: GPU 4, DIMM 0 .5 + 1 -> 4. Best: k = 1
    assert [out.plan.domains[e.key] for e in ex] == [A, A, A, N, N]
    assert out.makespan == pytest.approx(3.0) and out.moves == 0 and out.totals == out.greedy
    assert out.totals == domain_totals(ex, [A, A, A, N, N], 2)


def test_klotski_overlap_with_the_window_never_slower() -> None:
    ex = [_te(0, True, 0.5, 1.0, 0.5), _te(1, False, 0.2, 2.0, 0.5), _te(2, False, 0.1, 1.5, 1.0, dimm=1)]
    k = make_tri_scheduler("klotski")
    times = [k.schedule(ex, 2, frozenset(), 0, window_s=w).makespan for w in (0.0, 1.0, 2.5, 10.0)]
    # stream 2 + 1.5 = 3.5 less the window, above compute 0.8; then DIMM 1's reads bound it: .5 striped + 1.0 local
    assert times == pytest.approx([3.5, 2.5, 1.5, 1.5])
    assert k.schedule(ex, 2, frozenset(), 0) == k.schedule(ex, 2, frozenset(), 0, window_s=0.0)
    with pytest.raises(ValueError, match="window_s"):
        k.schedule(ex, 2, frozenset(), 0, window_s=-1.0)


def test_trimoe_family_runs_the_two_phase_schedule() -> None:
    ex = [_te(0, True, 3.0, 1.0, 0.5), _te(1, False, 1.0, 2.0, 0.5), _te(2, False, 0.5, 1.5, 2.5, dimm=1)]
    assert make_tri_scheduler("trimoe").schedule(ex, 2, frozenset(), 7) == schedule_trimoe(ex, 2, max_iters=7)
    got = make_tri_scheduler("gpu-ndp").schedule(ex, 2, frozenset(), 3)
    assert got == schedule_trimoe(ex, 2, max_iters=3, domains={A, N})


# The protocol's invariants ------------------------------------------------------------------------------------------
cost = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def calls(draw: st.DrawFn) -> tuple[list[TriExpert], int, frozenset[int], int]:
    n_dimms = draw(st.integers(1, 4))
    out = []
    for i in range(draw(st.integers(0, 16))):
        local = draw(st.booleans())
        c = [draw(cost) for _ in range(6)]
        out.append(TriExpert(ExpertKey(0, i - 1), draw(st.integers(1, 64)), i == 0 or draw(st.booleans()),
                             L if local else S, draw(st.integers(0, n_dimms - 1)) if local else -1, *c))  # fmt: skip
    hot = frozenset(draw(st.sets(st.integers(0, 16), max_size=4)))
    return out, n_dimms, hot, draw(st.integers(0, 8))


@settings(max_examples=100, deadline=None)
@given(calls())
def test_every_scheduler_keeps_the_protocol(call: tuple[list[TriExpert], int, frozenset[int], int]) -> None:
    experts, n_dimms, hot, iters = call
    for name in TRI_SCHEDULERS:
        s = make_tri_scheduler(name)
        out = s.schedule(experts, n_dimms, hot, iters)
        plan = out.plan
        assert [t.key for t in plan.tasks] == [e.key for e in experts]  # each expert once, input order
        assert [t.tokens for t in plan.tasks] == [e.tokens for e in experts]
        assign = [plan.domains[e.key] for e in experts]
        assert set(assign) <= s.domains
        assert all(e.layout == L for e, d in zip(experts, assign, strict=True) if d == N)
        assert plan.moved == tuple(e.key for e, d in zip(experts, assign, strict=True) if d == A and not e.resident)
        assert plan.makespan == out.totals.makespan == out.makespan
        if name != "klotski":  # klotski pipelines its GPU time; the rest are eq. 5-7 of their plan
            assert out.totals == domain_totals(experts, assign, n_dimms)
        if not s.refines or iters == 0:
            assert out.moves == 0 and out.totals == out.greedy
        assert out.moves <= iters and out.makespan <= out.greedy.makespan * (1 + 1e-9) + 1e-12
        assert s.schedule(experts, n_dimms, hot, iters) == out  # a pure function
        if name in ("ktransformers-plus-split", "monde"):  # the balancing split: never above its k = 0 end
            other = H if name == "ktransformers-plus-split" else N
            k0 = [A if (e.resident or (other == N and e.layout == S)) else other for e in experts]
            assert out.makespan <= domain_totals(experts, k0, n_dimms).makespan * (1 + 1e-9) + 1e-12
        if name == "ktransformers-plus":  # the paper's reading: shared, resident and hot on the GPU, the rest CPU
            want = [A if (e.resident or e.key.expert < 0 or e.key.expert in hot) else H for e in experts]
            assert assign == want


@settings(max_examples=100, deadline=None)
@given(calls(), st.floats(0, 5, allow_nan=False), st.floats(0, 5, allow_nan=False))
def test_klotski_more_window_never_slower(call: tuple[list[TriExpert], int, frozenset[int], int], w1: float,
                                          w2: float) -> None:  # fmt: skip
    experts, n_dimms, hot, iters = call
    k = make_tri_scheduler("klotski")
    lo, hi = sorted((w1, w2))
    slow, fast = k.schedule(experts, n_dimms, hot, iters, window_s=lo), k.schedule(experts, n_dimms, hot, iters, hi)
    assert fast.makespan <= slow.makespan <= k.schedule(experts, n_dimms, hot, iters).makespan
    assert fast.totals.gpu_s >= sum(e.gpu_calc_s for e in experts) - 1e-12  # never below its compute
