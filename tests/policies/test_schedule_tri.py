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
    assert list(TRI_SCHEDULERS) == ["klotski", "ktransformers-plus", "monde", "gpu-ndp", "trimoe"]
    assert not set(TRI_SCHEDULERS) & set(SCHEDULERS)  # one name, one machine
    caps = {}
    for name in TRI_SCHEDULERS:
        s = make_tri_scheduler(name)
        assert s.name == name and s.domains and s.domains <= {A, H, N}
        caps[name] = (set(s.domains), s.prefetches, s.relayouts, s.rebalances, s.refines)
    assert caps == {
        "klotski": ({A}, True, False, False, False),
        "ktransformers-plus": ({A, H}, True, False, False, False),
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


def test_ktransformers_puts_misses_on_cpu_but_hot_on_gpu() -> None:
    ex = [_te(0, True, 3.0, 1.0, 0.5), _te(1, False, 1.0, 2.0, 0.5), _te(2, False, 0.5, 1.5, 0.5)]
    out = make_tri_scheduler("ktransformers-plus").schedule(ex, 2, frozenset({2}), 0)
    assert [out.plan.domains[e.key] for e in ex] == [A, H, A]
    assert out.totals.gpu_s == pytest.approx(3.0 + 1.5) and out.totals.cpu_s == pytest.approx(1.0)
    assert out.plan.on(H) == (ExpertTask(ex[1].key, 1),) and out.plan.moved == (ex[2].key,)


def test_trimoe_family_runs_the_two_phase_schedule() -> None:
    ex = [_te(0, True, 3.0, 1.0, 0.5), _te(1, False, 1.0, 2.0, 0.5), _te(2, False, 0.5, 1.5, 2.5, dimm=1)]
    assert make_tri_scheduler("trimoe").schedule(ex, 2, frozenset(), 7) == schedule_trimoe(ex, 2, max_iters=7)
    for name, iters in (("gpu-ndp", 3), ("monde", 0)):  # monde: the greedy start, whatever the budget
        got = make_tri_scheduler(name).schedule(ex, 2, frozenset(), 3)
        assert got == schedule_trimoe(ex, 2, max_iters=iters, domains={A, N})


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
