"""policies/memory.py: a process budget split into the parts besides the experts and the expert budget."""

from __future__ import annotations

import pytest

from moetier.errors import BudgetError
from moetier.policies.memory import MemoryNeeds, fit_memory

NEEDS = MemoryNeeds(process=300, dense=100, kv=40, scratch=10, cache=0, margin=50)


def test_experts_get_the_rest() -> None:
    plan = fit_memory(1000, NEEDS, min_expert_bytes=64)
    assert NEEDS.fixed == 500
    assert plan.experts == 500
    d = plan.as_dict()
    assert d["budget_bytes"] == 1000 and d["expert_bytes"] == 500 and d["kv_bytes"] == 40
    assert sum(v for k, v in d.items() if k not in ("budget_bytes",)) == 1000  # the parts sum to the budget
    assert "experts 500 B" in plan.describe() and "KV cache 40 B" in plan.describe()
    assert "DRAM cache" not in plan.describe()  # a part of 0 bytes is left out


def test_too_small_names_the_smallest_budget() -> None:
    assert fit_memory(564, NEEDS, 64).experts == 64  # exactly the smallest
    with pytest.raises(BudgetError, match=r"smallest budget that runs is .* \(564 bytes\)") as exc:
        fit_memory(563, NEEDS, 64)
    assert "the process before loading" in str(exc.value)  # the largest part is named
    kv_heavy = MemoryNeeds(process=10, dense=10, kv=900, scratch=0, cache=0, margin=0)
    with pytest.raises(BudgetError, match="--max-seq-len"):
        fit_memory(500, kv_heavy, 1)


def test_bad_values() -> None:
    with pytest.raises(BudgetError, match="positive"):
        fit_memory(0, NEEDS, 1)
    with pytest.raises(ValueError, match="kv"):
        MemoryNeeds(process=1, dense=1, kv=-1, scratch=0, cache=0, margin=0)
