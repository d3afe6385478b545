"""The sparse executor: intra-expert activation sparsity for one MoE layer call, and its wiring.

`SparseExecutor` runs steps 3-5 of one TieredMoE block: it groups the call's tokens by expert,
takes the plan of the resident-first scheduler with the sparsity target and tipping point
(policies.plan: the whole call on one path, sparse when its mean tokens per expert is below the tipping point,
the paper's switch by batch size), runs a sparse call's tasks through one native gather call per
chunk of experts the compute tier can pin at once (kernels/sparse.py; torch ops where the kernel is
missing) and a dense call's through the dense path: by default the layer's original, unmasked expert
function (the paper's switch to "the original dense expert execution", 4.1), or with
SparsityConfig.dense "masked" the dense matmuls with the same mask. A call whose tasks all take the
original dense path is the dense executor's computation (base.execute_per_expert), bit for bit.
It counts active (token, neuron) pairs per layer and the shared experts' neurons beside them: the
achieved sparsity, routed and total (the paper's Table 2 counts shared neurons as active).
`SPEC.build` gives every block its executor with the layer's calibrated threshold at the routed
fraction the target asks for (policies.sparsity.routed_target: scope "total" counts the shared
experts' neurons, which always run) and the tipping point (runtime/tipping.py); runtime/calibrate.py
builds the thresholds, `prepare` reads and checks them before any pool is allocated.

Invariants: shared experts stay dense (TieredMoE or the family's own block adds them), as in the
paper's system; every acquired expert is released; counters count every routed (token, expert) pair
once, on the path that computed it, and every token's shared neurons once per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.formats.qtier import source_fingerprint
from moetier.kernels import decode, native
from moetier.kernels.experts import SwiGLU
from moetier.kernels.qformat import QExpertViews
from moetier.kernels.sparse import (
    NativeSparse,
    NativeSparseQuant,
    ThresholdTable,
    default_table_path,
    dense_original,
    dense_weights,
    masked_dense,
    native_kernel,
    sparse_torch,
)
from moetier.models.families import Family
from moetier.policies.costmodel import HardwareProfile, load_profile
from moetier.policies.sparsity import call_sparse, roofline_profile, routed_target, tipping_point, total_sparsity
from moetier.runtime.calibrate import model_identity
from moetier.runtime.executors.base import STATIC_PRECISION, Grouped, ResidentFirst, execute_per_expert, group_by_expert
from moetier.runtime.executors.native import NativeExecutor, NativeState, is_silu
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.runtime.loader import LoadedModel, Skeleton
from moetier.runtime.tipping import load_or_measure_tipping
from moetier.types import Domain, ExpertKey, ExpertTask, Plan

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


_SHARED_ATTRS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "shared_expert_intermediate_size")


def _shared_modules(loaded: LoadedModel) -> dict[int, list[tuple[str, nn.Module]]]:
    """MoE layer -> its shared-expert modules (name, module): the family row's `shared_attr` read on the
    module that holds each of our blocks (the TieredMoE block itself, or transformers' block around the
    seam's TieredExperts). Empty when the family names no shared expert."""
    attr = loaded.family.shared_attr
    if not attr:
        return {}
    layer_of = {id(b): b.layer for b in loaded.blocks}
    found: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in loaded.model.named_modules():
        layer = layer_of.get(id(module))
        if layer is None:  # transformers' own block holding the seam's TieredExperts as a child
            layer = next((layer_of[id(c)] for c in module.children() if id(c) in layer_of), None)
        shared = getattr(module, attr, None) if layer is not None else None
        if layer is not None and isinstance(shared, nn.Module):
            found.setdefault(layer, []).append((f"{name}.{attr}", shared))
    return found


def shared_neurons(loaded: LoadedModel) -> int:
    """Shared-expert neurons per token of the model's MoE layers (0 without shared experts): the SwiGLU
    intermediate size of each layer's shared-expert module (its matrices' elements / (3 * hidden)), found by
    the family row's `shared_attr`; DeepSeek's n shared experts are one module of n * I. ConfigError when
    the layers differ, a module is not three [I, H] matrices, or the config declares shared experts the row
    does not name, naming it (then --sparsity-scope routed still runs)."""
    hidden, moe = loaded.info.hidden_size, set(loaded.info.moe_layers)
    per_layer: dict[int, int] = {}
    for layer, modules in _shared_modules(loaded).items():
        for name, module in modules:
            elems = sum(p.numel() for p in module.parameters() if p.dim() == 2)
            if elems % (3 * hidden):
                raise ConfigError(f"cannot count the neurons of shared expert {name} (not three [I, {hidden}] "
                                  "matrices); run with --sparsity-scope routed")  # fmt: skip
            per_layer[layer] = per_layer.get(layer, 0) + elems // (3 * hidden)
    sizes = {per_layer.get(layer, 0) for layer in moe}
    if len(sizes) > 1:
        raise ConfigError(f"shared experts differ across MoE layers ({per_layer}); run with --sparsity-scope routed")
    found = sizes.pop() if sizes else 0
    declared = [a for a in _SHARED_ATTRS if (getattr(loaded.config, a, 0) or 0) > 0]
    if not found and declared:  # the config has shared experts the family row does not name: never count them as 0
        raise ConfigError(f"the model's config declares shared experts ({', '.join(declared)}) but the "
                          f"{loaded.family.name} family names no shared-expert module to count their neurons; "
                          "run with --sparsity-scope routed")  # fmt: skip
    return found


@dataclass
class LayerCounts:
    """Per-layer counters: active and total routed (token, neuron) pairs, and those of the calls that applied
    the mask (gather or masked dense); shared-expert pairs (always active); calls and tokens per path."""

    active: int = 0
    total: int = 0
    masked_active: int = 0
    masked_total: int = 0
    shared: int = 0
    sparse_calls: int = 0
    dense_calls: int = 0
    sparse_tokens: int = 0
    dense_tokens: int = 0

    @property
    def achieved(self) -> float:
        """Routed sparsity over every call."""
        return 1.0 - self.active / self.total if self.total else 0.0

    @property
    def achieved_total(self) -> float:
        """Total activation sparsity over every call (shared neurons counted as active)."""
        return total_sparsity(self.total - self.active, self.total, self.shared)


Groups = dict[int, tuple[list[int], list[float]]]  # expert -> (token indices, router weights)


def group_tokens(ids: torch.Tensor, weights: torch.Tensor) -> Groups:
    """ids/weights [T, k] -> expert -> (token indices, router weights), tokens in order."""
    t, k = ids.shape
    if t == 1:
        return {e: ([0], [w]) for e, w in zip(ids[0].tolist(), weights[0].float().tolist(), strict=True)
                if e >= 0}  # fmt: skip
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
    experts = flat[order].tolist()
    tokens = (order // k).tolist()
    ws = weights.reshape(-1)[order].float().tolist()
    out: dict[int, tuple[list[int], list[float]]] = {}
    for e, tok, w in zip(experts, tokens, ws, strict=True):
        if e < 0:  # a pair a routing override skipped (id -1): no expert
            continue
        entry = out.setdefault(e, ([], []))
        entry[0].append(tok)
        entry[1].append(w)
    return out


def add_weighted(out: torch.Tensor, toks: list[int], ws: list[float], y: torch.Tensor) -> None:
    """out[toks[j]] += ws[j] * y[j]: one expert's outputs y [c, H] combined into out [T, H]."""
    w = torch.tensor(ws, dtype=y.dtype, device=y.device)[:, None]  # [c, 1]
    out.index_add_(0, torch.tensor(toks, device=out.device), (y * w).to(out.dtype))


@dataclass(frozen=True)
class _Call:
    """One call's grouping: expert -> (token indices, router weights) lists, and the routing itself (for
    the dense executor's own grouping when the whole call takes the original dense path)."""

    groups: Groups
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]


class SparseExecutor:
    """Steps 3-5 of one MoE layer call with intra-expert activation sparsity. `fn` is the layer's own expert
    function (the original dense expert); `masked` runs the dense path with the mask instead; `shared` is
    the shared-expert neurons per token, counted (as active) for the total sparsity."""

    def __init__(
        self, store: Any, layer: int, threshold: float, block: int, inter: int,
        act: Callable[[torch.Tensor], torch.Tensor], kernel: NativeSparse | NativeSparseQuant | None,
        fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None, num_experts: int = 0, masked: bool = False,
        shared: int = 0, native: NativeExecutor | None = None,
    ) -> None:  # fmt: skip
        """`native`: the native MoE half over this store's bf16 slots (down rows read as such, csrc/step.c
        MT_ROWS), the original dense path of a call whose tasks are all above the tipping point (execute_routed)."""
        self.store, self.layer, self.threshold, self.block = store, layer, threshold, block
        self.inter, self.act, self.kernel = inter, act, kernel
        self.fn, self.num_experts, self.masked, self.shared = fn, num_experts, masked or fn is None, shared
        self.native = native
        self.tipping: int | None = None  # the switch (set by `build`): execute_routed's paths; None: planned calls
        self.sparsity = 0.0  # the routed target the gather path's tasks carry (the scheduler's)
        self.counts = LayerCounts()

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> expert -> (token indices, router weights), tokens in order."""
        groups = group_tokens(ids, weights)
        return Grouped({e: len(g[0]) for e, g in groups.items()}, _Call(groups, ids, weights))

    def execute_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The call on its routing as is (Pipeline.routed), without a Plan: when the call's mean tokens per expert
        is below the tipping point (`call_sparse`: a decode step, small batches), one gather call per chunk of
        experts the store can pin (`acquire_many` pins the resident first), experts in ascending id; else the
        native MoE half (`native`). None (the block groups, plans and runs `execute`) for the masked dense path,
        quantized rows (their dense side is the planned path's), or without the native kernels. The same tasks and
        counters as the planned path."""
        if self.masked or self.kernel is None or self.tipping is None or x.shape[0] == 0:
            return None
        groups = group_tokens(ids, weights)
        if call_sparse((len(g[0]) for g in groups.values()), self.tipping):  # the whole call on the gather path
            tasks = [ExpertTask(ExpertKey(self.layer, e), len(groups[e][0]), self.sparsity) for e in sorted(groups)]
            xc = x.contiguous()
            out = torch.zeros_like(xc)
            self.counts.shared += x.shape[0] * self.shared
            self._sparse(self.store, xc, out, tasks, groups, self.threshold, accumulate=False, dense=False)
            return out
        if self.native is None or isinstance(self.kernel, NativeSparseQuant):
            return None  # no native dense path: the planned path (its dense side)
        y = self.native.execute_routed(x, ids, weights)
        if y is not None:
            self.counts.shared += x.shape[0] * self.shared
            self._count_dense(len(groups), sum(len(g[0]) for g in groups.values()))
        return y

    def _count_dense(self, calls: int, tokens: int) -> None:
        """`calls` expert tasks of `tokens` (token, expert) pairs in all ran the unmasked dense expert."""
        c = self.counts
        c.active += tokens * self.inter
        c.total += tokens * self.inter
        c.dense_calls += calls
        c.dense_tokens += tokens

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H]. The plan's tasks under the tipping point carry the
        sparsity target (gather path); the others run the original dense expert (on quantized rows with the
        native kernel: that kernel at threshold 0), or, `masked`, the masked dense matmuls."""
        # 1. split the plan by path
        call: _Call = grouped.data
        groups = call.groups
        store, c = self.store, self.counts
        sparse = [t for t in plan.tasks if t.sparsity > 0]
        dense = [t for t in plan.tasks if t.sparsity == 0]
        c.shared += x.shape[0] * self.shared
        # quantized rows with the native kernel: the unmasked expert is that kernel at threshold 0 (every
        # neuron computed, the same integer products as the gather path), not torch on dequantised copies
        kernel_dense = isinstance(self.kernel, NativeSparseQuant) and not self.masked
        if not sparse and not self.masked and not kernel_dense:  # 2a. every task dense: the dense executor's
            assert self.fn is not None  # (with `native`, such a call took execute_routed's native MoE half instead)
            self._count_dense(len(dense), sum(task.tokens for task in dense))
            return execute_per_expert(store, self._original, x, plan,
                                      group_by_expert(call.ids, call.weights, self.num_experts))  # fmt: skip
        xc = x.contiguous()
        out = torch.zeros_like(xc)
        # 2b. gather path: one native call per chunk of experts the compute tier can pin at once
        if sparse:
            self._sparse(store, xc, out, sparse, groups, self.threshold, accumulate=False, dense=False)
        if kernel_dense and dense:
            self._sparse(store, xc, out, dense, groups, 0.0, accumulate=bool(sparse), dense=True)
            dense = []
        # 3. dense path for the big calls: the original expert, or the masked matmuls
        for task in dense:
            toks, ws = groups[task.key.expert]
            views = store.acquire(task.key)
            try:
                if self.masked:
                    w13, w2, _ = dense_weights(views, x.dtype)  # quantized rows: dequantised copies
                    y, active = masked_dense(xc[toks], w13, w2, self.act, self.threshold, self.block)
                else:
                    y, active = self._original(xc[toks], views), len(toks) * self.inter
            finally:
                store.release(task.key)
            add_weighted(out, toks, ws, y)
            c.active += active
            c.total += len(toks) * self.inter
            if self.masked:
                c.masked_active += active
                c.masked_total += len(toks) * self.inter
            c.dense_calls += 1
            c.dense_tokens += len(toks)
        return out

    def _original(self, x: torch.Tensor, views: Any) -> torch.Tensor:
        """x [N, H] -> the unmasked expert [N, H]: the layer's own expert function on a full-precision slot
        (the dense executor's math); on quantized rows, the same math on dequantised copies."""
        if isinstance(views, QExpertViews):
            w13, w2, _ = dense_weights(views, x.dtype)
            return dense_original(x, w13, w2, self.act)
        assert self.fn is not None
        return self.fn(x, views)

    def _native(
        self, x: torch.Tensor, out: torch.Tensor, chunk: Sequence[Any], views: Sequence[Any], groups: Groups,
        threshold: float, accumulate: bool,
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
            return self.kernel(x, slots, toks, ws, starts, out, threshold, self.block, accumulate=accumulate)
        where = {t: j for j, t in enumerate(rows)}
        idx = torch.tensor(rows, device=x.device)
        y = torch.empty((len(rows), x.shape[1]), dtype=out.dtype, device=out.device)  # [R, H]
        active = self.kernel(x[idx], slots, [where[t] for t in toks], ws, starts, y, threshold, self.block)
        out.index_add_(0, idx, y)
        return active

    def _sparse(
        self, store: Any, x: torch.Tensor, out: torch.Tensor, tasks: Sequence[Any], groups: Groups, threshold: float,
        accumulate: bool, dense: bool,
    ) -> None:  # fmt: skip
        """`tasks` through the gather path at `threshold` into `out` (`accumulate`: out already holds other
        tasks' results); `dense`: the dense path of quantized rows (threshold 0, every neuron), counted so."""
        c = self.counts
        cap = max(1, int(getattr(store, "capacity", 1)))
        for first in range(0, len(tasks), cap):
            chunk = tasks[first : first + cap]
            keys: list[ExpertKey] = []
            many = getattr(store, "acquire_many", None)  # one lock for the chunk where the store has it
            try:
                if many is not None:
                    views = many([task.key for task in chunk])
                    keys = [task.key for task in chunk]
                else:
                    views = []
                    for task in chunk:
                        views.append(store.acquire(task.key))
                        keys.append(task.key)
                if self.kernel is not None:
                    active = self._native(x, out, chunk, views, groups, threshold, accumulate=accumulate or first > 0)
                else:
                    active = 0
                    for task, v in zip(chunk, views, strict=True):
                        toks, ws = groups[task.key.expert]
                        w13, _, rows = dense_weights(v, x.dtype)
                        y, n = sparse_torch(x[toks], w13, rows, self.act, threshold, self.block)
                        add_weighted(out, toks, ws, y)
                        active += n
            finally:
                if many is not None:
                    store.release_many(keys)
                else:
                    for key in keys:
                        store.release(key)
            n_tok = sum(task.tokens for task in chunk)
            c.active += active
            c.total += n_tok * self.inter
            if dense:
                c.dense_calls += len(chunk)
                c.dense_tokens += n_tok
            else:
                c.masked_active += active
                c.masked_total += n_tok * self.inter
                c.sparse_calls += len(chunk)
                c.sparse_tokens += n_tok


@dataclass
class SparsityState:
    """What the engine keeps about sparsity: per-layer executors, the switch and where it came from.
    `target` is in `scope` ("total": shared neurons counted, or "routed"); `routed_target` is the fraction of
    routed neurons the thresholds skip; `shared` the shared-expert neurons per token beside `routed` ones."""

    target: float
    block: int
    tipping: int
    table_path: str
    kernel: str  # "native" or "torch (<why>)"
    profile: dict[int, tuple[float, float]] = field(default_factory=dict)
    profile_cached: bool = False
    layers: dict[int, SparseExecutor] = field(default_factory=dict)
    stats_key: str = "sparsity"
    scope: str = "total"
    routed_target: float = 0.0
    routed: int = 0
    shared: int = 0
    dense: str = "original"
    tipping_source: str = "measured"  # "configured", "measured", or "profile NAME" (a GPU roofline)
    native: NativeState | None = None  # the native MoE half of the calls above the switch (bf16 on the CPU)

    def stats(self) -> dict[str, Any]:
        """`achieved` is the sparsity in the target's scope over every call (calls above the tipping point on
        the original dense path count as fully active); `achieved_masked` is the same over the calls that
        applied the mask, which is what the calibrated thresholds aim at; `achieved_routed` and
        `achieved_total` are both scopes over every call."""
        per_layer = {
            layer: {
                "threshold": s.threshold, "achieved": round(self._scoped(s.counts), 4),
                "achieved_routed": round(s.counts.achieved, 4), "achieved_total": round(s.counts.achieved_total, 4),
                "sparse_calls": s.counts.sparse_calls, "dense_calls": s.counts.dense_calls,
                "sparse_tokens": s.counts.sparse_tokens, "dense_tokens": s.counts.dense_tokens,
            }
            for layer, s in sorted(self.layers.items())
        }  # fmt: skip
        every = LayerCounts()
        for s in self.layers.values():
            for f in ("active", "total", "masked_active", "masked_total", "shared"):
                setattr(every, f, getattr(every, f) + getattr(s.counts, f))
        masked = LayerCounts(active=every.masked_active, total=every.masked_total,
                             shared=every.shared * every.masked_total // max(every.total, 1))  # fmt: skip
        return {
            "target": self.target, "scope": self.scope, "routed_target": round(self.routed_target, 4),
            "achieved": round(self._scoped(every), 4), "achieved_masked": round(self._scoped(masked), 4),
            "achieved_routed": round(every.achieved, 4), "achieved_total": round(every.achieved_total, 4),
            "routed_neurons_per_token": self.routed, "shared_neurons_per_token": self.shared,
            "block": self.block, "tipping_tokens": self.tipping, "tipping_source": self.tipping_source,
            "dense_path": self.dense, "kernel": self.kernel, "table": self.table_path,
            "dense_kernel": "native MoE half" if self.native is not None else "torch",
            "native_dense_calls": self.native.calls if self.native is not None else 0,
            "profile_cached": self.profile_cached, "layers": per_layer,
        }  # fmt: skip

    def _scoped(self, c: LayerCounts) -> float:
        return c.achieved_total if self.scope == "total" else c.achieved

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
    # 3. the routed fraction the target asks for: scope "total" counts the shared experts' neurons (active)
    routed, shared = info.top_k * inter, shared_neurons(loaded)
    r = routed_target(cfg.target, cfg.scope, routed, shared, max_routed=table.targets[-1])
    # 3b. bf16 experts on the CPU, unmasked dense path: above the switch, the native MoE half reads the sparse
    #     layout's down rows (csrc/step.c MT_ROWS), as fast as the dense engine's
    lib = (decode.load(rt.native_kernels, rt.kernel_cache)
           if isinstance(kernel, NativeSparse) and dtype == torch.bfloat16 and device.type == "cpu"
           and cfg.dense == "original" and fn.act is not None and is_silu(fn.act) else None)  # fmt: skip
    native_state = (NativeState(lib, store, hidden, inter, info.top_k, info.num_experts, rt.step_rows)
                    if lib is not None else None)  # fmt: skip
    # 4. the tipping point: configured, from the named profile's GPU roofline (CUDA), or measured here (cached)
    profile: dict[int, tuple[float, float]] = {}
    cached = False
    name = ctx.config.scheduler.profile
    if cfg.tipping is not None:
        tipping, source = cfg.tipping, "configured"
    elif device.type == "cuda" and name is not None:  # unverified: no GPU was lent to this work
        tipping, profile = roofline_tipping(load_profile(name), hidden, inter, dtype.itemsize, r)
        source = f"profile {name}"
    else:  # on CUDA unverified: timed on the device as on the CPU (the paper profiles it at engine start)
        tipping, profile, cached = load_or_measure_tipping(
            hidden, inter, dtype, fn.act, replace(cfg, target=r), kernel, quant=quant, kernel_cache=rt.kernel_cache,
            device=device, masked=cfg.dense == "masked", decode_lib=lib,
        )  # fmt: skip
        source = "measured"
    # 5. one executor per layer with its threshold, one scheduler carrying the routed target
    state = SparsityState(cfg.target, cfg.block, tipping, table_path, why, profile, cached, scope=cfg.scope,
                          routed_target=r, routed=routed, shared=shared, dense=cfg.dense,
                          tipping_source=source, native=native_state)  # fmt: skip
    scheduler = ResidentFirst(store, Domain.ACCEL if device.type == "cuda" else Domain.HOST, sparsity=r,
                              tipping=tipping)  # fmt: skip
    layers: dict[int, tuple[ResidentFirst, SparseExecutor]] = {}
    for block in blocks:
        thr = table.threshold(block.layer, r, cfg.block)
        state.layers[block.layer] = ex = SparseExecutor(
            store, block.layer, thr, cfg.block, inter, fn.act, kernel, fn=block.expert_fn,
            num_experts=block.num_experts, masked=cfg.dense == "masked", shared=shared,
            native=(NativeExecutor(store, fn, block.num_experts, inter, native_state, block.layer)
                    if native_state is not None else None),
        )  # fmt: skip
        ex.tipping, ex.sparsity = tipping, r
        layers[block.layer] = (scheduler, ex)
    return Built(layers, state, dict(state.layers))


def roofline_tipping(
    hw: HardwareProfile, hidden: int, inter: int, weight_bytes: int, routed: float
) -> tuple[int, dict[int, tuple[float, float]]]:
    """(tipping point, priced profile) on `hw`'s GPU roofline (policies.sparsity.roofline_profile); a profile
    without a GPU section is a ConfigError naming it."""
    if hw.gpu is None:
        raise ConfigError(f"profile {hw.name!r} has no GPU section to derive the sparsity tipping point from; "
                          "name a GPU profile with --profile or set --sparsity-tipping")  # fmt: skip
    profile = roofline_profile(hw.gpu, hidden, inter, weight_bytes, routed)
    return tipping_point(profile), profile


SPEC = ExecutorSpec(name="sparse", build=build, needs=NEEDS, check=check, prepare=prepare)
