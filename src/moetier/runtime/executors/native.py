"""The native executor: every routed expert of a layer call in one C call (kernels/step.py, csrc/step.h).

The executor takes a call's routing as it is (Pipeline.routed: the block skips grouping and the Plan
object): `RoutedMoE` pins the call's distinct experts with one `acquire_many` (the store pins the resident
ones first, then reads the misses: the default resident-first plan), sets their slots' descriptor rows
from the store's slot table (built once), and runs `moetier_moe_half`: gate, up, SwiGLU, down and the
weighted combine of every (token, expert) pair in C on both cores, experts in ascending id; then one
`release_many`. Prompts run in chunks of RuntimeConfig.step_rows tokens. A call routing to more experts
than the store can pin at once runs per group of that many (or per group the store's `pin_groups` sizes: under an
admitting cache policy, contiguous groups with at most its transient slots of misses each), summed in fp32 across
groups (the same bits).
The lean decoder's native step (runtime/native_step.py) runs the same RoutedMoE between its two calls
per layer; families served through transformers' experts seam reach it from their TieredExperts blocks.
A call the kernels cannot take (a slot format they do not read) runs the per-expert torch path
(`execute`; its matmuls still reach the native kernels for quantised slots through qformat.linear).

Chosen by runtime/wire.py on a CPU bf16 model whose experts are SwiGLU with SiLU and no biases, or GPT-OSS's
clamped alpha-sigmoid GLU with its biases (`activation_of`), when the kernel library loads
(RuntimeConfig.native_kernels) and sparsity is off; full-precision slots are read as bf16, quantised ones in the
native formats of kernels/qformat.py (n8 / n4 / n2), stored ones as the kernels read them (kernels/step.py
desc_row), both precisions of a dynamic store alike (the layout is per slot).

Invariants: outputs are summed in ascending expert id, so they do not depend on residency or budgets;
every acquired expert is released, also on error. bf16 results round once per output (fp32 accumulation
over all experts), so they differ from the torch path by rounding; the tests bound that difference and
check every kind against a float64 reference.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
import torch.nn.functional as F

from moetier.config import EngineConfig
from moetier.errors import ConfigError, ExpertReadError
from moetier.kernels import decode
from moetier.kernels.experts import GptOssGLU, SwiGLU
from moetier.kernels.step import SILU, Activation, MoeLayer, SlotTable, Step
from moetier.models.families import Family
from moetier.runtime.executors.base import ExpertStoreLike, Grouped, ResidentFirst, execute_per_expert, group_by_expert
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.runtime.moe_block import routed_rows
from moetier.types import Domain, ExpertKey, Plan


class NativeState:
    """What the native executor shares across the model's layers: the kernel library, the store's slot table
    (built once: kernels/step.py SlotTable), the buffers of the routed path (a Step for up to `rows` rows, made
    on first use), and what the engine reports (Engine.stats()["native"])."""

    stats_key = "native"

    def __init__(self, lib: ctypes.CDLL, store: Any, hidden: int, inter: int, top_k: int, experts: int,
                 rows: int, act: Activation = SILU) -> None:  # fmt: skip
        self.lib, self.store, self.rows, self.act = lib, store, rows, act
        self.hidden, self.inter, self.top_k, self.experts = hidden, inter, top_k, experts
        self.isa, self.calls, self.fallback_calls = decode.isa(lib), 0, 0
        self._table: SlotTable | None = None
        self._buffers: tuple[Step, MoeLayer] | None = None

    @property
    def table(self) -> SlotTable:
        """The descriptor rows of the store's compute pools (built on first use, then fixed)."""
        if self._table is None:
            self._table = SlotTable(self.store.compute_pools(), self.lib)
        return self._table

    def routed_buffers(self) -> tuple[Step, MoeLayer]:
        """The routed path's Step (one layer's routing buffers, `rows` rows) and MoE struct (routed experts only:
        the block adds its shared experts itself), made on first use (a lean model's native step has its own)."""
        if self._buffers is None:
            moe = MoeLayer(self.hidden, self.inter, self.experts, self.top_k, act=self.act)
            step = Step(self.lib, self.rows, self.hidden, 1, self.top_k, self.experts, [], [moe], None, 0,
                        max(os.cpu_count() or 1, torch.get_num_threads()))  # fmt: skip
            self._buffers = (step, moe)
        return self._buffers

    def stats(self) -> dict[str, Any]:
        out = {"isa": self.isa, "native_calls": self.calls, "dense_calls": self.fallback_calls}
        if self._buffers is not None:
            out["routed_scratch_bytes"] = self._buffers[0].nbytes
        return out

    def close(self) -> None:
        return None


class RoutedMoE:
    """One layer's routed experts through `moetier_moe_half` on a Step's buffers: the call's distinct experts
    pinned with one `acquire_many` (resident first, then the misses read: the default plan), their slots'
    descriptor rows set from the slot table, the call, one `release_many`. A call routing to more experts than
    the store can pin at once runs per group of that many (ascending id), summed in fp32 across the groups
    (csrc/step.h mode bits): the bits of one call. Shared by the lean decoder's native step
    (runtime/native_step.py) and the seam's routed path (NativeExecutor.execute_routed)."""

    def __init__(self, layer: int, store: Any, table: SlotTable, moe: MoeLayer, num_experts: int) -> None:
        self.layer, self.store, self.table, self.moe = layer, store, table, moe
        self.keys = [ExpertKey(layer, e) for e in range(num_experts)]
        self.limit = store.pin_limit()  # distinct experts one acquire_many can pin (None: every one)
        self.groups = getattr(store, "pin_groups", None)  # the store's own split of a call (ExpertStore.pin_groups)

    def run(self, step: Step, experts: list[int], ids: torch.Tensor) -> bool:
        """Compute the step's routed experts (`experts`: the distinct ids of ids [T, k], ascending) into
        step.x; False, with nothing computed and nothing held, when a slot is in a format the kernels do not
        read. An ExpertReadError leaves with `rows` set to the rows of `ids` routed to that expert."""
        n = len(experts)
        desc, addr, all_keys = self.moe.desc, self.table.for_layer(self.layer).get, self.keys
        if self.groups is not None:  # contiguous groups in ascending id, sized by the store
            sizes = self.groups([all_keys[e] for e in experts]) if n else [0]
        else:
            size = self.limit if self.limit and n > self.limit else max(n, 1)
            sizes = [min(size, n - g) for g in range(0, n, size)] or [0]
        grouped = len(sizes) > 1
        if grouped:  # group calls read the experts whose descriptor is set: none of the call's, to begin with
            for e in experts:
                desc[e] = None
        g0 = 0
        for size in sizes:
            group = experts[g0 : g0 + size] if grouped else experts
            keys = [all_keys[e] for e in group]
            try:
                views = self.store.acquire_many(keys)
            except ExpertReadError as exc:  # the same exception, told which rows needed the expert
                if not exc.rows and isinstance(exc.key, ExpertKey) and exc.key.layer == self.layer:
                    exc.rows = routed_rows(ids, exc.key.expert)
                raise
            try:
                for e, v in zip(group, views, strict=True):
                    a = addr(id(v))
                    if a is None:
                        if g0 == 0:
                            return False
                        raise ValueError(f"layer {self.layer}: expert {e}'s slot is in a format the native kernels "
                                         "do not read, after earlier ones of the call were")  # fmt: skip
                    desc[e] = a
                step.moe(self.moe, (1 if g0 == 0 else 0) | (2 if g0 + size >= n else 0))
            finally:
                self.store.release_many(keys)
                if grouped:  # a group call reads only the experts set for it: clear them for the next group
                    for e in group:
                        desc[e] = None
            g0 += size
        return True


class NativeExecutor:
    """Steps 3-5 of one MoE layer call: the routed experts through RoutedMoE (one native call per `state.rows`
    rows), else the torch path."""

    def __init__(self, store: ExpertStoreLike, fn: Any, num_experts: int, inter: int, state: NativeState,
                 layer: int) -> None:  # fmt: skip
        self.store, self.fn, self.num_experts = store, fn, num_experts
        self.inter, self.state, self.layer = inter, state, layer
        self._routed: RoutedMoE | None = None

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> the call's tokens per expert (base.group_by_expert)."""
        return group_by_expert(ids, weights, self.num_experts)

    def execute_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """x [T, H] bf16, ids/weights [T, k] -> sum_k w * expert(x) as [T, H] bf16 in one native call per
        `state.rows` rows (rows are independent); None (the block plans and runs `execute`) for a non-bf16 x or
        a slot format the kernels do not read."""
        t = x.shape[0]
        if x.dtype != torch.bfloat16 or t == 0:
            return None
        step, moe = self.state.routed_buffers()
        if self._routed is None:
            self._routed = RoutedMoE(self.layer, self.store, self.state.table, moe, self.num_experts)
        out = torch.empty_like(x)  # [T, H]
        step.layer(0)
        step.s.nthreads = torch.get_num_threads()
        for r0 in range(0, t, step.rows):
            r1 = min(t, r0 + step.rows)
            n = r1 - r0
            step.h[:n].copy_(x[r0:r1])
            step.x[:n].zero_()  # the MoE half adds its sum to x
            step.ids[0, :n].copy_(ids[r0:r1])
            step.wts[0, :n].copy_(weights[r0:r1])
            step.s.T = n
            experts = sorted(set(step.ids_np[0, :n].ravel().tolist()) - {-1})  # -1: a pair an override skipped
            if not self._routed.run(step, experts, ids[r0:r1]):
                return None  # only the first chunk can refuse: every slot of a store has one format
            out[r0:r1].copy_(step.x[:n])
        self.state.calls += 1
        return out

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> sum_k w * expert(x) as [T, H] by the torch path (the calls execute_routed leaves)."""
        self.state.fallback_calls += 1
        return execute_per_expert(self.store, self.fn, x, plan, grouped)


def is_silu(act: Any) -> bool:
    """Whether an activation (F.silu, nn.SiLU, transformers' ACT2FN["silu"], ...) computes SiLU."""
    probe = torch.linspace(-8, 8, 33)
    try:
        return bool(torch.equal(act(probe), F.silu(probe)))
    except (TypeError, RuntimeError):
        return False


def activation_of(expert_fn: Any, family: Family) -> Activation | None:
    """The MoE half's activation for a family's expert function: SiLU SwiGLU without biases, or GPT-OSS's GLU
    (biases in the slots); None for any other (the torch path computes it)."""
    if isinstance(expert_fn, SwiGLU):
        return SILU if is_silu(expert_fn.act) and "down_bias" not in family.sources else None
    if isinstance(expert_fn, GptOssGLU):
        return Activation(1, float(expert_fn.alpha), float(expert_fn.limit))
    return None


def native_fits(cfg: EngineConfig, family: Family, expert_fn: Any, dtype: torch.dtype, cuda: bool) -> bool:
    """Whether a model may run the native executor: CPU, bf16, experts the MoE half computes (`activation_of`),
    sparsity off (the library itself is asked for by the wiring)."""
    return (
        not cuda
        and dtype == torch.bfloat16
        and not cfg.sparsity.enabled
        and activation_of(expert_fn, family) is not None
    )


def build(ctx: BuildContext) -> Built:
    """One NativeExecutor (taking routing as is) and the resident-first scheduler per MoE layer."""
    loaded = ctx.loaded
    lib = decode.load(ctx.config.runtime.native_kernels, ctx.config.runtime.kernel_cache)
    if lib is None:
        raise ConfigError("the native executor needs the kernel library (kernels/native.py load_error says why)")
    info = loaded.info
    inter = int(info.expert_intermediate)
    rows = ctx.config.runtime.step_rows
    act = activation_of(loaded.blocks[0].expert_fn, loaded.family) if loaded.blocks else SILU
    state = NativeState(lib, loaded.store, info.hidden_size, inter, info.top_k, info.num_experts, rows, act or SILU)
    execs = {b.layer: NativeExecutor(b.store, b.expert_fn, b.num_experts, inter, state, b.layer)
             for b in loaded.blocks}  # fmt: skip
    return Built(
        {layer: (ResidentFirst(ex.store, Domain.HOST), ex) for layer, ex in execs.items()}, state, dict(execs),
    )  # fmt: skip


SPEC = ExecutorSpec(name="native", build=build)
