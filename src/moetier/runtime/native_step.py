"""The lean decoder's forward as two native calls per layer (kernels/step.py, csrc/step.h).

Per layer, for T rows (one token of each of T sequences, or T tokens of one sequence's prompt):
1. `moetier_attn_half`: norms, QKV, RoPE, the cache write, attention over each row's cache, the output
   projection and residual, the post-attention norm and the router (top-k ids and weights, logits);
2. Python, once per layer: the routing override, if any (runtime/route_override.py, in place on the step's ids
   and weights; a skipped pair is id -1, which the MoE half skips); the route observers (trace, precision
   switching, cache scores, prefetch) see the routing; `acquire_many` pins the routed experts (hits first,
   then misses read from disk: the resident-first plan of the default scheduler) and their slots' descriptor
   rows are set from the store's slot table; then
3. `moetier_moe_half`: every routed expert and the shared expert, combined in ascending expert id, added to
   the residual; then `release_many`. A call routing to more experts than the compute tier has slots runs
   steps 2-3 per group of that many experts (ascending id), summed in fp32 across the groups: the same bits.
The output head is a third call after the last layer. Nothing per call allocates except the logits handed
back (a copy of the step's buffer, so a caller may keep them).

With another executor than the native one (sparsity; stored precision) every MoE half is that executor's own
call on the native routing (the block's `experts_forward` + shared experts): the attention half stays native.
With the native executor, a layer leaves the native MoE half, for that call only, when its block's pipeline is
not the one wired
(calibration swaps it), when a routed slot is in a format the kernels do not read, or when its dense MLP
is not a SwiGLU the kernels compute: it then runs the block's own torch path on the same h and routing
(`experts_forward` + shared experts), with the same observers. A family without a native router routes
with its own module (`native_router` of its row). `stats()` counts each case.

Faults: an ExpertReadError from `acquire_many` leaves with `rows` set to the rows routed to that expert,
as the MoE block does (runtime/moe_block.py); after non-finite logits a block's `find_nonfinite` reads
the ids of its last call (`last_ids`, a view of this step's per-layer buffer, valid until the next step).

Invariants: a row's result does not depend on the residency of its experts or on the budgets (experts are
summed in ascending id, in groups or not); it may differ by rounding from the same row computed with other
rows (csrc/mm.c takes 4-row blocks for calls of several activation rows, accumulating in another order), so
BatchConfig.batch_invariant still decodes rows one at a time. Prompts longer than `rows` run in chunks of
`rows` (a chunk's rows attend to the earlier chunks through the cache); every scratch byte is the Step's
(`nbytes`, in stats).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetier.kernels.step import SILU, AttnLayer, AttnSpec, Head, MoeLayer, Step
from moetier.runtime.executors.native import NativeState, RoutedMoE, is_silu
from moetier.runtime.lean import LeanDecoder, LeanLayer, fuse_projections
from moetier.runtime.loader import LoadedModel
from moetier.runtime.moe_block import Pipeline, TieredMoE
from moetier.runtime.observers import Route
from moetier.runtime.route_override import RouteOverride


@dataclass
class _Site:
    """One layer as the step runs it."""

    attn: AttnLayer
    moe: MoeLayer | None  # None: the layer's MLP runs in torch (a dense MLP the kernels do not compute)
    routed: RoutedMoE | None  # the MoE half's routed experts (None: a dense layer, or the block's torch path)
    block: TieredMoE | None  # the layer's MoE block (None: a dense layer)
    mlp: nn.Module
    pipeline: Pipeline | None  # the pipeline wired for the block: another one attached means its torch path


def _swiglu(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w13 [2I, H], w2 [H, I]) of a bias-free SiLU gate/up/down MLP module, else None."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(not isinstance(p, nn.Linear) or p.bias is not None for p in parts):
        return None
    act = getattr(mlp, "act_fn", None)
    if act is None or not is_silu(act):
        return None
    if any(p.weight.dtype != torch.bfloat16 for p in parts):  # type: ignore[union-attr]
        return None
    # gate and up fused into one [2I, H] tensor, the modules re-pointed at its views: no second copy in memory
    w13 = fuse_projections((parts[0], parts[1]), "weight")
    return w13, parts[2].weight.detach().contiguous()  # type: ignore[union-attr]


class NativeStep:
    """The lean decoder's layers and head as native calls; see the module docstring."""

    def __init__(self, lean: LeanDecoder, loaded: LoadedModel, lib: ctypes.CDLL, state: NativeState | None,
                 rows: int, wide: bool = False) -> None:  # fmt: skip
        """`state`: the native executor's (its slot table, its counters), or None when the model runs another
        executor (sparse, dense): the attention half stays native and each MoE half is that executor's call.
        `wide` (RuntimeConfig.residual "fp32"): the residual stream in fp32 and nothing rounded to bf16 but what a
        matmul reads (csrc/step.h mt_step.xw); the logits are then fp32."""
        cfg, fam = loaded.config, loaded.family
        self.lean, self.loaded, self.store = lean, loaded, loaded.store
        self.state = state
        self.rows = rows
        info = loaded.info
        blocks = {b.layer: b for b in loaded.blocks if isinstance(b, TieredMoE)}
        router = fam.native_router
        norm_topk = fam.renormalizes_topk(cfg)
        spec = AttnSpec(
            hidden=info.hidden_size, heads=lean.nh, kv_heads=lean.nkv, head_dim=lean.hd, eps=lean.eps,
            clip=float(lean.clip) if lean.clip is not None else 0.0,
            qk_norm=0 if lean.layers[0].q_norm is None else (1 if lean.per_head_norm else 2),
            experts=info.num_experts, top_k=info.top_k, norm_topk=norm_topk,
            round_weights=router in ("softmax_topk", "topk_softmax"),
        )  # fmt: skip
        self.sites: list[_Site] = []
        self.torch_mlp_layers = 0
        for i, L in enumerate(lean.layers):
            block = blocks.get(i)
            self.sites.append(self._site(i, L, block, spec, router is not None))
        self.head_ = Head(lean.final_norm, lean.lm_head, lean.eps)
        self.embed = lean.embed.detach()  # [V, H]: rows copied into the step x (no autograd: no inference mode needed)
        self.checked: torch.Tensor | None = None  # the last logits returned, when the head found all of them finite
        nthreads = max(os.cpu_count() or 1, torch.get_num_threads())
        self.step = Step(lib, rows, info.hidden_size, len(lean.layers), info.top_k, info.num_experts,
                         [s.attn for s in self.sites], [s.moe for s in self.sites if s.moe is not None], self.head_,
                         lean.max_len, nthreads, wide)  # fmt: skip
        self.kv_dtype = torch.float16 if wide else torch.bfloat16  # what the attention half reads and writes
        if lean.kv_dtype != self.kv_dtype:
            lean.set_kv_dtype(self.kv_dtype)
        self.torch_moe_calls = 0  # MoE halves run in torch (swapped pipeline, unreadable slot)
        self._wts_np = self.step.wts.numpy()  # the routing weights' memory, for a routing override (in place)
        self.calls = 0

    def _site(self, i: int, L: LeanLayer, block: TieredMoE | None, spec: AttnSpec, router: bool) -> _Site:
        lean = self.lean
        router_w = router_b = None
        if block is not None and router:
            module = getattr(block, block.router_name)
            w, b = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(w, torch.Tensor) and tuple(w.shape) == (self.loaded.info.num_experts, spec.hidden):
                router_w = w
                router_b = b if isinstance(b, torch.Tensor) and b.numel() == spec.experts else None
        attn = AttnLayer(spec, i, L.in_norm, L.post_norm, L.wqkv, L.bqkv, L.wo, L.bo, L.q_norm, L.k_norm, lean.cos,
                         lean.sin, router_w, L.sinks, L.window, router_b)  # fmt: skip
        info = self.loaded.info
        if block is not None:
            act = self.state.act if self.state is not None else SILU  # the routed experts' activation
            shared = None
            if block.family.shared_attr:
                parts = _swiglu(getattr(block, block.family.shared_attr))
                gate_mod = getattr(block, block.family.shared_gate_attr) if block.family.shared_gate_attr else None
                if parts is None or (gate_mod is not None and (not isinstance(gate_mod, nn.Linear)
                                                               or gate_mod.bias is not None)):  # fmt: skip
                    moe = None
                else:
                    gate = gate_mod.weight if gate_mod is not None else None
                    shared = (*parts, gate)
                    moe = MoeLayer(info.hidden_size, info.expert_intermediate, info.num_experts, info.top_k, shared,
                                   act)  # fmt: skip
            else:
                moe = MoeLayer(info.hidden_size, info.expert_intermediate, info.num_experts, info.top_k, act=act)
            if router_w is None:
                moe = None  # the family's module routes: the block's own forward
            routed = None
            if moe is not None and self.state is not None:  # the native executor: its routed call; else its own
                routed = RoutedMoE(i, self.store, self.state.table, moe, info.num_experts)
            return _Site(attn, moe, routed, block, L.mlp, block.pipeline)
        parts = _swiglu(L.mlp)  # a dense layer's MLP: bf16, as the lean decoder runs it (dense_precision is
        moe = None  # attention and the head)
        if parts is not None:
            moe = MoeLayer(info.hidden_size, 0, 0, 0, (parts[0], parts[1], None))
        else:
            self.torch_mlp_layers += 1
        return _Site(attn, moe, None, None, L.mlp, None)

    @property
    def wide(self) -> bool:
        """Whether the step runs wide (its Step's fp32 residual stream)."""
        return self.step.wide

    # ------------------------------------------------------------------ calls

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "rows": self.rows, "scratch_bytes": self.step.nbytes,
                "torch_moe_calls": self.torch_moe_calls, "torch_mlp_layers": self.torch_mlp_layers,
                "native_router": self.sites[0].attn.native_router if self.sites else False,
                "unreadable_slots": self.state.table.unreadable if self.state is not None else 0,
                "moe": "native" if self.state is not None else "executor",
                "residual": "fp32" if self.wide else "bf16"}  # fmt: skip

    def run_sequence(self, ids: torch.Tensor, p0: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     all_logits: bool, hidden: bool) -> torch.Tensor:  # fmt: skip
        """Tokens ids [T] of one sequence at positions p0.. of the cache ([L, nkv, cap, hd] each) -> logits [T, V]
        (all_logits) or [1, V] (the last), or (`hidden`) the last layer's output [T, H]."""
        T = ids.shape[0]
        outs = []
        for c0 in range(0, T, self.rows):
            c1 = min(T, c0 + self.rows)
            n = c1 - c0
            last = c1 == T
            want = "hidden" if hidden else ("all" if all_logits else ("last" if last else "none"))
            outs.append(self._run(ids[c0:c1], list(range(p0 + c0, p0 + c1)), [(k_cache, v_cache)] * n, want))
        if hidden or all_logits:
            return torch.cat([o for o in outs if o is not None]) if len(outs) > 1 else outs[0]
        return outs[-1]

    def run_rows(self, tokens: torch.Tensor, pos: list[int], caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:  # fmt: skip
        """One token per sequence (tokens [B], positions, each row's own cache) -> logits [B, V]."""
        B = tokens.shape[0]
        outs = [self._run(tokens[b0 : b0 + self.rows], pos[b0 : b0 + self.rows], caches[b0 : b0 + self.rows], "all")
                for b0 in range(0, B, self.rows)]  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run(self, ids: torch.Tensor, pos: list[int], caches: list[tuple[torch.Tensor, torch.Tensor]],
             want: str) -> torch.Tensor:  # fmt: skip
        st = self.step
        T = ids.shape[0]
        # 1. the rows: embeddings, positions, caches
        if self.wide:
            st.xw[:T].copy_(self.embed.index_select(0, ids.to(torch.int64)))
        else:
            torch.index_select(self.embed, 0, ids.to(torch.int64), out=st.x[:T])
        for t, (p, (kc, vc)) in enumerate(zip(pos, caches, strict=True)):
            if kc.dtype != self.kv_dtype or vc.dtype != self.kv_dtype:
                raise ValueError(f"the native step reads {self.kv_dtype} KV caches, got {kc.dtype} / {vc.dtype}")
            st.pos[t] = p
            st.cap[t] = kc.shape[2]
            st.kc[t] = kc.data_ptr()
            st.vc[t] = vc.data_ptr()
        st.s.T = T
        st.s.nthreads = torch.get_num_threads()
        # 2. the layers
        layer, attn, mlp = st.layer, st.attn, self._mlp
        for i, site in enumerate(self.sites):
            layer(i)
            attn(site.attn)
            mlp(i, site, T)
        self.calls += 1
        x = st.stream
        if want == "hidden":
            return x[:T].clone()
        if want == "none":
            return x[:0]
        rows = T if want == "all" else 1
        if rows != T:  # the last row only: move it to row 0 of the head's input
            x[0].copy_(x[T - 1])
        logits, bad = st.head(self.head_, rows)
        out = logits.clone()
        self.checked = out if bad == 0 else None  # Engine.step skips its own scan of these (csrc/step.c counted)
        return out

    def _mlp(self, i: int, site: _Site, T: int) -> None:
        st = self.step
        block = site.block
        if block is None:  # a dense layer
            if site.moe is not None:
                st.moe(site.moe)
            else:
                self._torch_residual(T, site.mlp(st.h[:T][None]))
            return
        ids, weights = st.routing(i, T)  # [T, k] int32, [T, k] fp32 (bf16 values where the family rounds them)
        pipeline = block.pipeline
        if not site.attn.native_router:  # the family's module routes (and observes) on h
            self._torch_residual(T, block(st.h[:T][None]))
            self.torch_moe_calls += 1
            return
        override = pipeline.override if pipeline is not None else None
        seen = self._override(override, i, T) if override is not None else st.logits[i, :T]  # in ids / weights
        observers = pipeline.observers if pipeline is not None else ()
        if observers:
            route = Route(i, st.h[:T].clone(), ids.long(), self._gate_weights(weights),
                          None if seen is None else seen.clone(), block.family.scoring, block.num_experts)  # fmt: skip
            for obs in observers:
                obs.observe(route)
        block.__dict__["last_ids"] = ids  # a plain attribute (nn.Module.__setattr__'s checks cost ~3 us a layer)
        wired = site.routed is not None and pipeline is not None and pipeline is site.pipeline
        if wired and site.routed is not None:
            experts = sorted(set(st.ids_np[i, :T].ravel().tolist()) - {-1})  # -1: a pair an override skipped
            if site.routed.run(st, experts, ids):
                if self.state is not None:
                    self.state.calls += 1
                return
        self.torch_moe_calls += 1
        h = st.h[:T]
        y = block.experts_forward(h, ids.long(), self._gate_weights(weights))
        shared = block.shared(h)
        self._torch_residual(T, y if shared is None else y + shared)

    def _override(self, override: RouteOverride, i: int, T: int) -> torch.Tensor | None:
        """Apply the routing override to layer i's routing in the step's buffers (ids [T, k] int32 and weights
        [T, k] fp32, which the MoE half reads; a skipped pair is id -1); returns the router logits [T, E] the
        observers see (pruned experts at -inf; None when a trace replaced the routing)."""
        st = self.step
        logits = st.logits[i, :T]
        lg = logits.float().numpy() if override.needs_logits(i) else None
        override.apply(i, st.ids_np[i, :T], self._wts_np[i, :T], lg)
        return None if override.replaces_logits(i) else override.mask_logits(i, logits)

    def _gate_weights(self, w: torch.Tensor) -> torch.Tensor:
        """The router weights as the family's router returns them (model dtype, or fp32 for Mixtral)."""
        return w.to(torch.bfloat16) if self.sites[0].attn.s.round_w else w.clone()

    def _torch_residual(self, T: int, y: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """x += the MLP's output (bf16, rounded as the reference adds it; wide: added in fp32)."""
        out = y[0] if isinstance(y, tuple) else y
        x = self.step.stream[:T]
        x.copy_(x + out.reshape(T, -1).to(x.dtype))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of rows x [n, H] of a residual stream `run_sequence(hidden=True)` returned (the batch
        runner's echo), through the native head `rows` rows at a time."""
        st, n = self.step, x.shape[0]
        outs = []
        for r0 in range(0, n, self.rows):
            r1 = min(n, r0 + self.rows)
            st.stream[: r1 - r0].copy_(x[r0:r1])
            outs.append(st.head(self.head_, r1 - r0)[0].clone())
        return torch.cat(outs) if len(outs) > 1 else outs[0]


__all__ = ["NativeStep"]
