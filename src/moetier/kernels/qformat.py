"""Compute ("slot") formats of quantised experts and the matmul that reads them.

A quantised expert lives in one pool slot, a uint8 row of `ExpertFormat.slot_bytes`. The row
holds, per matrix (w13 [2I, H], w2 [H, I]), the pieces of that matrix's compute format, then
the biases (model dtype); every piece starts on a 64-byte boundary and slot_bytes is a multiple
of 64, so pieces of every slot of a 64-byte aligned pool stay aligned. Views are byte slices
reinterpreted with `.view(dtype).view(shape)`: no copy.

Formats (per matrix; `kind` of QLinearWeight), W = (q - zero) * scale in canonical terms:
- "int8" (CPU, bf16, g == K, K % 16 == 0): q int8 [N, K] = q - 128, scale bf16 [N],
  zero bf16 [N] = c = scale * (zero - 128); y = _weight_int8pack_mm(x, q8, s) - sum_k(x) * c.
- "int4" (CPU, bf16, N % 16 == 0, g in 32/64/128/256): q uint8 [N, K/2] from
  _convert_weight_to_int4pack_for_cpu, scale bf16 [G, N, 2] = (scale, (8 - zero) * scale) since
  the kernel computes (q - 8) * s + z; y = _weight_int4pack_mm_for_cpu(x, q, g, sz).
- "int2" (CPU, bf16, N % 64 == 0, g in 32/64/128/256, G >= 2): the int4 packer lays 2-bit values
  out in blocks of 64 rows, k-major ([K, 32] bytes per block), each byte using bits 0-1 and 4-5
  only. Per block, the bytes of the groups G_lo = ceil(G/2) onwards are folded onto those of the
  first groups: q uint8 [N/64, K_lo*32] = lo | (hi << 2). Per call one `&` with (0x33, 0xCC)
  unfolds it into a per-thread scratch [N, K/2] (allocated once per thread and matrix shape):
  lo groups hold q, hi groups 4q, so their scale row is (s/4, (2 - zero) * s) instead of
  (s, (8 - zero) * s); then the int4 kernel as above. The unfold splits its work over threads
  the way the kernel does (by row block), so each thread reads back what it wrote.
- "n8" / "n4" / "n2" (CPU, bf16, the native decode kernels loaded, K % 32 == 0 and g % 32 == 0, int2 also
  K % 128 == 0): the layouts of csrc/mm.h (kernels/decode.py): q int8 [N, K] = q - 128, uint8
  [N, K/2] nibbles per block of 32, uint8 [N, K/4] 2-bit fields per chunk of 128; scale and zero the
  canonical bf16 [N, G]. The C kernel quantises x to int8 per block of 32 and takes integer dot products.
- "generic" (anything else: fp32/fp16 models, CUDA, shapes the kernels refuse, int8 with g < K):
  the canonical q/scale/zero; dequantised to x's dtype per call, then matmul.linear.
- "gg" (a ggml block precision, formats/quant_ggml.py: q4_k, iq4_xs, q2_k ...): q uint8 [N, row bytes], the rows
  of the matrix's GGUF block type as the tier stores them (no scale or zero pieces: they are in the blocks);
  `bits` is its kernel kind (ggml.KIND_BASE + the type), computed by ggml's dot product through the native
  kernels (the MoE call and `gemv`, as a GGUF file's experts are). "gg-decode": the same bytes where ggml or the
  native kernels are not available (or CUDA, fp32 / fp16 models): decoded by gguf-py's reference per call.

The stored form (a checkpoint's experts kept in the slot in its own coding) is kernels/stored.py; `linear`
decodes its StoredWeight per call.

Measured on this project's CPU (torch 2.13, AVX-512): _weight_int8pack_mm needs K % 16 == 0,
and, for bf16, x rows 32-byte aligned and q8 rows 16-byte aligned (aligned vector loads; a
violation reads garbage or crashes); fp32 x needs fp32 scales and runs a scalar loop. The int4
packer needs N % 16 == 0; the int4 matmul accepts g in {32, 64, 128, 256} and a contiguous 2-D x.
The int2 fold relies on the packer's block layout, checked once by `_int2_layout_ok`.

`linear` on the hot path allocates its output (plus, int8, the [M, 1] row sums of x; generic, the
dequantised weight and uint8 bit fields); x is copied only if it is not bf16, not contiguous or,
for int8, not 32-byte aligned.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError
from moetier.formats import quant_ggml
from moetier.formats.layout import ExpertLayout
from moetier.formats.quant import QuantSpec, dequantize_into, expert_tensor_specs, resolve_group, unpack_bits
from moetier.kernels import decode, ggml, matmul
from moetier.kernels.slots import ALIGN, Slice, align, check_row, slice_view
from moetier.kernels.stored import StoredWeight
from moetier.types import Precision

NATIVE_KINDS = ("n8", "n4", "n2")
KERNEL_GROUPS = (32, 64, 128, 256)
_BF16 = torch.bfloat16
_MASKS = torch.tensor([0x33, 0xCC], dtype=torch.uint8).view(1, 2, 1)  # lo, hi bit fields of a folded byte


def _int2_split(k: int, g: int) -> tuple[int, int]:
    """(K_lo, K_hi): in features kept in bits 0-1 / folded into bits 2-3 (whole groups; K_lo >= K_hi)."""
    k_lo = -(-(k // g) // 2) * g
    return k_lo, k - k_lo


class _Int2Scratch(threading.local):
    """Per-thread unfold buffer of one int2 matrix shape: [N, K/2] uint8 in the int4 kernel's layout."""

    def __init__(self, n: int, k: int, g: int) -> None:
        k_lo, k_hi = _int2_split(k, g)
        self.packed = torch.empty((n, k // 2), dtype=torch.uint8)  # [N, K/2]
        blocks = self.packed.view(n // 64, k * 32)  # [N/64, K*32], block b: [K, 32] k-major
        self.pair = blocks.view(n // 64, 2, k_lo * 32) if k_lo == k_hi else None  # [N/64, 2, K_lo*32]
        self.lo, self.hi = blocks[:, : k_lo * 32], blocks[:, k_lo * 32 :]
        self.hi_bytes = k_hi * 32


@functools.cache
def _int2_layout_ok() -> bool:
    """Whether the int4 packer lays 2-bit values out as the int2 fold assumes: 64-row blocks, k-major,
    32 bytes per k, bits 0-1 and 4-5 only (probed once on a 128 x 64 matrix)."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")):
        return False
    k = torch.arange(64, dtype=torch.int32) % 4  # [K]
    packed = aten._convert_weight_to_int4pack_for_cpu(k.expand(128, 64).contiguous(), 1)
    want = (k.to(torch.uint8) * 17).view(1, 64, 1).expand(2, 64, 32)  # byte = q | q << 4
    return packed.numel() == 128 * 32 and torch.equal(packed.reshape(2, 64, 32), want)


@dataclass(eq=False)
class QLinearWeight:
    """One quantised matrix inside a slot, in the compute format `kind` (see the module docstring
    for what q, scale and zero hold per kind)."""

    kind: str  # "int8" | "int4" | "int2" | "n8" | "n4" | "n2" | "f8" (kernels/fp8.py) | "gg" | "gg-decode" | "generic"
    n: int
    k: int
    group: int
    bits: int  # "gg": the ggml kernel kind
    q: torch.Tensor
    scale: torch.Tensor | None  # None: "gg", "gg-decode" (the scales are in the blocks)
    zero: torch.Tensor | None
    scratch: _Int2Scratch | None = None
    gtype: str | None = None  # "gg", "gg-decode": the GGUF block type of the rows


@dataclass
class QExpertViews:
    w13: QLinearWeight  # [2I, H]
    w2: QLinearWeight  # [H, I]
    b13: torch.Tensor | None  # [2I], model dtype
    b2: torch.Tensor | None  # [H]
    row: torch.Tensor  # uint8 [slot_bytes], the whole slot


# --------------------------------------------------------------------------- per-kind pieces and packing

Pieces = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _pieces(kind: str, n: int, k: int, g: int, bits: int, gtype: str | None = None) -> Pieces:
    """Piece name -> (dtype, shape) of one matrix in format `kind`; names are QLinearWeight fields."""
    if gtype is not None:  # "gg", "gg-decode": the rows of the type's blocks
        return {"q": (torch.uint8, (n, ggml.row_bytes(gtype, k)))}
    if kind in NATIVE_KINDS:
        qshape = (n, k) if bits == 8 else (n, k * bits // 8)
        qtype = torch.int8 if bits == 8 else torch.uint8
        return {"q": (qtype, qshape), "scale": (_BF16, (n, k // g)), "zero": (_BF16, (n, k // g))}
    if kind == "int8":
        return {"q": (torch.int8, (n, k)), "scale": (_BF16, (n,)), "zero": (_BF16, (n,))}
    if kind == "int4":
        return {"q": (torch.uint8, (n, k // 2)), "scale": (_BF16, (k // g, n, 2))}
    if kind == "int2":
        return {"q": (torch.uint8, (n // 64, _int2_split(k, g)[0] * 32)), "scale": (_BF16, (k // g, n, 2))}
    return {"q": (torch.uint8, (n, k * bits // 8)), "scale": (_BF16, (n, k // g)), "zero": (_BF16, (n, k // g))}


def _convert(
    kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, bits: int
) -> dict[str, torch.Tensor]:
    """Canonical q [N, K*bits/8], scale, zero [N, G] -> the pieces of format `kind` (may allocate)."""
    if kind == "generic":
        return {"q": q, "scale": scale, "zero": zero}
    if kind in NATIVE_KINDS:  # scale and zero as they are; q re-laid out for csrc/mm.h
        if bits == 8:
            native = torch.bitwise_xor(q, 0x80).view(torch.int8)  # [N, K], q - 128 in two's complement
        else:
            v = unpack_bits(q, bits, k)  # [N, K]
            native = decode.pack_nibbles(v) if bits == 4 else decode.pack_crumbs(v)
        return {"q": native, "scale": scale, "zero": zero}
    s, z = scale.float(), zero.float()  # [N, G]
    if kind == "int8":
        q8 = torch.bitwise_xor(q, 0x80).view(torch.int8)  # [N, K], q - 128 in two's complement
        return {"q": q8, "scale": s[:, 0].to(_BF16), "zero": (s[:, 0] * (z[:, 0] - 128)).to(_BF16)}
    n, groups = s.shape
    qi = unpack_bits(q, bits, k).to(torch.int32)  # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, 1)  # uint8 [N, K/2]
    if kind == "int4":
        sz = torch.stack([s, (8 - z) * s], dim=-1)  # [N, G, 2], kernel: (q - 8) * s + z
        return {"q": packed, "scale": sz.transpose(0, 1).to(_BF16)}  # [G, N, 2]
    k_lo, k_hi = _int2_split(k, k // groups)
    g_lo = k_lo // (k // groups)
    blocks = packed.reshape(n // 64, k * 32)  # [N/64, K*32]
    folded = blocks[:, : k_lo * 32].clone()  # [N/64, K_lo*32]
    folded[:, : k_hi * 32] |= blocks[:, k_lo * 32 :] << 2
    s_eff, z_eff = s.clone(), (8 - z) * s  # [N, G]
    s_eff[:, g_lo:], z_eff[:, g_lo:] = s[:, g_lo:] / 4, (2 - z[:, g_lo:]) * s[:, g_lo:]  # hi groups hold 4q
    return {"q": folded, "scale": torch.stack([s_eff, z_eff], dim=-1).transpose(0, 1).to(_BF16)}


def _pack_rows(kind: str, n: int) -> int:
    """Rows converted at a time by pack_into: one 64-row block of the int4 packer where it applies."""
    return 64 if kind in ("int4", "int2") and n % 64 == 0 else n


def _pick(spec: QuantSpec, n: int, k: int, g: int, dtype: torch.dtype, device: torch.device, native: bool) -> str:
    """The CPU kernel format when the precision, dtype, device and shape allow it (the native decode
    kernels' formats first when `native`), else "generic"."""
    if device.type != "cpu" or dtype != _BF16:
        return "generic"  # CUDA: generic only, unverified on GPU (no device here)
    if native and k % decode.QBLOCK == 0 and g % decode.QBLOCK == 0 and (spec.bits != 2 or k % 128 == 0):
        return f"n{spec.bits}"
    aten = torch.ops.aten
    if spec.precision is Precision.INT8:
        ok = g == k and k % 16 == 0 and hasattr(aten, "_weight_int8pack_mm")
        return "int8" if ok else "generic"
    if spec.precision is Precision.INT4:
        ok = n % 16 == 0 and g in KERNEL_GROUPS and hasattr(aten, "_weight_int4pack_mm_for_cpu")
        return "int4" if ok else "generic"
    ok = n % 64 == 0 and g in KERNEL_GROUPS and k // g >= 2 and _int2_layout_ok()
    return "int2" if ok else "generic"


# --------------------------------------------------------------------------- matmuls


def _int8_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    if x.data_ptr() % 32:  # aligned 32-byte loads of x rows (K % 16 == 0 keeps later rows aligned)
        x = x.clone()
    y = torch.ops.aten._weight_int8pack_mm(x, w.q, w.scale)  # [M, N] = x @ ((q - 128) * s).T
    assert w.zero is not None
    return y.addcmul_(x.sum(-1, keepdim=True), w.zero, value=-1)  # - sum_k x * s * (zero - 128)


def _int4_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.q, w.group, w.scale)  # [M, N]


def _gg_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    """Rows of a GGUF block type by ggml's dot product (the native kernels' kind w.bits)."""
    return decode.gemv(x, w.q, None, None, w.bits, 0)  # [M, N]


def _native_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    return decode.gemv(x, w.q, w.scale, w.zero, w.bits, w.group)  # [M, N]


def _f8_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    """fp8 e4m3fn rows with fp32 scales per group (kernels/fp8.py): the native kernel (kind 9)."""
    return decode.gemv(x, w.q, w.scale, None, decode.KIND_F8, w.group)  # [M, N]


def _int2_mm(x: torch.Tensor, w: QLinearWeight) -> torch.Tensor:
    sc = w.scratch
    assert sc is not None
    if sc.pair is not None:  # one op: [N/64, 1, K_lo*32] & [1, 2, 1] -> [N/64, 2, K_lo*32]
        torch.bitwise_and(w.q.unsqueeze(1), _MASKS, out=sc.pair)
    else:  # G odd: the last lo group has no hi partner
        torch.bitwise_and(w.q, 0x33, out=sc.lo)
        torch.bitwise_and(w.q[:, : sc.hi_bytes], 0xCC, out=sc.hi)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, sc.packed, w.group, w.scale)  # [M, N]


_KERNELS: dict[str, Callable[[torch.Tensor, QLinearWeight], torch.Tensor]] = {
    "int8": _int8_mm,
    "int4": _int4_mm,
    "int2": _int2_mm,
    "n8": _native_mm,
    "n4": _native_mm,
    "n2": _native_mm,
    "f8": _f8_mm,
    "gg": _gg_mm,
}


def linear(
    x: torch.Tensor, w: torch.Tensor | QLinearWeight | StoredWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N]: matmul.linear (F.linear's math, kernel chosen per call) for a plain
    weight, the format's kernel for a QLinearWeight, a per-call decode for a StoredWeight. Kernel formats
    compute in bf16 (another x dtype is converted there and back)."""
    if isinstance(w, torch.Tensor):
        return matmul.linear(x, w, bias)
    if isinstance(w, StoredWeight):
        return matmul.linear(x, w.decode(x.dtype), bias)
    if w.kind == "generic":  # unverified on GPU (no CUDA device here)
        wd = torch.empty((w.n, w.k), dtype=x.dtype, device=x.device)  # [N, K]
        assert w.zero is not None and w.scale is not None
        return matmul.linear(x, dequantize_into(w.q, w.scale, w.zero, w.bits, wd), bias)
    if w.kind == "gg-decode":  # ggml blocks without ggml's kernels: gguf-py's decoder per call
        assert w.gtype is not None
        return matmul.linear(x, quant_ggml.dequantize_rows(w.q, w.gtype, w.k, x.dtype), bias)
    if x.shape[-1] != w.k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the {w.kind} weight [{w.n}, {w.k}] wants {w.k}")
    x2 = x.reshape(-1, w.k)  # [M, K]
    xb = x2 if x2.dtype == _BF16 else x2.to(_BF16)
    y = _KERNELS[w.kind](xb if xb.is_contiguous() else xb.contiguous(), w)  # [M, N] bf16
    if bias is not None:
        y.add_(bias)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.n)


# --------------------------------------------------------------------------- expert format


class ExpertFormat:
    """The byte layout of one quantised expert in a pool slot, and the conversion into it."""

    def __init__(
        self,
        layout: ExpertLayout,
        spec: QuantSpec,
        dtype: torch.dtype,
        device: torch.device,
        *,
        kernels: bool = True,
        native: bool = False,
        scale_dtype: torch.dtype = _BF16,
    ) -> None:
        """`kernels=False` forces the generic format (tests, benchmarks); so does a layout with down rows,
        whose canonical q/scale/zero rows the sparse kernel reads directly. `native` (the decode kernels
        are loaded, kernels/decode.py) picks their formats where the shapes allow. `scale_dtype` float16: the
        native formats keep a quantized checkpoint's own fp16 scales (store/source.py StoredIntSource)."""
        self.layout, self.spec, self.dtype, self.device = layout, spec, dtype, device
        h, i = layout.hidden, layout.inter
        self.shapes = {"w13": (2 * i, h), "w2": (i, h) if layout.down_rows else (h, i)}  # matrix -> (N, K)
        kernels = kernels and not layout.down_rows  # sparse execution reads the canonical rows (kernels/sparse.py)
        self.groups: dict[str, int] = {}
        self.kinds: dict[str, str] = {}  # matrix -> compute format
        self.slices: dict[str, dict[str, Slice]] = {}  # matrix (or "bias") -> piece -> slice
        self._scratch: dict[tuple[int, int, int], _Int2Scratch] = {}
        off = 0
        groups = {m: resolve_group(spec, k, shape=(n, k)) for m, (n, k) in self.shapes.items()}
        ggml_native = native and kernels  # a ggml block precision: ggml's dot products through the native kernels
        # native formats for both matrices or neither: the native executor reads an expert in one format
        native = native and all(
            _pick(spec, n, k, groups[m], dtype, device, True) in NATIVE_KINDS for m, (n, k) in self.shapes.items()
        )
        # a ggml block precision: each matrix's GGUF type, and its kernel kind where ggml computes both matrices
        self.gtypes: dict[str, str] = {}
        self.gkinds: dict[str, int] = {}
        if spec.ggml:
            if layout.down_rows:
                expert_tensor_specs(layout, spec, dtype)  # refuses, naming the layouts sparse execution reads
            self.gtypes = quant_ggml.matrix_types(spec.precision, layout)
            lib = decode.loaded() if ggml_native and device.type == "cpu" and dtype == _BF16 else None
            found = {m: ggml.kind_of(t, lib) if lib is not None else None for m, t in self.gtypes.items()}
            self.gkinds = {m: kk for m, kk in found.items() if kk is not None}
        for m, (n, k) in self.shapes.items():
            g = groups[m]
            kind = _pick(spec, n, k, g, dtype, device, native) if kernels else "generic"
            if spec.ggml:
                kind = "gg" if len(self.gkinds) == len(self.shapes) else "gg-decode"
            self.groups[m], self.kinds[m], self.slices[m] = g, kind, {}
            for piece, (dt, shape) in _pieces(kind, n, k, g, spec.bits, self.gtypes.get(m)).items():
                if piece == "scale" and kind in NATIVE_KINDS:
                    dt = scale_dtype
                self.slices[m][piece] = sl = Slice(align(off), dt, shape)
                off = sl.offset + sl.nbytes
            if kind == "int2" and (n, k, g) not in self._scratch:
                self._scratch[(n, k, g)] = _Int2Scratch(n, k, g)
        self.slices["bias"] = {}
        if layout.has_bias:
            for piece, shape in (("b13", (2 * i,)), ("b2", (h,))):
                self.slices["bias"][piece] = sl = Slice(align(off), dtype, shape)
                off = sl.offset + sl.nbytes
        self.slot_bytes = align(off)
        # transient memory, for budgets: pack_into's temporaries (peak, one matrix at a time) and
        # the int2 unfold buffers that each computing thread allocates once
        self.pack_scratch_bytes = max(self._pack_temp_bytes(m) for m in self.shapes)
        self.compute_scratch_bytes = sum(n * k // 2 for n, k, _ in self._scratch)
        self.canonical = expert_tensor_specs(layout, spec, dtype)

    def _pack_temp_bytes(self, m: str) -> int:
        """Upper bound of the bytes pack_into allocates while converting matrix `m` (see _convert)."""
        (n, k), g, kind = self.shapes[m], self.groups[m], self.kinds[m]
        if kind in ("gg", "gg-decode"):
            return 0  # the tier's bytes are the slot's: copied as they are
        if kind in NATIVE_KINDS:
            return 2 * n * k  # unpacked values and the re-packed copy
        if kind == "int8":
            return n * k + 64 * n  # xor result; fp32 scale and offset rows
        if kind in ("int4", "int2"):
            rows = _pack_rows(kind, n)  # converted a block of rows at a time
            return 6 * rows * k + 48 * rows * (k // g)  # unpacked uint8 + int32 q + packer output; fp32 [N, G]
        canonical = n * k * self.spec.bits // 8 + 4 * n * (k // g)
        return canonical if self.device.type != "cpu" else 0  # a host -> device copy of the canonical tensors

    def views(self, row: torch.Tensor) -> QExpertViews:
        """row: uint8 [slot_bytes], a pool slot (64-byte aligned) -> views of its pieces (no copy)."""
        check_row(row, self.slot_bytes)
        if row.data_ptr() % ALIGN:
            raise ValueError(f"slot row at address {row.data_ptr():#x} is not {ALIGN}-byte aligned")
        if row.device.type != self.device.type:
            raise ValueError(f"slot row is on {row.device}, the format is for {self.device}")
        mats = {}
        for m, (n, k) in self.shapes.items():
            p = {piece: slice_view(row, sl) for piece, sl in self.slices[m].items()}
            mats[m] = QLinearWeight(
                kind=self.kinds[m],
                n=n,
                k=k,
                group=self.groups[m],
                bits=self.gkinds.get(m, 0) if self.spec.ggml else self.spec.bits,
                q=p["q"],
                scale=p.get("scale"),
                zero=p.get("zero"),
                scratch=self._scratch.get((n, k, self.groups[m])),
                gtype=self.gtypes.get(m),
            )
        bias = {piece: slice_view(row, sl) for piece, sl in self.slices["bias"].items()}
        return QExpertViews(w13=mats["w13"], w2=mats["w2"], b13=bias.get("b13"), b2=bias.get("b2"), row=row)

    def pack_into(self, canonical: dict[str, torch.Tensor], views: QExpertViews) -> None:
        """Canonical quantised expert (quant.quantize_expert) -> the slot's compute format, written into
        the slot's existing memory. May allocate temporaries (runs on a mover thread)."""
        for name, (dt, shape) in self.canonical.items():
            t = canonical.get(name)
            if t is None:
                raise CheckpointError(f"quantised expert lacks tensor {name!r}; got {sorted(canonical)}")
            matrix = name.split(".")[0]
            if tuple(t.shape) != shape or (t.dtype != dt and matrix in self.groups):
                where = f" ({self.spec.precision.value}, g={self.groups[matrix]})" if matrix in self.groups else ""
                raise CheckpointError(
                    f"quantised tensor {name!r} is {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}{where}"
                )
        for m, w in (("w13", views.w13), ("w2", views.w2)):
            if self.spec.ggml:  # the tier's rows of blocks are the slot's
                w.q.copy_(canonical[f"{m}.q"])
                continue
            q, scale, zero = (canonical[f"{m}.{p}"].to(self.device) for p in ("q", "scale", "zero"))
            kind, n = self.kinds[m], w.n
            rows = _pack_rows(kind, n)
            for r in range(0, n, rows):  # the int4 packer's layout is per 64-row block: convert block by block
                sl = slice(r, r + rows)  # so the temporaries stay a block's worth, not a matrix's
                for piece, t in _convert(kind, q[sl], scale[sl], zero[sl], w.k, w.bits).items():
                    dst = getattr(w, piece)
                    if rows == n:
                        dst.copy_(t.reshape(dst.shape))
                    elif piece == "scale":  # [G, N, 2]
                        dst[:, sl].copy_(t)
                    else:  # int4 [N, K/2], int2 [N/64, K_lo*32]: rows of whole 64-row blocks
                        per = n // dst.shape[0]
                        dst[r // per : (r + rows) // per].copy_(t.reshape(rows // per, -1))
        for piece, dst in (("b13", views.b13), ("b2", views.b2)):
            if dst is not None:
                dst.copy_(canonical[piece])
