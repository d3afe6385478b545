"""Expert pruning by REAP saliency: calibration text through the model, the least salient experts out.

`saliency` runs text through the engine with dense executors attached for the run (as runtime/calibrate.py
does) whose expert calls record, per (MoE layer, expert), the sum over the tokens routed to it of its gate weight
times the L2 norm of its output, and the count of those tokens; REAP's saliency is their mean
(policies/routing.py reap_saliency). `prune_table` keeps the round(fraction * E) least salient experts of each
layer (policies/routing.py choose_pruned); runtime/route_override.py PruneFile writes and reads them, and the
engine masks them out of routing (RoutingConfig.prune), so they are never read.

Invariants: the model runs its full routing (no override) and full-precision experts of the engine it is given;
the engine's pipelines are restored afterwards, also on error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from moetier.errors import ConfigError
from moetier.policies.routing import choose_pruned, reap_saliency
from moetier.runtime.calibrate import run_recording
from moetier.runtime.executors.base import ExpertStoreLike, Grouped, execute_per_expert, group_by_expert
from moetier.types import Plan


class _SaliencyExecutor:
    """A layer's dense executor that records, per expert, sum(gate weight x ||output||_2) and the token count."""

    def __init__(self, store: ExpertStoreLike, fn: Any, num_experts: int) -> None:
        self.store, self.fn, self.num_experts = store, fn, num_experts
        self.sums = np.zeros(num_experts, dtype=np.float64)  # [E]
        self.tokens = np.zeros(num_experts, dtype=np.int64)  # [E]

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        return group_by_expert(ids, weights, self.num_experts)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H] (base.execute_per_expert), recording each expert's term."""
        order: Iterator[int] = iter([t.key.expert for t in plan.tasks])  # the order execute_per_expert computes

        def fn(xs: torch.Tensor, views: Any) -> torch.Tensor:
            e = next(order)
            y = self.fn(xs, views)  # [c, H]
            norms = y.float().norm(dim=-1)  # [c]
            # decode: grouped.data is expert -> gate weight; else expert -> (tokens [c], weights [c])
            w = torch.tensor([float(grouped.data[e])]) if x.shape[0] == 1 else grouped.data[e][1].float()
            self.sums[e] += float((w.cpu() * norms.cpu()).sum())
            self.tokens[e] += int(norms.shape[0])
            return y

        return execute_per_expert(self.store, fn, x, plan, grouped)


def saliency(engine: Any, ids: Sequence[int], window: int,
             on_window: Callable[[int, int], None] | None = None) -> dict[int, npt.NDArray[np.float64]]:  # fmt: skip
    """Run `ids` through the engine's model in windows of `window` tokens; return layer -> REAP saliency [E]."""
    blocks = engine.loaded.blocks
    if not blocks:
        raise ConfigError("the model has no MoE layers to prune")
    if len(ids) < 2:
        raise ConfigError(f"calibration text has {len(ids)} tokens; give at least a few hundred")
    recorders = {b.layer: _SaliencyExecutor(b.store, b.expert_fn, b.num_experts) for b in blocks}
    run_recording(engine, dict(recorders), ids, window, on_window)
    return {layer: reap_saliency(r.sums, r.tokens) for layer, r in recorders.items()}


def prune_table(scores: dict[int, npt.NDArray[np.float64]], fraction: float, top_k: int) -> dict[int, list[int]]:
    """Layer -> the experts to prune: the round(fraction * E) least salient (at most E - top_k)."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"--fraction must be in (0, 1), got {fraction}")
    return choose_pruned(scores, fraction, top_k)


def model_shape(info: Any) -> dict[str, Any]:
    """What a pruning file records of its model (route_override.PruneFile.load checks it)."""
    return {"path": info.path, "family": info.family, "num_experts": info.num_experts, "top_k": info.top_k,
            "moe_layers": list(info.moe_layers), "hidden_size": info.hidden_size}  # fmt: skip


__all__ = ["model_shape", "prune_table", "saliency"]
