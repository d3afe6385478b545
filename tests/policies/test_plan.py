"""plan_layer: resident experts first, then misses; token counts kept; one domain per task."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetier.policies.plan import plan_layer
from moetier.types import Domain, ExpertKey, ExpertTask, Plan


def test_resident_first_then_misses_in_expert_order():
    resident = {ExpertKey(3, 5), ExpertKey(3, 2), ExpertKey(2, 1)}  # (2, 1) is another layer's
    plan = plan_layer(3, {7: 1, 1: 4, 5: 2, 2: 3}, resident)
    assert [t.key for t in plan.tasks] == [ExpertKey(3, 2), ExpertKey(3, 5), ExpertKey(3, 1), ExpertKey(3, 7)]
    assert [t.tokens for t in plan.tasks] == [3, 2, 4, 1]
    assert list(plan.domains.values()) == [Domain.HOST] * 4 and plan.on(Domain.HOST) == plan.tasks


def test_domain_and_empty():
    plan = plan_layer(0, {0: 1}, set(), domain=Domain.ACCEL)
    assert dict(plan.domains) == {ExpertKey(0, 0): Domain.ACCEL} and plan.on(Domain.HOST) == ()
    assert plan_layer(0, {}, {ExpertKey(0, 0)}).tasks == ()


def test_plan_requires_one_domain_per_task():
    two = (ExpertTask(ExpertKey(0, 0), 1), ExpertTask(ExpertKey(0, 1), 1))
    with pytest.raises(ValueError, match="2 tasks but domains for 1 other experts"):
        Plan(tasks=two, domains={ExpertKey(0, 0): Domain.HOST})
    with pytest.raises(ValueError, match="2 tasks but domains for 2 other experts"):
        Plan(tasks=two, domains={ExpertKey(0, 0): Domain.HOST, ExpertKey(0, 2): Domain.HOST})


@given(
    st.dictionaries(st.integers(0, 31), st.integers(1, 64), max_size=12),
    st.sets(st.tuples(st.integers(0, 3), st.integers(0, 31)), max_size=40),
    st.integers(0, 3),
)
def test_plan_properties(counts, resident_raw, layer):
    resident = {ExpertKey(*r) for r in resident_raw}
    plan = plan_layer(layer, counts, resident)
    keys = [t.key for t in plan.tasks]
    assert sorted(keys) == sorted(ExpertKey(layer, e) for e in counts)  # every expert exactly once
    assert all(t.tokens == counts[t.key.expert] for t in plan.tasks)
    assert sum(t.tokens for t in plan.tasks) == sum(counts.values())
    flags = [k in resident for k in keys]
    assert flags == sorted(flags, reverse=True)  # all hits before any miss
    hits = [k.expert for k in keys if k in resident]
    misses = [k.expert for k in keys if k not in resident]
    assert hits == sorted(hits) and misses == sorted(misses)
    assert set(plan.domains) == set(keys)
