"""The sparse executor: intra-expert activation sparsity for one MoE layer call, and its wiring.

`SparseExecutor` runs steps 3-5 of one TieredMoE block: it groups the call's tokens by expert,
takes the plan of the resident-first scheduler with the sparsity target and tipping point
(policies.plan), runs every task below the tipping point through one native gather call per
chunk of experts the compute tier can pin at once (kernels/sparse.py; torch ops where the kernel is
missing) and the others through the masked dense matmuls, and combines. It counts active
(token, neuron) pairs per layer: the achieved sparsity. `SPEC.build` gives every block its executor
with the layer's calibrated threshold and the tipping point (runtime/tipping.py);
runtime/calibrate.py builds the thresholds, `prepare` reads and checks them before any pool is
allocated.

Invariants: shared experts stay dense (TieredMoE adds them); every acquired expert is released;
counters count every routed (token, expert) pair once, on the path that computed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.formats.qtier import source_fingerprint
from moetier.kernels import native
from moetier.kernels.experts import SwiGLU
from moetier.kernels.sparse import (
    NativeSparse,
    NativeSparseQuant,
    ThresholdTable,
    default_table_path,
    dense_weights,
    masked_dense,
    native_kernel,
    sparse_torch,
)
from moetier.models.families import Family
from moetier.runtime.calibrate import model_identity
from moetier.runtime.executors.base import STATIC_PRECISION, Grouped, ResidentFirst
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.runtime.loader import Skeleton
from moetier.runtime.tipping import load_or_measure_tipping
from moetier.types import ExpertKey, Plan

NEEDS = {
    STATIC_PRECISION: (
        "--sparsity cannot be combined with --precision dynamic yet; use full, or a static int8/int4/int2 "
        "tier written with `moetier quantize --for-sparsity`"
    ),
}  # fmt: skip


def check(cfg: EngineConfig, family: Family) -> None:
    """Refuse, with the reason, experts the sparse path does not run yet."""
    if family.expert_kind != "swiglu":
        raise ConfigError(f"--sparsity supports SwiGLU-type experts; {family.name} experts are not supported yet")


def prepare(cfg: EngineConfig, sk: Skeleton) -> tuple[ThresholdTable, str]:
    """The sparsity table and its path, checked against the model, before any pool is allocated."""
    path = cfg.sparsity.table or str(default_table_path(sk.path))
    table = ThresholdTable.load(path)
    table.check_model(model_identity(sk.info, source_fingerprint(sk.opened.index)["fingerprint"]), path)
    return table, path


@dataclass
class LayerCounts:
    """Per-layer counters: active and total (token, neuron) pairs; calls and tokens per path."""

    active: int = 0
    total: int = 0
    sparse_calls: int = 0
    dense_calls: int = 0
    sparse_tokens: int = 0
    dense_tokens: int = 0

    @property
    def achieved(self) -> float:
        return 1.0 - self.active / self.total if self.total else 0.0


Groups = dict[int, tuple[list[int], list[float]]]  # expert -> (token indices, router weights)


def group_tokens(ids: torch.Tensor, weights: torch.Tensor) -> Groups:
    """ids/weights [T, k] -> expert -> (token indices, router weights), tokens in order."""
    t, k = ids.shape
    if t == 1:
        return {e: ([0], [w]) for e, w in zip(ids[0].tolist(), weights[0].float().tolist(), strict=True)}
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
    experts = flat[order].tolist()
    tokens = (order // k).tolist()
    ws = weights.reshape(-1)[order].float().tolist()
    out: dict[int, tuple[list[int], list[float]]] = {}
    for e, tok, w in zip(experts, tokens, ws, strict=True):
        entry = out.setdefault(e, ([], []))
        entry[0].append(tok)
        entry[1].append(w)
    return out


def add_weighted(out: torch.Tensor, toks: list[int], ws: list[float], y: torch.Tensor) -> None:
    """out[toks[j]] += ws[j] * y[j]: one expert's outputs y [c, H] combined into out [T, H]."""
    w = torch.tensor(ws, dtype=y.dtype, device=y.device)[:, None]  # [c, 1]
    out.index_add_(0, torch.tensor(toks, device=out.device), (y * w).to(out.dtype))


class SparseExecutor:
    """Steps 3-5 of one MoE layer call with intra-expert activation sparsity."""

    def __init__(
        self, store: Any, layer: int, threshold: float, block: int, inter: int,
        act: Callable[[torch.Tensor], torch.Tensor], kernel: NativeSparse | NativeSparseQuant | None,
    ) -> None:  # fmt: skip
        self.store, self.layer, self.threshold, self.block = store, layer, threshold, block
        self.inter, self.act, self.kernel = inter, act, kernel
        self.counts = LayerCounts()

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> expert -> (token indices, router weights), tokens in order."""
        groups = group_tokens(ids, weights)
        return Grouped({e: len(g[0]) for e, g in groups.items()}, groups)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * masked expert(x) as [T, H]. The plan's tasks under the tipping point carry
        the sparsity target (gather path), the others run the masked dense matmuls."""
        # 1. split the plan by path
        groups: Groups = grouped.data
        store, c = self.store, self.counts
        sparse = [t for t in plan.tasks if t.sparsity > 0]
        dense = [t for t in plan.tasks if t.sparsity == 0]
        xc = x.contiguous()
        out = torch.zeros_like(xc)
        # 2. gather path: one native call per chunk of experts the compute tier can pin at once
        if sparse:
            self._sparse(store, xc, out, sparse, groups)
        # 3. masked dense path for the big calls
        for task in dense:
            toks, ws = groups[task.key.expert]
            views = store.acquire(task.key)
            try:
                w13, w2, _ = dense_weights(views, x.dtype)  # quantized rows: dequantised copies
                y, active = masked_dense(xc[toks], w13, w2, self.act, self.threshold, self.block)
            finally:
                store.release(task.key)
            add_weighted(out, toks, ws, y)
            c.active += active
            c.total += len(toks) * self.inter
            c.dense_calls += 1
            c.dense_tokens += len(toks)
        return out

    def _native(
        self, x: torch.Tensor, out: torch.Tensor, chunk: Sequence[Any], views: Sequence[Any], groups: Groups,
        accumulate: bool,
    ) -> int:  # fmt: skip
        """One kernel call for a chunk of experts. When the chunk covers only some of the call's tokens
        (prefill with a mix of paths), the kernel sees just those rows, gathered, and its output is
        added back; a decode step (or a chunk covering every token) reads and writes x and out as
        they are."""
        assert self.kernel is not None
        toks = [t for task in chunk for t in groups[task.key.expert][0]]
        ws = [w for task in chunk for w in groups[task.key.expert][1]]
        starts = [0]
        for task in chunk:
            starts.append(starts[-1] + task.tokens)
        slots: list[Any] = [self.kernel.address(v) for v in views]
        rows = sorted(set(toks))
        if len(rows) == x.shape[0]:  # every token (rows == 0..T-1): in place
            return self.kernel(x, slots, toks, ws, starts, out, self.threshold, self.block, accumulate=accumulate)
        where = {t: j for j, t in enumerate(rows)}
        idx = torch.tensor(rows, device=x.device)
        y = torch.empty((len(rows), x.shape[1]), dtype=out.dtype, device=out.device)  # [R, H]
        active = self.kernel(x[idx], slots, [where[t] for t in toks], ws, starts, y, self.threshold, self.block)
        out.index_add_(0, idx, y)
        return active

    def _sparse(self, store: Any, x: torch.Tensor, out: torch.Tensor, tasks: Sequence[Any], groups: Groups) -> None:
        c = self.counts
        cap = max(1, int(getattr(store, "capacity", 1)))
        for first in range(0, len(tasks), cap):
            chunk = tasks[first : first + cap]
            keys: list[ExpertKey] = []
            try:
                views = []
                for task in chunk:
                    views.append(store.acquire(task.key))
                    keys.append(task.key)
                if self.kernel is not None:
                    active = self._native(x, out, chunk, views, groups, accumulate=first > 0)
                else:
                    active = 0
                    for task, v in zip(chunk, views, strict=True):
                        toks, ws = groups[task.key.expert]
                        w13, _, rows = dense_weights(v, x.dtype)
                        y, n = sparse_torch(x[toks], w13, rows, self.act, self.threshold, self.block)
                        add_weighted(out, toks, ws, y)
                        active += n
            finally:
                for key in keys:
                    store.release(key)
            n_tok = sum(task.tokens for task in chunk)
            c.active += active
            c.total += n_tok * self.inter
            c.sparse_calls += len(chunk)
            c.sparse_tokens += n_tok


@dataclass
class SparsityState:
    """What the engine keeps about sparsity: per-layer executors, the switch and where it came from."""

    target: float
    block: int
    tipping: int
    table_path: str
    kernel: str  # "native" or "torch (<why>)"
    profile: dict[int, tuple[float, float]] = field(default_factory=dict)
    profile_cached: bool = False
    layers: dict[int, SparseExecutor] = field(default_factory=dict)
    stats_key: str = "sparsity"

    def stats(self) -> dict[str, Any]:
        per_layer = {
            layer: {
                "threshold": s.threshold, "achieved": round(s.counts.achieved, 4),
                "sparse_calls": s.counts.sparse_calls, "dense_calls": s.counts.dense_calls,
                "sparse_tokens": s.counts.sparse_tokens, "dense_tokens": s.counts.dense_tokens,
            }
            for layer, s in sorted(self.layers.items())
        }  # fmt: skip
        active = sum(s.counts.active for s in self.layers.values())
        total = sum(s.counts.total for s in self.layers.values())
        return {
            "target": self.target, "achieved": round(1 - active / total, 4) if total else 0.0,
            "block": self.block, "tipping_tokens": self.tipping, "kernel": self.kernel, "table": self.table_path,
            "profile_cached": self.profile_cached, "layers": per_layer,
        }  # fmt: skip

    def close(self) -> None:
        return None

    def reset_counts(self) -> None:
        """Start the achieved-sparsity counters over (e.g. between measured runs)."""
        for s in self.layers.values():
            s.counts = LayerCounts()


def build(ctx: BuildContext) -> Built:
    """Give every MoE block a SparseExecutor with its layer's threshold (steps numbered inside). The experts'
    format decides the kernel: quantized rows-layout experts take the quantized gather kernel."""
    loaded, cfg = ctx.loaded, ctx.config.sparsity
    table, table_path = ctx.prepared
    info, store, device, dtype = loaded.info, loaded.store, loaded.device, loaded.dtype
    hidden, inter, blocks = info.hidden_size, info.expert_intermediate, loaded.blocks
    # 1. refusals the loaded model decides
    if inter % cfg.block:
        raise ConfigError(f"--sparsity-block {cfg.block} does not divide the expert size {inter}")
    fn = blocks[0].expert_fn
    if not isinstance(fn, SwiGLU):
        raise ConfigError("--sparsity supports SwiGLU-type experts only")
    # 2. the kernel: native gather (quantized when the store's source is a rows-layout tier), else torch
    fmt = getattr(getattr(store, "source", None), "fmt", None)  # QuantSource: rows-layout format
    quant = (fmt.spec.bits, fmt.groups["w13"]) if fmt is not None else None  # rows: w2 grouped alike
    act_name = getattr(loaded.config, "hidden_act", None)
    rt = ctx.config.runtime
    kernel = (
        native_kernel(hidden, inter, dtype, device, quant, enabled=rt.native_kernels, cache_dir=rt.kernel_cache)
        if act_name in ("silu", "swish") else None
    )  # fmt: skip
    failed = native.load_error(rt.native_kernels, rt.kernel_cache)
    why = (
        "native" if kernel is not None else
        f"torch ({failed or ('CUDA, unverified' if device.type == 'cuda' else f'activation {act_name}')})"
    )  # fmt: skip
    # 3. the tipping point: configured, assumed (CUDA), or measured here (cached)
    profile: dict[int, tuple[float, float]] = {}
    cached = False
    if cfg.tipping is not None:
        tipping = cfg.tipping
    elif device.type == "cuda":  # unverified here: no GPU to measure on; dense beyond 8 tokens per expert
        tipping = 8
    else:
        tipping, profile, cached = load_or_measure_tipping(
            hidden, inter, dtype, fn.act, cfg, kernel, quant=quant, kernel_cache=rt.kernel_cache
        )
    # 4. one executor per layer with its threshold, one scheduler carrying the target
    state = SparsityState(cfg.target, cfg.block, tipping, table_path, why, profile, cached)
    scheduler = ResidentFirst(store, sparsity=cfg.target, tipping=tipping)
    layers: dict[int, tuple[ResidentFirst, SparseExecutor]] = {}
    for block in blocks:
        thr = table.threshold(block.layer, cfg.target, cfg.block)
        state.layers[block.layer] = ex = SparseExecutor(store, block.layer, thr, cfg.block, inter, fn.act, kernel)
        layers[block.layer] = (scheduler, ex)
    return Built(layers, state)


SPEC = ExecutorSpec(name="sparse", build=build, needs=NEEDS, check=check, prepare=prepare)
