"""The native decode kernels (csrc/mm.c, csrc/step.c) as typed torch ops, and the dense weights they read.

Three ops, registered with torch.library under `moetier::` (tensors and plain lists in, a tensor out), for the
paths that still run torch around the kernels (the lean decoder with RuntimeConfig.native_step off, the quantised
matmuls of qformat.linear, the float64-reference tests); the decode step itself calls the C library directly
through kernels/step.py:
- `moetier::rms_norm(x, w, eps) -> y`: RMSNorm of bf16 rows in fp32, rounded once;
- `moetier::gemv(x, q, scale, zero, kind, group) -> y`: x [M, K] bf16 @ W[N, K].T -> [M, N] bf16, for a
  bf16 weight (kind 16), a quantised one (kind 8 / 4 / 2), MXFP4 rows with their e8m0 exponent bytes (4 | FP4)
  or fp8 e4m3fn rows with fp32 scales (kind 9); csrc/mm.h gives the byte layouts;
- `moetier::moe(x, slots, layout, start, tok, rw, inter) -> out`: every active expert of one MoE layer
  call in one call: x [T, H] bf16, the experts' pool slots (one tensor each, the slot's memory), per
  expert its format row (`layout`: kind, then per matrix group, q / scale / zero byte offsets in the
  slot), the (token, router weight) pairs grouped by expert -> sum over pairs w * SwiGLU_e(x[t]) as
  [T, H] bf16; `moetier::moe_acc` adds a group of a call's experts to an fp32 accumulator instead (a
  compute tier with fewer slots than the call has experts), with the bits of one call;

Dense weights: `QDense` is a non-expert matrix (attention, output head) quantised the way llama.cpp's
Q8_0 / Q4_0 files hold them (blocks of 32, one scale each, symmetric); `quantize_dense` makes one and
`dense_linear` computes with a bf16 tensor or a QDense, picking the native kernel for up to
`native_rows()` rows.

Where the kernels come from: kernels/native.py builds the C library; `load(enabled, cache_dir)` binds
it to the ops (the ops raise until a library is bound). Without a compiler, or with
RuntimeConfig.native_kernels off, `load` returns None and callers keep torch's path (the dense executor,
matmul.linear) and say so in their stats.

Invariants: the ops never write their inputs; scratch memory is one buffer per thread, grown when a
larger call comes and reused after; a pool slot passed to `moe` must stay pinned by the caller for the call
(the store's acquire / release), and its layout row is checked (a known kind, every piece inside the slot).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.kernels import ggml, matmul, native

KIND_BF16 = 16
KIND_F8 = 9  # csrc/mm.h MT_KIND_F8: fp8 e4m3fn rows, fp32 scales per group (a block-scaled FP8 checkpoint)
SF16 = 256  # csrc/mm.h MT_SF16: a kind whose scales are fp16 (a GGUF file's Q8_0 / Q4_0 blocks, re-laid out)
ROWS = 2048  # csrc/mm.h MT_ROWS: a bf16 down matrix stored as rows of its neurons [I, H] (the sparse layout)
FP4 = 512  # csrc/mm.h MT_FP4: kind 4 whose nibbles are MXFP4 values, scales e8m0 exponent bytes (uint8 [N, K / 32],
# 2^(e - 128) each, 255 NaN), symmetric, group 32
FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # a nibble's MXFP4 value, doubled
QBLOCK = 32  # activation (and dense weight) quantisation block
DESC = 13  # int64 per expert of the C descriptor: address, kind, then 4 per matrix, w2's kind, 2 bias offsets
LAYOUT = 9  # ints per expert of the op's `layout`: kind, then (group, q, scale, zero) per matrix
NATIVE_ROWS = 16  # rows up to which the native kernels beat torch's oneDNN GEMMs (AVX-512 / AMX CPUs)
NATIVE_ROWS_NO_ONEDNN = 512  # the same where oneDNN takes no bf16 product (AVX2): torch's own bf16 GEMM is slower


def native_rows() -> int:
    """Rows (tokens) up to which a bf16 product takes the native kernels rather than torch's GEMM: 16 where
    oneDNN takes bf16 products (its blocked GEMMs win from there), 512 where it does not (AVX2 CPUs: on this
    project's AVX2 machine native prefill of 128 tokens ran at 284 tok/s against 82 through torch)."""
    return NATIVE_ROWS if matmul.onednn_takes_bf16() else NATIVE_ROWS_NO_ONEDNN


DENSE_BITS = {"int8": 8, "int4": 4}
_BF16 = torch.bfloat16
_bound: list[ctypes.CDLL] = []  # the library the ops call (one per process; every build has the same code)


def load(enabled: bool = True, cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The kernel library (native.load) bound to the ops, or None when it cannot be had (native.load_error)."""
    lib = native.load(enabled, cache_dir)
    if lib is not None and not _bound:
        _bound.append(lib)
    return lib


def formats_available(enabled: bool, cache_dir: Path | str | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether quantised expert slots take the native formats (kernels/qformat.py n8 / n4 / n2): a bf16
    model on the CPU and the library loaded."""
    return device.type == "cpu" and dtype == _BF16 and load(enabled, cache_dir) is not None


def isa(lib: ctypes.CDLL) -> str:
    """The path the decode kernels were compiled for (csrc/mm.h): "avx512-bf16-vnni", "avx2+vnni", "avx2" or
    "c" (plain C)."""
    name: bytes = lib.moetier_isa_name()
    return name.decode()


def loaded() -> ctypes.CDLL | None:
    """The kernel library `load` bound, None before it did."""
    return _bound[0] if _bound else None


def _lib() -> ctypes.CDLL:
    if not _bound:
        raise RuntimeError("moetier decode kernels are not loaded (kernels.decode.load)")
    return _bound[0]


class _Scratch(threading.local):
    buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> int:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)  # 64-byte aligned (CPU allocator)
        return self.buf.data_ptr()


_scratch = _Scratch()


# --------------------------------------------------------------------------------------------- ops

_LIB = torch.library.Library("moetier", "DEF")
_LIB.define("gemv(Tensor x, Tensor q, Tensor? scale, Tensor? zero, int kind, int group) -> Tensor")
_LIB.define("moe(Tensor x, Tensor[] slots, int[] layout, int[] start, int[] tok, float[] rw, int inter) -> Tensor")


def _check_gemv(x: torch.Tensor, q: torch.Tensor, kind: int, group: int) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype != _BF16 or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"gemv: x must be a contiguous bf16 CPU [M, K] tensor, got {x.dtype} {list(x.shape)}")
    m, k = x.shape
    if kind == KIND_BF16:
        if q.dtype != _BF16 or q.dim() != 2 or q.shape[1] != k or not q.is_contiguous():
            raise ValueError(f"gemv: bf16 weight must be contiguous [N, {k}], got {q.dtype} {list(q.shape)}")
        return m, k, q.shape[0]
    if kind >= ggml.KIND_BASE:  # a GGUF block type (kernels/ggml.py): rows of its blocks, as stored
        name = ggml.type_name(kind)
        if name is None or name not in ggml.register(_lib()) or k % ggml.block_of(name):
            raise ValueError(f"gemv: kind {kind} ({name or 'no ggml type'}) with K={k} is not a registered ggml "
                             f"type whose blocks tile K ({ggml.load_error() or 'ggml available'})")  # fmt: skip
        if q.dim() != 2 or q.dtype != torch.uint8 or q.shape[1] != ggml.row_bytes(name, k) or not q.is_contiguous():
            raise ValueError(f"gemv: a {name} weight must be contiguous uint8 [N, {ggml.row_bytes(name, k)}], got "
                             f"{q.dtype} {list(q.shape)}")  # fmt: skip
        return m, k, q.shape[0]
    if kind == KIND_F8:
        if (k % QBLOCK or group % QBLOCK or k % group or q.dim() != 2 or q.dtype != torch.uint8 or q.shape[1] != k
                or not q.is_contiguous()):  # fmt: skip
            raise ValueError(f"gemv: an fp8 weight must be contiguous uint8 [N, {k}] with groups of 32s dividing K, "
                             f"got {q.dtype} {list(q.shape)}, group {group}")  # fmt: skip
        return m, k, q.shape[0]
    if kind not in (8, 4, 2) or k % QBLOCK or group % QBLOCK or k % group or (kind == 2 and k % 128):
        raise ValueError(f"gemv: kind {kind} with K={k}, group {group} is not a layout of csrc/mm.h")
    if q.dim() != 2 or q.element_size() != 1 or q.shape[1] * 8 != k * kind or not q.is_contiguous():
        raise ValueError(f"gemv: int{kind} weight must be contiguous [N, {k * kind // 8}] bytes, got {list(q.shape)}")
    return m, k, q.shape[0]


def _gemv_impl(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, kind: int, group: int
) -> torch.Tensor:
    fp4 = FP4 if kind < ggml.KIND_BASE and kind & FP4 else 0
    kind &= ~fp4
    if fp4 and (kind != 4 or zero is not None or group != QBLOCK):
        raise ValueError("gemv: MXFP4 values (FP4) are kind 4 without zeros, group 32")
    m, k, n = _check_gemv(x, q, kind, group)
    scaled = kind < ggml.KIND_BASE and kind != KIND_BF16
    sdt = (_BF16, torch.float16) if kind in (8, 4) else (_BF16,)  # fp16: a GGUF file's Q8_0 / Q4_0 scales
    if kind == KIND_F8:
        sdt = (torch.float32,)  # an FP8 checkpoint's scale grid, one row of it per weight row
    if fp4:
        sdt = (torch.uint8,)  # each MXFP4 block's e8m0 exponent byte, as the checkpoint stores it
    if scaled and (scale is None or scale.numel() != n * (k // group) or scale.dtype not in sdt):
        raise ValueError(f"gemv: scale must be {' or '.join(map(str, sdt))} [{n}, {k // group}]")
    if zero is not None and (zero.numel() != n * (k // group) or zero.dtype != _BF16):
        raise ValueError(f"gemv: zero must be bf16 [{n}, {k // group}] or None")
    lib = _lib()
    y = torch.empty((m, n), dtype=_BF16)  # [M, N]
    scratch = _scratch.get(lib.moetier_gemv_scratch_bytes(m, k, kind))
    flag = SF16 if scaled and not fp4 and scale is not None and scale.dtype == torch.float16 else 0
    rc = lib.moetier_gemv(
        x.data_ptr(), m, k, n, kind | flag | fp4, q.data_ptr(), scale.data_ptr() if scale is not None else None,
        zero.data_ptr() if zero is not None else None, group, y.data_ptr(), scratch, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gemv: the kernel refused kind {kind} with K={k}, group {group}")
    return y


def _moe_impl(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int,
) -> torch.Tensor:  # fmt: skip
    out = torch.empty(x.shape, dtype=_BF16)  # [T, H]
    _moe_call(x, slots, layout, start, tok, rw, inter, out, 0)
    return out


def _moe_acc_impl(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int, acc: torch.Tensor,
) -> None:  # fmt: skip
    if acc.dtype != torch.float32 or acc.shape != x.shape or not acc.is_contiguous() or not acc.is_cpu:
        raise ValueError(f"moe_acc: acc must be contiguous fp32 on the CPU of x's shape, got {list(acc.shape)}")
    _moe_call(x, slots, layout, start, tok, rw, inter, acc, 2)


def _moe_call(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int, out: torch.Tensor, accumulate: int,
) -> None:  # fmt: skip
    n_exp = len(slots)
    if x.dim() != 2 or x.dtype != _BF16 or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"moe: x must be a contiguous bf16 CPU [T, H] tensor, got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    if len(layout) != LAYOUT * n_exp or len(start) != n_exp + 1 or len(tok) != len(rw) or start[-1] != len(tok):
        raise ValueError(f"moe: {n_exp} slots need {LAYOUT * n_exp} layout ints, {n_exp + 1} starts, pairs = start[-1]")
    if any(not 0 <= v < t for v in tok) or any(b < a for a, b in itertools.pairwise(start)):
        raise ValueError(f"moe: tokens must be in [0, {t}) and starts ascending")
    desc = (ctypes.c_int64 * (DESC * n_exp))()
    for e, slot in enumerate(slots):
        if not slot.is_cpu or not slot.is_contiguous():
            raise ValueError("moe: every slot must be a contiguous CPU tensor")
        row = layout[LAYOUT * e : LAYOUT * (e + 1)]
        _check_layout(e, row, slot.numel() * slot.element_size(), h, inter)
        desc[DESC * e] = slot.data_ptr()
        for j in range(LAYOUT):
            desc[DESC * e + 1 + j] = row[j]
        desc[DESC * e + 10] = row[0]  # both matrices of the op's experts have one kind
        desc[DESC * e + 11] = desc[DESC * e + 12] = -1  # no biases: this op computes SiLU experts
    lib = _lib()
    p = len(tok)
    scratch = _scratch.get(lib.moetier_moe_scratch_bytes(t, h, inter, p))
    rc = lib.moetier_moe(
        x.data_ptr(), t, h, inter, n_exp, desc, (ctypes.c_int64 * (n_exp + 1))(*start), (ctypes.c_int32 * p)(*tok),
        (ctypes.c_float * p)(*rw), out.data_ptr(), accumulate, scratch, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"moe: the kernel refused H={h}, I={inter} for the experts' kinds")


def _check_layout(e: int, row: list[int], nbytes: int, h: int, inter: int) -> None:
    """ValueError unless expert e's layout row (kind, then group, q, scale, zero per matrix) is a kind the kernels
    compute and every piece lies inside its slot's `nbytes` (w13 [2I, H], w2 [H, I])."""
    kind = row[0]
    if kind not in (KIND_BF16, KIND_F8, 8, 4, 2):
        raise ValueError(f"moe: expert {e} has layout kind {kind}; the kernels compute 16 (bf16), 9 (fp8), 8, 4 and 2")
    for m, (n, k) in enumerate(((2 * inter, h), (h, inter))):
        group, q, sc, z = row[1 + 4 * m : 5 + 4 * m]
        bits = {KIND_BF16: 16, KIND_F8: 8}.get(kind, kind)
        need = [(q, n * k * bits // 8)]
        if kind != KIND_BF16:
            if group <= 0 or k % group:
                raise ValueError(f"moe: expert {e} matrix {m} has group {group}, not a divisor of K={k}")
            sbytes = 4 if kind == KIND_F8 else 2  # fp8: fp32 scales
            need += [(sc, sbytes * n * (k // group))] + ([(z, 2 * n * (k // group))] if z >= 0 else [])
        for off, size in need:
            if off < 0 or off + size > nbytes:
                raise ValueError(f"moe: expert {e} matrix {m}: a piece at byte {off} of {size} bytes lies outside "
                                 f"its {nbytes}-byte slot")  # fmt: skip


def _rms_norm_impl(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1] if x.dim() else 0
    if x.dtype != _BF16 or w.dtype != _BF16 or not x.is_cpu or w.shape != (h,) or h == 0:
        raise ValueError(f"rms_norm: x must be bf16 CPU [..., H] and w bf16 [H], got {list(x.shape)}, {list(w.shape)}")
    xc, wc = x.contiguous(), w.contiguous()
    y = torch.empty_like(xc)
    _lib().moetier_rms_norm(xc.data_ptr(), wc.data_ptr(), xc.numel() // h, h, eps, y.data_ptr())
    return y


_LIB.define("rms_norm(Tensor x, Tensor w, float eps) -> Tensor")
_LIB.impl("rms_norm", _rms_norm_impl, "CPU")
_LIB.impl("gemv", _gemv_impl, "CPU")
_LIB.impl("moe", _moe_impl, "CPU")
_LIB.define(
    "moe_acc(Tensor x, Tensor[] slots, int[] layout, int[] start, int[] tok, float[] rw, int inter, "
    "Tensor(a!) acc) -> ()"
)
_LIB.impl("moe_acc", _moe_acc_impl, "CPU")


@torch.library.register_fake("moetier::gemv", lib=_LIB)
def _gemv_fake(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, kind: int, group: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


@torch.library.register_fake("moetier::rms_norm", lib=_LIB)
def _rms_norm_fake(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("moetier::moe", lib=_LIB)
def _moe_fake(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(x)


def gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, kind: int,
         group: int) -> torch.Tensor:  # fmt: skip
    """x [M, K] bf16 @ W.T -> [M, N] bf16 by `moetier::gemv` (see the module docstring)."""
    out: torch.Tensor = torch.ops.moetier.gemv(x, q, scale, zero, kind, group)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] bf16 with weight w [H] bf16 by `moetier::rms_norm`: fp32 math, rounded once."""
    out: torch.Tensor = torch.ops.moetier.rms_norm(x, w, eps)
    return out


def moe(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int,
) -> torch.Tensor:  # fmt: skip
    """Every active expert of one layer call: x [T, H] bf16 -> [T, H] bf16 by `moetier::moe`."""
    out: torch.Tensor = torch.ops.moetier.moe(x, slots, layout, start, tok, rw, inter)
    return out


def moe_acc(
    x: torch.Tensor, slots: list[torch.Tensor], layout: list[int], start: list[int], tok: list[int],
    rw: list[float], inter: int, acc: torch.Tensor,
) -> None:  # fmt: skip
    """`moe` for a group of a call's experts: adds their weighted outputs to acc [T, H] fp32, unrounded, so
    groups taken in ascending expert id give the bits of one `moe` call (acc.to(bf16) at the end)."""
    torch.ops.moetier.moe_acc(x, slots, layout, start, tok, rw, inter, acc)


# --------------------------------------------------------------------------------------------- dense weights


@dataclass(frozen=True, eq=False)
class QDense:
    """A dense matrix [N, K] quantised in blocks of 32 with one bf16 scale each (symmetric: int8 q in
    [-127, 127], stored minus nothing; int4 v in [0, 15] around 8, as llama.cpp's Q8_0 / Q4_0), or (`bits` a
    ggml kind, >= ggml.KIND_BASE) a GGUF file's own blocks, computed as stored (`stored_dense`), or (`bits`
    KIND_F8) a block-scaled FP8 checkpoint's e4m3fn bytes with fp32 scales (kernels/fp8.py `fp8_dense`)."""

    bits: int  # 8, 4, or a ggml kind
    n: int
    k: int
    q: torch.Tensor  # int8 [N, K] (bits 8), uint8 [N, K/2] (bits 4, csrc/mm.h nibble order), uint8 [N, row bytes]
    scale: torch.Tensor  # bf16 or fp16 [N, K/group] (fp32 for fp8, kind 9); empty for a ggml kind (in its blocks)
    zero: torch.Tensor | None = None  # bf16 [N, K/group]: a GPTQ / AWQ checkpoint's integer zeros (W = (v - z) * s)
    group: int = QBLOCK

    @property
    def nbytes(self) -> int:
        zero = self.zero.numel() * 2 if self.zero is not None else 0
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size() + zero


# GGUF types our own kernels compute (their quants and fp16 scales split apart, exactly: kind | MT_SF16) rather
# than ggml's vec_dot, chosen by measurement (docs/engine.md): (kind, bytes of quants a block of 32)
OWN_KERNEL_TYPES = {"Q4_0": (4, 16), "Q8_0": (8, 32)}


def split_blocks(type_name: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q8_0 blocks uint8 [N, nb * (2 + qb)] -> (quants [N, nb * qb] in csrc/mm.h's kind-4 / kind-8 layout,
    their fp16 scales [N, nb]): Q4_0's nibbles are already mm.h's order (byte j = v[j] | v[j + 16] << 4) and
    Q8_0's signed bytes are kind 8's v - 128."""
    _, qb = OWN_KERNEL_TYPES[type_name]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 2 + qb)  # [N, nb, 2 + qb]
    q = blocks[:, :, 2:].reshape(n, -1).contiguous()
    scale = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, -1)
    return (q.view(torch.int8) if qb == 32 else q), scale


def stored_dense(type_name: str, q: torch.Tensor, k: int) -> QDense | None:
    """A GGUF block matrix q uint8 [N, row bytes] of `type_name` (K values a row) as a QDense the kernels compute
    as stored: Q4_0 / Q8_0 by our own kernels on their quants and fp16 scales (OWN_KERNEL_TYPES), the other types
    by ggml's; None when neither computes that type in the loaded library."""
    if type_name in OWN_KERNEL_TYPES and k % QBLOCK == 0 and q.dim() == 2:
        quants, scale = split_blocks(type_name, q)
        return QDense(OWN_KERNEL_TYPES[type_name][0], q.shape[0], k, quants, scale)
    kind = ggml.kind_of(type_name, _lib())
    if kind is None or q.dim() != 2 or q.shape[1] != ggml.row_bytes(type_name, k):
        return None
    return QDense(kind, q.shape[0], k, q.contiguous(), torch.empty(0, dtype=_BF16))


def concat_dense(parts: list[QDense]) -> QDense | None:
    """Row-wise concatenation of stored QDense matrices of one kind, K and scale dtype (q, k, v into one
    projection), or None."""
    if not parts or len({(p.bits, p.k, p.scale.dtype, p.group, p.zero is None) for p in parts}) != 1:
        return None
    q = torch.cat([p.q for p in parts]).contiguous()
    scale = torch.cat([p.scale for p in parts]).contiguous() if parts[0].scale.numel() else parts[0].scale
    zeros = [p.zero for p in parts if p.zero is not None]
    zero = torch.cat(zeros).contiguous() if zeros else None
    return QDense(parts[0].bits, q.shape[0], parts[0].k, q, scale, zero, parts[0].group)


def int4_dense(v: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> QDense | None:
    """A GPTQ / AWQ / compressed-tensors int4 matrix (values int [N, K] in 0..15, integer zeros [N, G], its own fp16
    or bf16 scales [N, G]) as a QDense our int4 kernels read as stored, or None (groups not a multiple of 32)."""
    n, k = v.shape
    groups = scale.shape[1]
    if k % groups or (k // groups) % QBLOCK or scale.dtype not in (torch.float16, _BF16):
        return None
    q = pack_nibbles(v.to(torch.uint8).contiguous()).contiguous()  # v may be a transposed view (GPTQ is K-major)
    return QDense(4, n, k, q, scale.contiguous(), zero.to(_BF16).contiguous(), k // groups)


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """x fp32 >= 0 -> the smallest bf16 value >= x (as fp32), so q = round(w / s) stays in range."""
    b = x.to(_BF16).float()
    up = (b.view(torch.int32) + 1).view(torch.float32)  # next bf16 above (positive finite values)
    up = up.to(_BF16).float()
    return torch.where(b < x, up, b)


def pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """v uint8 [N, K] in [0, 15] -> [N, K/2], per block of 32: byte j = v[j] | v[j + 16] << 4."""
    n, k = v.shape
    blocks = v.reshape(n, k // 32, 2, 16)  # [N, B, half, 16]
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def pack_crumbs(v: torch.Tensor) -> torch.Tensor:
    """v uint8 [N, K] in [0, 3] -> [N, K/4]; per chunk of 128, byte j = v[j] | v[j+32]<<2 | v[j+64]<<4 | v[j+96]<<6."""
    n, k = v.shape
    c = v.reshape(n, k // 128, 4, 32)  # [N, C, quarter, 32]
    return (c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).reshape(n, k // 4)


def quantize_dense(w: torch.Tensor, bits: int, rows: int = 4096) -> QDense:
    """w [N, K] (K % 32 == 0) -> QDense: per block of 32 the scale s = max|w| / 127 (int8) or the signed
    extreme / -8 (int4, llama.cpp's Q4_0), rounded to bf16 (up, for int8), q = round(w / s)."""
    if bits not in (8, 4):
        raise ValueError(f"dense weights quantise to 8 or 4 bits, got {bits}")
    n, k = w.shape
    if k % QBLOCK:
        raise ValueError(f"a dense weight needs K % {QBLOCK} == 0 to quantise, got [{n}, {k}]")
    qs, ss = [], []
    for r in range(0, n, rows):  # bounded temporaries for the output head
        wb = w[r : r + rows].float().reshape(-1, k // QBLOCK, QBLOCK)  # [n, B, 32]
        if bits == 8:
            s = _round_up_bf16(wb.abs().amax(-1, keepdim=True) / 127)  # [n, B, 1]
            inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            qs.append((wb * inv).round_().clamp_(-127, 127).to(torch.int8).reshape(-1, k))
        else:
            idx = wb.abs().argmax(-1, keepdim=True)
            s = (wb.gather(-1, idx) / -8).to(_BF16).float()  # [n, B, 1], signed: the extreme maps to q = 0
            inv = torch.where(s != 0, 1 / s, torch.zeros_like(s))
            v = (wb * inv + 8).round_().clamp_(0, 15).to(torch.uint8).reshape(-1, k)
            qs.append(pack_nibbles(v))
        ss.append(s.reshape(-1, k // QBLOCK).to(_BF16))
    return QDense(bits, n, k, torch.cat(qs).contiguous(), torch.cat(ss).contiguous())


def dequantize_dense(w: QDense) -> torch.Tensor:
    """The matrix a QDense holds, fp32 [N, K] (tests; the torch reference)."""
    s = w.scale.float().repeat_interleave(QBLOCK, dim=1)  # [N, K]
    if w.bits == 8:
        return w.q.float() * s
    v = w.q.reshape(w.n, w.k // 32, 1, 16)
    vals = torch.cat([v & 15, v >> 4], dim=2).reshape(w.n, w.k)  # [N, K]
    return (vals.float() - 8) * s


def dense_linear(
    x: torch.Tensor, w: torch.Tensor | QDense, bias: torch.Tensor | None, native_bf16: bool
) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N]. A QDense always takes the native kernel (bf16 x); a bf16
    weight takes it for up to native_rows() bf16 rows when `native_bf16`, else matmul.linear."""
    if isinstance(w, QDense):
        x2 = x.reshape(-1, w.k)
        y = gemv(x2.to(_BF16).contiguous(), w.q, w.scale if w.bits < ggml.KIND_BASE else None, w.zero, w.bits, w.group)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], w.n).to(x.dtype)
    if native_bf16 and x.dtype == _BF16 and w.dtype == _BF16 and x.is_cpu and w.is_contiguous():
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= native_rows():
            y = gemv(x2.contiguous(), w, None, None, KIND_BF16, 0)
            if bias is not None:
                y = y + bias
            return y.view(*x.shape[:-1], w.shape[0])
    return matmul.linear(x, w, bias)


__all__ = [
    "DENSE_BITS", "KIND_BF16", "LAYOUT", "NATIVE_ROWS", "NATIVE_ROWS_NO_ONEDNN", "QBLOCK", "QDense", "dense_linear",
    "dequantize_dense", "formats_available", "gemv", "isa", "load", "moe", "moe_acc", "native_rows", "pack_crumbs",
    "pack_nibbles", "quantize_dense", "rms_norm",
]  # fmt: skip
