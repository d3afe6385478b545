"""The native executor: every routed expert of a decode-sized call in one C call (kernels/decode.py).

For calls of up to `max_tokens` tokens (decode and small batches; on CPUs where oneDNN takes no
bf16 products, such as AVX2 ones, prefill chunks of up to decode.native_rows() tokens too) the
executor acquires every expert of the plan in plan order (resident first), hands their pool slots
to `moetier::moe` once, and releases them: gate, up, SwiGLU, down and the weighted combine of all
pairs run in C on both cores, in ascending expert id. Longer calls and calls whose experts do not fit
the compute tier's slots at once take the per-expert torch path (its matmuls still reach the native
kernels for quantised slots through kernels/qformat.linear).

Chosen by runtime/wire.py on a CPU bf16 model whose experts are SwiGLU with SiLU and no biases when the
kernel library loads (RuntimeConfig.native_kernels) and sparsity is off; full-precision slots are read as
bf16, quantised ones in the native formats of kernels/qformat.py (n8 / n4 / n2), both precisions of a
dynamic store alike (the layout is given per expert).

Invariants: outputs are summed in ascending expert id (the C kernel sums experts in the order given), so
they do not depend on residency; every acquired expert is released, also on error. bf16 results round
once per output (fp32 accumulation over all experts), so they differ from the torch path by rounding;
the tests bound that difference and check every kind against a float64 reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.kernels import decode, matmul
from moetier.kernels.experts import SwiGLU
from moetier.kernels.qformat import NATIVE_KINDS, QExpertViews
from moetier.models.families import Family
from moetier.runtime.executors.base import ExpertStoreLike, Grouped, ResidentFirst, execute_per_expert, group_by_expert
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.store.pool import SlotViews
from moetier.types import Domain, Plan

MAX_TOKENS = 8  # calls of more tokens take the torch path where oneDNN takes bf16 (its GEMMs win there)


class NativeState:
    """What the engine reports of the native executor (Engine.stats()["native"])."""

    stats_key = "native"

    def __init__(self, isa: str) -> None:
        self.isa, self.calls, self.fallback_calls = isa, 0, 0

    def stats(self) -> dict[str, Any]:
        return {"isa": self.isa, "native_calls": self.calls, "dense_calls": self.fallback_calls}

    def close(self) -> None:
        return None


def _layout_row(views: Any) -> tuple[torch.Tensor, list[int]] | None:
    """A slot's (memory, layout row for moetier::moe), or None for a format the kernel does not read."""
    if isinstance(views, SlotViews):
        if views.row.dtype != torch.bfloat16 or views.b13 is not None or views.down_rows is not None:
            return None
        base = views.row.data_ptr()
        w2_off = views.w2.data_ptr() - base
        if not (views.w13.is_contiguous() and views.w2.is_contiguous()):
            return None
        return views.row, [decode.KIND_BF16, 0, 0, -1, -1, 0, w2_off, -1, -1]
    if isinstance(views, QExpertViews):
        if views.b13 is not None or views.w13.kind not in NATIVE_KINDS or views.w2.kind != views.w13.kind:
            return None
        base = views.row.data_ptr()
        row = [views.w13.bits]
        for w in (views.w13, views.w2):
            assert w.zero is not None
            row += [w.group, w.q.data_ptr() - base, w.scale.data_ptr() - base, w.zero.data_ptr() - base]
        return views.row, row
    return None


def _packed(rows: list[tuple[torch.Tensor, list[int]] | None]) -> tuple[list[torch.Tensor], list[int]] | None:
    """The slots and the flat layout `moetier::moe` takes for these experts' rows, or None when one of them is
    in a format the kernel does not read."""
    slots, layout = [], []
    for r in rows:
        if r is None:
            return None
        slots.append(r[0])
        layout += r[1]
    return slots, layout


class NativeExecutor:
    """Steps 3-5 of one MoE layer call: up to `max_tokens` tokens in one native call, else the torch path."""

    def __init__(
        self, store: ExpertStoreLike, fn: Any, num_experts: int, inter: int, state: NativeState, max_tokens: int
    ) -> None:
        self.store, self.fn, self.num_experts = store, fn, num_experts
        self.inter, self.state, self.max_tokens = inter, state, max_tokens
        self._rows: dict[int, tuple[Any, tuple[torch.Tensor, list[int]] | None]] = {}  # id(views) -> row
        self.capacity = int(getattr(store, "capacity", 0))

    def _row(self, views: Any) -> tuple[torch.Tensor, list[int]] | None:
        hit = self._rows.get(id(views))
        if hit is None or hit[0] is not views:  # keyed by identity: a pool's views live as long as the pool
            hit = (views, _layout_row(views))
            self._rows[id(views)] = hit
        return hit[1]

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> the call's tokens per expert (base.group_by_expert)."""
        return group_by_expert(ids, weights, self.num_experts)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H]."""
        t = x.shape[0]
        tasks = plan.tasks
        if t > self.max_tokens or x.dtype != torch.bfloat16 or not tasks:
            self.state.fallback_calls += 1
            return execute_per_expert(self.store, self.fn, x, plan, grouped)
        # 1. pairs per expert in ascending expert id
        if t == 1:
            w_of: dict[int, float] = grouped.data
            experts = sorted(w_of)
            start, tok, rw = list(range(len(experts) + 1)), [0] * len(experts), [w_of[e] for e in experts]
        else:
            groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = grouped.data
            experts = sorted(groups)
            start, tok, rw = [0], [], []
            for e in experts:
                tk, wk = groups[e]
                tok += tk.tolist()
                rw += wk.float().tolist()
                start.append(len(tok))
        x = x.contiguous()
        if self.capacity and len(tasks) > self.capacity:  # fewer slots than experts: groups, same bits
            return self._in_groups(x, experts, start, tok, rw, plan, grouped)
        # 2. move: acquire every expert in plan order (resident first), then compute in one call
        store = self.store
        held: list[Any] = []
        views_of: dict[int, Any] = {}
        try:
            for task in tasks:
                views_of[task.key.expert] = store.acquire(task.key)
                held.append(task.key)
            packed = _packed([self._row(views_of[e]) for e in experts])
            # None: a slot format the kernel does not read (a shape its layouts refuse)
            out = decode.moe(x, *packed, start, tok, rw, self.inter) if packed is not None else None
        finally:
            for key in held:
                store.release(key)
        if out is None:
            self.state.fallback_calls += 1
            return execute_per_expert(self.store, self.fn, x, plan, grouped)
        self.state.calls += 1
        return out

    def _in_groups(
        self, x: torch.Tensor, experts: list[int], start: list[int], tok: list[int], rw: list[float], plan: Plan,
        grouped: Grouped,
    ) -> torch.Tensor:  # fmt: skip
        """A call with more experts than the compute tier has slots: groups of `capacity` experts in ascending
        id, each acquired, added unrounded to one fp32 sum (moetier::moe_acc) and released, so the result is
        the bits of one native call whatever the residency."""
        key_of = {task.key.expert: task.key for task in plan.tasks}
        acc = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        for g0 in range(0, len(experts), self.capacity):
            group = experts[g0 : g0 + self.capacity]
            held: list[Any] = []
            try:
                rows = []
                for e in group:
                    views = self.store.acquire(key_of[e])
                    held.append(key_of[e])
                    rows.append(self._row(views))
                packed = _packed(rows)
                if packed is None:
                    break  # a slot format the kernel does not read
                lo, hi = start[g0], start[g0 + len(group)]
                decode.moe_acc(
                    x, *packed, [p - lo for p in start[g0 : g0 + len(group) + 1]], tok[lo:hi], rw[lo:hi], self.inter,
                    acc,
                )  # fmt: skip
            finally:
                for key in held:
                    self.store.release(key)
        else:
            self.state.calls += 1
            return acc.to(torch.bfloat16)
        self.state.fallback_calls += 1
        return execute_per_expert(self.store, self.fn, x, plan, grouped)


def _is_silu(act: Any) -> bool:
    """Whether an activation (F.silu, nn.SiLU, transformers' ACT2FN["silu"], ...) computes SiLU."""
    probe = torch.linspace(-8, 8, 33)
    try:
        return bool(torch.equal(act(probe), F.silu(probe)))
    except (TypeError, RuntimeError):
        return False


def native_fits(cfg: EngineConfig, family: Family, expert_fn: Any, dtype: torch.dtype, cuda: bool) -> bool:
    """Whether a model may run the native executor: CPU, bf16, SwiGLU experts with SiLU and no biases,
    sparsity off (the library itself is asked for by the wiring)."""
    return (
        not cuda
        and dtype == torch.bfloat16
        and not cfg.sparsity.enabled
        and isinstance(expert_fn, SwiGLU)
        and _is_silu(expert_fn.act)
        and "down_bias" not in family.sources
    )


def build(ctx: BuildContext) -> Built:
    """One NativeExecutor and the resident-first scheduler per MoE layer."""
    loaded = ctx.loaded
    lib = decode.load(ctx.config.runtime.native_kernels, ctx.config.runtime.kernel_cache)
    if lib is None:
        raise ConfigError("the native executor needs the kernel library (kernels/native.py load_error says why)")
    state = NativeState(decode.isa(lib))
    inter = int(loaded.info.expert_intermediate)
    # where oneDNN takes bf16 products its GEMMs beat the native GEMV-shaped kernel above a few tokens;
    # elsewhere (AVX2) the native kernel wins for whole prefill chunks (docs/engine.md)
    max_tokens = MAX_TOKENS if matmul.onednn_takes_bf16() else decode.native_rows()
    return Built(
        {
            b.layer: (
                ResidentFirst(b.store, Domain.HOST),
                NativeExecutor(b.store, b.expert_fn, b.num_experts, inter, state, max_tokens),
            )
            for b in loaded.blocks
        },
        state,
    )


SPEC = ExecutorSpec(name="native", build=build)
