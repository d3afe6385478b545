"""The decode step's native calls (csrc/step.h) as typed Python: the structs, the slot table, the calls.

`AttnLayer`, `MoeLayer` and `Head` hold one layer's (or the output head's) C struct and the tensors it
points at, built once per engine from the lean decoder's weights; `Step` is the per-call struct with the
engine's buffers (residual stream, MoE input, routing outputs, one scratch buffer), allocated once for
up to `rows` rows; `SlotTable` is the descriptor row of every slot of a store's compute pools (a slot's
address and layout are fixed while its pool lives, so the table is built once and a layer call passes
row addresses, not per-call packing).

Invariants: every pointer a struct holds stays valid while the object that built it lives (the objects
keep their tensors); the calls check their return codes (-1: a shape or kind the kernels refuse, -2:
scratch too small, both ValueError here, never silent); `Step.scratch` is sized from the kernels' own
`*_scratch_bytes` for `rows` rows and the longest cache, and counted in `Step.nbytes`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moetier.kernels import ggml
from moetier.kernels.decode import FP4, KIND_BF16, KIND_F8, OWN_KERNEL_TYPES, QBLOCK, ROWS, SF16, QDense
from moetier.kernels.qformat import NATIVE_KINDS, QExpertViews
from moetier.kernels.stored import StoredExpertViews, StoredVariants, StoredWeight
from moetier.store.pool import SlotViews

I64, F32, P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
DESC = 13  # int64 per slot descriptor: address, kind, (group, q, scale, zero) per matrix, w2's kind, bias offsets
_BF16 = torch.bfloat16


class MtW(ctypes.Structure):
    _fields_ = [("kind", I64), ("q", P), ("s", P), ("z", P), ("group", I64), ("sf16", I64), ("fp4", I64), ("rows", I64)]


class MtAttn(ctypes.Structure):
    _fields_ = [
        *((n, I64) for n in ("H", "nh", "nkv", "hd", "max_pos", "qk_norm", "router", "E", "topk", "norm_topk",
                             "round_w", "layer")),
        *((n, F32) for n in ("eps", "clip", "scale", "pad")),
        *((n, P) for n in ("in_norm", "post_norm", "q_norm", "k_norm", "bqkv", "bo", "cos", "sin", "router_w")),
        ("wqkv", MtW), ("wo", MtW), ("sinks", P), ("window", I64), ("router_b", P),
    ]  # fmt: skip


class MtStep(ctypes.Structure):
    _fields_ = [
        ("T", I64), ("x", P), ("h", P), ("pos", P), ("kc", P), ("vc", P), ("cap", P), ("ids", P), ("wts", P),
        ("logits", P), ("scratch", P), ("scratch_bytes", I64), ("nthreads", I64), ("xw", P),
    ]  # fmt: skip


class MtMoe(ctypes.Structure):
    _fields_ = [("H", I64), ("I", I64), ("E", I64), ("topk", I64), ("Is", I64), ("sh13", MtW), ("sh2", MtW),
                ("sh_gate", P), ("act", I64), ("alpha", F32), ("limit", F32)]  # fmt: skip


@dataclass(frozen=True)
class Activation:
    """The routed experts' activation in the MoE half (csrc/step.h mt_moe.act): SiLU(gate) * up (kind 0), or
    GPT-OSS's clamped alpha-sigmoid GLU (kind 1, `alpha`, `limit`; kernels/experts.py GptOssGLU)."""

    kind: int = 0
    alpha: float = 0.0
    limit: float = 0.0


SILU = Activation()


class MtHead(ctypes.Structure):
    _fields_ = [("H", I64), ("V", I64), ("eps", F32), ("pad", F32), ("norm", P), ("w", MtW)]


def weight(w: torch.Tensor | QDense) -> tuple[MtW, list[torch.Tensor]]:
    """A dense weight [N, K] (bf16, or a QDense of Q8_0 / Q4_0 blocks) as the kernels' MtW, and the tensors
    it points at (kept alive by the caller)."""
    if isinstance(w, QDense):
        sf16 = int(w.scale.dtype == torch.float16)  # a checkpoint's own fp16 scales (GGUF Q8_0 / Q4_0, GPTQ, AWQ)
        keep = [w.q, w.scale] + ([w.zero] if w.zero is not None else [])
        zp = w.zero.data_ptr() if w.zero is not None else None
        return MtW(w.bits, w.q.data_ptr(), w.scale.data_ptr(), zp, w.group, sf16), keep
    if w.dtype != _BF16 or w.dim() != 2 or not w.is_contiguous() or not w.is_cpu:
        raise ValueError(f"a native weight is a contiguous bf16 CPU matrix, got {w.dtype} {list(w.shape)}")
    return MtW(KIND_BF16, w.data_ptr(), None, None, 0), [w]


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise ValueError(f"{what}: the step's scratch is too small for this call")
    if rc != 0:
        raise ValueError(f"{what}: the kernels refused a shape or weight kind (rc {rc})")


@dataclass(frozen=True)
class AttnSpec:
    """The attention half's constants (csrc/step.h mt_attn) apart from the weights."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    clip: float  # <= 0: none
    qk_norm: int  # 0 none, 1 per head, 2 whole projection
    experts: int  # router rows E (0: no native router)
    top_k: int
    norm_topk: bool
    round_weights: bool


class AttnLayer:
    """One layer's attention half (norms, QKV, RoPE, cache write, attention, output projection, residual,
    post-attention norm, router) as its C struct."""

    def __init__(
        self, spec: AttnSpec, layer: int, in_norm: torch.Tensor, post_norm: torch.Tensor,
        wqkv: torch.Tensor | QDense, bqkv: torch.Tensor | None, wo: torch.Tensor | QDense, bo: torch.Tensor | None,
        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        router_w: torch.Tensor | None, sinks: torch.Tensor | None = None, window: int = 0,
        router_b: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """`sinks` [nh]: each head's sink logit (GPT-OSS), None for none; `window` > 0: a sliding window of that
        many positions (0: the whole cache); `router_b` [E]: the router's bias (GPT-OSS)."""
        keep: list[torch.Tensor] = []

        def bf(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            c = t.detach().to(_BF16).contiguous()
            keep.append(c)
            return c.data_ptr()

        mq, kq = weight(wqkv)
        mo, ko = weight(wo)
        keep += kq + ko
        self.s = MtAttn(
            H=spec.hidden, nh=spec.heads, nkv=spec.kv_heads, hd=spec.head_dim, max_pos=cos.shape[0],
            qk_norm=spec.qk_norm, router=int(router_w is not None), E=spec.experts if router_w is not None else 0,
            topk=spec.top_k, norm_topk=int(spec.norm_topk), round_w=int(spec.round_weights), layer=layer,
            eps=spec.eps, clip=spec.clip, scale=spec.head_dim**-0.5, pad=0.0,
            in_norm=bf(in_norm), post_norm=bf(post_norm), q_norm=bf(q_norm), k_norm=bf(k_norm), bqkv=bf(bqkv),
            bo=bf(bo), cos=bf(cos), sin=bf(sin), router_w=bf(router_w), wqkv=mq, wo=mo, sinks=bf(sinks),
            window=int(window), router_b=bf(router_b) if router_w is not None else None,
        )  # fmt: skip
        self.keep = keep
        self.ref = ctypes.byref(self.s)
        self.native_router = router_w is not None


class MoeLayer:
    """One layer's MoE half: routed experts by slot descriptor, the shared expert (or a dense MLP) by weight."""

    def __init__(
        self, hidden: int, inter: int, experts: int, top_k: int, shared: tuple[torch.Tensor | QDense,
        torch.Tensor | QDense, torch.Tensor | None] | None = None, act: Activation = SILU,
    ) -> None:  # fmt: skip
        keep: list[torch.Tensor] = []
        s13, s2, is_ = MtW(), MtW(), 0
        gate = None
        if shared is not None:
            w13, w2, g = shared
            s13, k13 = weight(w13)
            s2, k2 = weight(w2)
            keep += k13 + k2
            is_ = (w13.n if isinstance(w13, QDense) else w13.shape[0]) // 2
            if g is not None:
                gc = g.detach().to(_BF16).reshape(-1).contiguous()
                keep.append(gc)
                gate = gc.data_ptr()
        self.s = MtMoe(H=hidden, I=inter, E=experts, topk=top_k, Is=is_, sh13=s13, sh2=s2, sh_gate=gate,
                       act=act.kind, alpha=act.alpha, limit=act.limit)  # fmt: skip
        self.keep = keep
        self.ref = ctypes.byref(self.s)
        self.desc = (ctypes.c_void_p * max(experts, 1))()  # expert id -> its slot's descriptor row (this call)
        self.desc_ref = ctypes.byref(self.desc)


class Head:
    """Final RMSNorm and the output head."""

    def __init__(self, norm: torch.Tensor, w: torch.Tensor | QDense, eps: float) -> None:
        mw, kw = weight(w)
        n = norm.detach().to(_BF16).contiguous()
        self.keep = [*kw, n]
        h = w.k if isinstance(w, QDense) else w.shape[1]
        v = w.n if isinstance(w, QDense) else w.shape[0]
        self.s = MtHead(H=h, V=v, eps=eps, pad=0.0, norm=n.data_ptr(), w=mw)
        self.ref = ctypes.byref(self.s)
        self.vocab = v


class Step:
    """The per-call struct and the engine's buffers for up to `rows` rows (allocated once)."""

    def __init__(self, lib: ctypes.CDLL, rows: int, hidden: int, layers: int, top_k: int, experts: int,
                 attn: Sequence[AttnLayer], moes: Sequence[MoeLayer], head: Head | None, max_len: int,
                 nthreads: int, wide: bool = False) -> None:  # fmt: skip
        """Buffers for `rows` rows of `layers` layers; the scratch is the most any of `attn`, `moes` and `head`
        needs for that many rows (attention: for caches of up to `max_len` positions, `nthreads` threads).
        `wide`: the residual stream is fp32 (`xw`, csrc/step.h mt_step.xw) and the head returns fp32 logits."""
        self.lib, self.rows, self.hidden, self.wide = lib, rows, hidden, wide
        e = max(experts, 1)
        # the residual stream: bf16 x, or (wide) fp32 xw with x a 0-row placeholder
        self.x = torch.empty((0 if wide else rows, hidden), dtype=_BF16)
        self.xw = torch.empty((rows if wide else 0, hidden), dtype=torch.float32)
        self.h = torch.empty((rows, hidden), dtype=_BF16)  # the MoE half's input
        self.pos = (ctypes.c_int64 * rows)()  # ctypes arrays: set per row from Python at ~50 ns an item
        self.cap = (ctypes.c_int64 * rows)()
        self.kc = (ctypes.c_void_p * rows)()
        self.vc = (ctypes.c_void_p * rows)()
        # routing outputs per layer: observers and find_nonfinite read a layer's after the next one ran
        self.ids = torch.zeros((layers, rows, max(top_k, 1)), dtype=torch.int32)
        self.wts = torch.zeros((layers, rows, max(top_k, 1)), dtype=torch.float32)
        self.logits = torch.zeros((layers, rows, e), dtype=_BF16)
        self.out = torch.empty((rows, head.vocab if head is not None else 0), dtype=torch.float32 if wide else _BF16)
        self.max_len = max_len
        need = max(
            [int(lib.moetier_attn_scratch_bytes(a.ref, rows, max_len, nthreads)) for a in attn]
            + [int(lib.moetier_moe_half_scratch_bytes(m.ref, rows)) for m in moes]
            + ([int(lib.moetier_head_scratch_bytes(head.ref, rows))] if head is not None else [0])
        )  # fmt: skip
        self.scratch = torch.empty(need + 64, dtype=torch.uint8)  # 64-byte aligned (CPU allocator)
        self.nthreads = nthreads
        self.s = MtStep(
            T=0, x=self.x.data_ptr(), h=self.h.data_ptr(), pos=ctypes.addressof(self.pos),
            kc=ctypes.addressof(self.kc), vc=ctypes.addressof(self.vc), cap=ctypes.addressof(self.cap), ids=0, wts=0,
            logits=0,
            scratch=self.scratch.data_ptr(), scratch_bytes=need, nthreads=nthreads,
            xw=self.xw.data_ptr() if wide else None,
        )  # fmt: skip
        self.ref = ctypes.byref(self.s)
        self._layer_ptrs = [
            (self.ids[i].data_ptr(), self.wts[i].data_ptr(), self.logits[i].data_ptr()) for i in range(layers)
        ]
        self.ids_np = self.ids.numpy()  # the same memory: the per-layer Python reads it without torch dispatch
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def routing(self, i: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's ids [rows, k] int32 and weights [rows, k] fp32 of the last call (views, made once each)."""
        v = self._views.get((i, rows))
        if v is None:
            v = self._views[(i, rows)] = (self.ids[i, :rows], self.wts[i, :rows])
        return v

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the step holds (scratch included)."""
        ts = (self.x, self.xw, self.h, self.ids, self.wts, self.logits, self.out, self.scratch)
        return sum(t.numel() * t.element_size() for t in ts) + 4 * 8 * self.rows

    def layer(self, i: int) -> None:
        """Point the step's routing outputs at layer i's buffers."""
        self.s.ids, self.s.wts, self.s.logits = self._layer_ptrs[i]

    def attn(self, a: AttnLayer) -> None:
        rc = self.lib.moetier_attn_half(a.ref, self.ref)
        if rc:
            _check(rc, "attention half")

    def moe(self, m: MoeLayer, mode: int = 3) -> None:
        """The MoE half (mode 3), or one group of its routed experts (csrc/step.h: bit 1 starts, bit 2 ends)."""
        rc = self.lib.moetier_moe_half(m.ref, self.ref, m.desc_ref, mode)
        if rc:
            _check(rc, "MoE half")

    @property
    def stream(self) -> torch.Tensor:
        """The residual stream [rows, H]: x (bf16) or, wide, xw (fp32)."""
        return self.xw if self.wide else self.x

    def head(self, hd: Head, rows: int) -> tuple[torch.Tensor, int]:
        """(logits [rows, V] of the step's first `rows` rows of the residual stream (bf16, or fp32 when wide; a view
        of the step's buffer), how many of them are NaN or Inf)."""
        x, xw = (None, self.xw.data_ptr()) if self.wide else (self.x.data_ptr(), None)
        out16, out32 = (None, self.out.data_ptr()) if self.wide else (self.out.data_ptr(), None)
        rc = int(self.lib.moetier_head(hd.ref, x, xw, rows, out16, out32, self.scratch.data_ptr(),
                                       self.s.scratch_bytes, self.s.nthreads))  # fmt: skip
        if rc < 0:
            _check(rc, "output head")
        return self.out[:rows], rc


def desc_row(views: Any, lib: ctypes.CDLL | None = None) -> list[int] | None:
    """A slot's descriptor row (csrc/step.h): address, kind, then per matrix (w13 [2I, H], w2 [H, I]) its group
    and the byte offsets of q, scale and zero from the address (-1: none), then w2's kind, then the byte offsets
    of the biases b13 and b2 (bf16, -1: none); None for a format the kernels do not read (fp32 / fp16 slots,
    non-native quantised kinds, quantised down rows). A bf16 slot of the sparse layout (down rows [I, H]) has w2's
    kind | MT_ROWS. With `lib`, a stored-form slot of GGUF blocks whose types ggml computes (kernels/ggml.py) is
    read as stored."""
    row = _matrices_row(views, lib)
    if row is None:
        return None
    biases = _bias_offsets(views, row[0])
    return None if biases is None else [*row, *biases]


def _bias_offsets(views: Any, base: int) -> list[int] | None:
    """[b13, b2] byte offsets from `base` (-1: none), None when a bias is not a contiguous bf16 vector."""
    out = []
    for b in (views.b13, views.b2):
        if b is None:
            out.append(-1)
        elif b.dtype != _BF16 or not b.is_contiguous() or not b.is_cpu:
            return None
        else:
            out.append(b.data_ptr() - base)
    return out


def _matrices_row(views: Any, lib: ctypes.CDLL | None) -> list[int] | None:
    """desc_row's first 11 fields."""
    if isinstance(views, SlotViews):
        if views.row.dtype != _BF16 or not views.row.is_cpu:
            return None
        rows = views.down_rows  # the sparse layout's down matrix, [I, H]: read as down rows (MT_ROWS)
        w2 = views.w2 if rows is None else rows
        if not (views.w13.is_contiguous() and w2.is_contiguous()):
            return None
        base = views.row.data_ptr()
        return [base, KIND_BF16, 0, views.w13.data_ptr() - base, -1, -1, 0, w2.data_ptr() - base, -1, -1,
                KIND_BF16 | (ROWS if rows is not None else 0)]  # fmt: skip
    if isinstance(views, QExpertViews) and views.w13.kind == "f8":  # fp8 e4m3fn rows, fp32 scales (kernels/fp8.py)
        if views.w2.kind != "f8" or not views.row.is_cpu:
            return None
        base = views.row.data_ptr()
        row = [base, KIND_F8]
        for w in (views.w13, views.w2):
            if w.scale is None:
                return None
            row += [w.group, w.q.data_ptr() - base, w.scale.data_ptr() - base, -1]
        return [*row, KIND_F8]
    if isinstance(views, QExpertViews) and views.w13.kind == "gg":  # ggml blocks (kernels/qformat.py): bits = kind
        if views.w2.kind != "gg" or not views.row.is_cpu:
            return None
        base = views.row.data_ptr()
        return [base, views.w13.bits, 0, views.w13.q.data_ptr() - base, -1, -1, 0, views.w2.q.data_ptr() - base, -1,
                -1, views.w2.bits]  # fmt: skip
    if isinstance(views, QExpertViews):
        if views.w13.kind not in NATIVE_KINDS or views.w2.kind != views.w13.kind or not views.row.is_cpu:
            return None
        if views.w13.scale is None:  # every native kind has scale pieces
            return None
        base = views.row.data_ptr()
        kind = views.w13.bits | (SF16 if views.w13.scale.dtype == torch.float16 else 0)  # a checkpoint's fp16 scales
        row = [base, kind]
        for w in (views.w13, views.w2):
            if w.zero is None or w.scale is None or w.scale.dtype != views.w13.scale.dtype:
                return None
            row += [w.group, w.q.data_ptr() - base, w.scale.data_ptr() - base, w.zero.data_ptr() - base]
        return [*row, kind]
    if isinstance(views, StoredExpertViews) and lib is not None:
        return _stored_row(views, lib)
    return None


def stored_kind(w: StoredWeight, lib: ctypes.CDLL) -> tuple[int, int, int, int] | None:
    """(kernel kind, group, address of its first row, address of its scales or -1) of a stored matrix: a re-laid
    GGUF Q4_0 / Q8_0 matrix (our kernels, fp16 scales: kind | SF16, group 32), an MXFP4 matrix re-laid for our
    kernels (kind 4 | FP4, an e8m0 exponent byte per block), or rows of one GGUF block type ggml computes laid out as
    one [N, K] run (gate then up adjacent); None otherwise."""
    if w.relaid == "MXFP4":  # quants then the blocks' e8m0 exponent bytes: kind 4 | MT_FP4, one per block of 32
        q, sc = w.mxfp4_split()
        return 4 | FP4, QBLOCK, q.data_ptr(), sc.data_ptr()
    if w.relaid is not None:
        q, d = w.relay_split()
        return OWN_KERNEL_TYPES[w.relaid][0] | SF16, QBLOCK, q.data_ptr(), d.data_ptr()
    segs = sorted(w.segments, key=lambda s: s.rows[0][1])
    codecs = {s.tensor.codec for s in segs}
    if len(codecs) != 1:
        return None
    codec = next(iter(codecs))
    if codec is None or not codec.startswith("gguf:") or "+" in codec:
        return None
    name = codec.removeprefix("gguf:")
    kind = ggml.kind_of(name, lib)
    if kind is None:
        return None
    rb = ggml.row_bytes(name, w.k)
    addr, row = None, 0
    for s in segs:
        if len(s.parts) != 1 or not s.parts[0].is_cpu or not s.parts[0].is_contiguous():
            return None
        p = s.parts[0]
        if any(op != "copy" for op, _, _ in s.rows) or len(s.rows) != 1:
            return None
        _, r0, r1 = s.rows[0]
        if r0 != row or p.numel() * p.element_size() != (r1 - r0) * rb:
            return None
        if addr is None:
            addr = p.data_ptr()
        elif p.data_ptr() != addr + row * rb:  # gate and up must be one run of rows
            return None
        row = r1
    if addr is None or row != w.n:
        return None
    return kind, 0, addr, -1


def _stored_row(views: StoredExpertViews, lib: ctypes.CDLL) -> list[int] | None:
    if not views.row.is_cpu:
        return None
    k13, k2 = stored_kind(views.w13, lib), stored_kind(views.w2, lib)
    if k13 is None or k2 is None:
        return None
    base = views.row.data_ptr()
    row = [base, k13[0]]
    for _, group, q, s in (k13, k2):
        row += [group, q - base, s - base if s >= 0 else -1, -1]
    return [*row, k2[0]]


class SlotTable:
    """The descriptor row of every slot of the given pools (their `views` lists), built once."""

    def __init__(self, pools: Iterable[Any], lib: ctypes.CDLL | None = None) -> None:
        rows: list[list[int]] = []
        owners: list[tuple[int, Any]] = []  # (variant, views): variant -1 for a plain slot
        self.unreadable = 0
        self.of_layer: dict[int, int] = {}  # a mixed stored pool's layer -> variant (stored.StoredVariants)
        for pool in pools:
            for views in pool.views:
                if isinstance(views, StoredVariants):  # one row per layout the slot may hold
                    self.of_layer = views.of_layer
                    for j, v in enumerate(views.variants):
                        row = desc_row(v, lib)
                        if row is None:
                            self.unreadable += 1
                            continue
                        rows.append(row)
                        owners.append((j, views))
                    continue
                row = desc_row(views, lib)
                if row is None:
                    self.unreadable += 1
                    continue
                rows.append(row)
                owners.append((-1, views))
        self.table = torch.tensor(rows or [[0] * DESC], dtype=torch.int64)  # [S, DESC]
        base = self.table.data_ptr()
        self._addr = {id(v): base + 8 * DESC * i for i, (j, v) in enumerate(owners) if j < 0}
        # variant -> id(slot views) -> row address: the plain slots (another precision's pool) and that layout's rows
        self._variant: dict[int, dict[int, int]] = {j: dict(self._addr) for j, _ in owners if j >= 0}
        for i, (j, v) in enumerate(owners):
            if j >= 0:
                self._variant[j][id(v)] = base + 8 * DESC * i
        self._owners = owners  # keeps id() keys valid

    def for_layer(self, layer: int) -> dict[int, int]:
        """id(views) -> descriptor row address for the experts of `layer`: `by_id`, or in a pool whose layers
        store their experts differently, the rows of that layer's layout."""
        if layer in self.of_layer:
            return self._variant.get(self.of_layer[layer], self._addr)
        return self._addr

    def addr(self, views: Any) -> int | None:
        """The address of this slot's descriptor row, None for a slot the kernels do not read."""
        return self._addr.get(id(views))

    @property
    def by_id(self) -> dict[int, int]:
        """id(views) -> descriptor row address (the hot path's lookup, `addr` without a call)."""
        return self._addr


__all__ = ["DESC", "SILU", "Activation", "AttnLayer", "AttnSpec", "Head", "MoeLayer", "MtAttn", "MtHead", "MtMoe",
           "MtStep", "MtW", "SlotTable", "Step", "desc_row", "weight"]  # fmt: skip
