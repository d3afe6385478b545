"""Calibration of intra-expert sparsity: text through the model, a threshold table out.

`calibrate` runs text through the engine with dense executors (runtime/executors/dense.py) whose
expert functions record, attached for the run, and
returns the ThresholdTable (kernels/sparse.py): per MoE layer and mask block size, the quantiles
of |act(gate x)| of routed experts, from streaming log2 histograms (policies/sparsity.py).
`table_summary` is what `moetier info` shows of a table; `model_identity` is what a table
records of its model.

Invariants: only SwiGLU-type experts and texts of at least a few hundred tokens are calibrated
(ConfigError otherwise); the engine's pipelines are restored afterwards, also on error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from moetier.config import SPARSITY_BLOCKS
from moetier.errors import ConfigError
from moetier.kernels.experts import SwiGLU
from moetier.kernels.qformat import linear
from moetier.kernels.sparse import ThresholdTable
from moetier.policies.sparsity import LogHistogram, thresholds_for
from moetier.runtime.executors.base import ResidentFirst
from moetier.runtime.executors.dense import DenseExecutor
from moetier.runtime.moe_block import Pipeline
from moetier.runtime.observers import ObserverList


class _Recording:
    """A layer's expert function during calibration: the dense SwiGLU of kernels/experts.py, recording
    |act(gate x)| of every (token, neuron) in histograms (per block size: the block's largest magnitude).
    It runs inside the engine's own dense expert path, so calibration sees what serving computes."""

    def __init__(self, inter: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inter, self.act = inter, act
        self.blocks = [b for b in SPARSITY_BLOCKS if inter % b == 0]
        self.hist = {b: LogHistogram() for b in self.blocks}
        self.pairs = 0

    def __call__(self, x: torch.Tensor, v: Any) -> torch.Tensor:
        gate, up = linear(x, v.w13).chunk(2, dim=-1)  # [N, I] each
        a = self.act(gate)
        mag = a.detach().abs().float().cpu().numpy()  # [N, I]
        n = mag.shape[0]
        self.pairs += n
        for b in self.blocks:
            self.hist[b].add(mag if b == 1 else mag.reshape(n, self.inter // b, b).max(-1))
        return linear(a * up, v.w2)  # [N, H]


def run_recording(
    engine: Any, executors: dict[int, Any], ids: Sequence[int], window: int,
    on_window: Callable[[int, int], None] | None = None,
) -> None:  # fmt: skip
    """Run `ids` through the engine's model in windows of `window` tokens (fresh sequences) with every MoE block's
    pipeline swapped for one of `executors[layer]` (resident-first plan, the engine's observers), then give every
    block its own pipeline back (None included), also on error. Calibration and pruning record through it."""
    saved: dict[int, Pipeline | None] = {}
    try:
        for b in engine.loaded.blocks:
            observers = b.pipeline.observers if b.pipeline is not None else ObserverList()
            saved[b.layer] = b.attach(Pipeline(ResidentFirst(b.store), executors[b.layer], observers))
        starts = list(range(0, len(ids), window))
        for n, s in enumerate(starts):
            engine.logits(torch.tensor([ids[s : s + window]]))
            if on_window is not None:
                on_window(n + 1, len(starts))
    finally:  # every block swapped so far gets its own pipeline back (None included)
        for b in engine.loaded.blocks:
            if b.layer in saved:
                b.pipeline = saved[b.layer]


def calibrate(
    engine: Any, ids: Sequence[int], window: int, model_identity: dict[str, Any], act_name: str,
    text_meta: dict[str, Any], on_window: Callable[[int, int], None] | None = None,
) -> ThresholdTable:  # fmt: skip
    """Run `ids` through the engine's model in windows of `window` tokens with recording executors;
    return the table (thresholds per layer, block size and target)."""
    blocks = engine.loaded.blocks
    fn = blocks[0].expert_fn
    if not isinstance(fn, SwiGLU):
        raise ConfigError(f"calibrate supports SwiGLU-type experts; {engine.info.family} is not supported yet")
    if len(ids) < 2:
        raise ConfigError(f"calibration text has {len(ids)} tokens; give at least a few hundred")
    recorders = {b.layer: _Recording(engine.info.expert_intermediate, fn.act) for b in blocks}
    # the dense executor, with recording expert functions
    run_recording(engine, {b.layer: DenseExecutor(b.store, recorders[b.layer], b.num_experts) for b in blocks}, ids,
                  window, on_window)  # fmt: skip
    thresholds = {layer: {b: thresholds_for(r.hist[b]) for b in r.blocks} for layer, r in recorders.items()}
    calibration = dict(text_meta) | {"tokens": len(ids), "window": window,
                                     "pairs": {str(k): r.pairs for k, r in recorders.items()}}  # fmt: skip
    zero = {str(k): round(float(r.hist[1].counts[0] / max(r.hist[1].total, 1)), 6) for k, r in recorders.items()}
    return ThresholdTable(
        model=model_identity, activation=act_name, calibration=calibration | {"zero_fraction": zero},
        thresholds=thresholds,
    )


def table_summary(path: str | os.PathLike[str], identity: dict[str, Any]) -> dict[str, Any] | None:
    """What `moetier info` shows of a sparsity table: path, tokens calibrated on, and status ("ok", or
    why the engine would refuse it); None when there is no file."""
    if not Path(path).exists():
        return None
    out: dict[str, Any] = {"path": str(path)}
    try:
        table = ThresholdTable.load(path)
        out["tokens"] = table.calibration.get("tokens")
        table.check_model(identity, path)
        out["status"] = "ok"
    except ConfigError as exc:
        out["status"] = f"refused: {exc}"
    return out


def model_identity(info: Any, source_fingerprint: str) -> dict[str, Any]:
    return {
        "path": info.path, "family": info.family, "hidden_size": info.hidden_size,
        "moe_intermediate": info.expert_intermediate, "num_experts": info.num_experts,
        "moe_layers": list(info.moe_layers), "fingerprint": source_fingerprint,
    }  # fmt: skip
