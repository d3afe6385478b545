"""One memory budget for the whole process (`--memory`): what is left for experts after everything else.

`fit_memory(budget, needs, min_expert_bytes)` splits a process budget into the parts the engine holds
besides its experts (`MemoryNeeds`: the process as it stands before loading, the dense weights, the KV
cache, scratch, the DRAM cache of dynamic precision and a margin for transient tensors) and the expert
budget, the rest. The expert budget is then sized into slots by the store (store/tier.py
slots_for_budget, staging buffers counted there), so `min_expert_bytes` is the smallest expert budget
the store takes (one slot of each kind plus its staging). Pure arithmetic, torch-free: runtime/memory.py
measures the needs of a model and applies the plan.

Invariants: a plan's parts sum to the budget exactly (experts = budget - the others); a budget under
`needs.fixed + min_expert_bytes` raises BudgetError naming that smallest budget and the largest part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetier.config import format_size
from moetier.errors import BudgetError


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes the process holds besides its expert pools."""

    process: int  # resident before the model loads: interpreter, torch and the libraries, what the caller holds
    dense: int  # every non-expert weight as the engine keeps it (attention, norms, embeddings, head, shared experts)
    kv: int  # the KV cache at its full length
    scratch: int  # the decode step's buffers and the kernels' scratch
    cache: int  # dynamic precision's host DRAM cache (--host-cache-mem)
    margin: int  # transient tensors: logits, prefill activations, the allocator's slack

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"MemoryNeeds.{name} must not be negative, got {value}")

    @property
    def fixed(self) -> int:
        """Everything but the experts."""
        return self.process + self.dense + self.kv + self.scratch + self.cache + self.margin


@dataclass(frozen=True)
class MemoryPlan:
    """A budget split: `experts` is the expert budget handed to the store (staging included)."""

    budget: int
    needs: MemoryNeeds
    experts: int

    def describe(self) -> str:
        """One line: the budget and how it is spent."""
        n = self.needs
        parts = [("process", n.process), ("dense weights", n.dense), ("KV cache", n.kv), ("scratch", n.scratch),
                 ("DRAM cache", n.cache), ("margin", n.margin), ("experts", self.experts)]  # fmt: skip
        body = ", ".join(f"{name} {format_size(v)}" for name, v in parts if v)
        return f"memory {format_size(self.budget)}: {body}"

    def as_dict(self) -> dict[str, int]:
        return {"budget_bytes": self.budget, "expert_bytes": self.experts,
                **{f"{k}_bytes": v for k, v in asdict(self.needs).items()}}  # fmt: skip


def fit_memory(budget: int, needs: MemoryNeeds, min_expert_bytes: int) -> MemoryPlan:
    """The plan for `budget` bytes: experts get what the needs leave. BudgetError when that is under
    `min_expert_bytes` (the smallest expert budget the store can run with), naming the smallest budget."""
    if budget <= 0:
        raise BudgetError(f"--memory must be positive, got {budget} bytes")
    left = budget - needs.fixed
    if left < min_expert_bytes:
        smallest = needs.fixed + min_expert_bytes
        parts = {"the process before loading": needs.process, "the dense weights": needs.dense,
                 "the KV cache": needs.kv, "scratch": needs.scratch, "the DRAM cache": needs.cache,
                 "the margin": needs.margin}  # fmt: skip
        big = max(parts, key=lambda k: parts[k])
        raise BudgetError(
            f"--memory {format_size(budget)} is too small: everything but the experts takes "
            f"{format_size(needs.fixed)} (the largest part, {big}: {format_size(parts[big])}) and the experts need "
            f"at least {format_size(min_expert_bytes)}; the smallest budget that runs is {format_size(smallest)} "
            f"({smallest} bytes)"
            + ("; a shorter --max-seq-len shrinks the KV cache" if big == "the KV cache" else "")
        )
    return MemoryPlan(budget, needs, left)


__all__ = ["MemoryNeeds", "MemoryPlan", "fit_memory"]
