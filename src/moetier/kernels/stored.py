"""Stored-form slots: an expert kept in its pool slot as the checkpoint stores it ("stored" precision).

Stored form ("stored" precision, `StoredFormat`): the slot keeps one expert's tensors exactly as the
checkpoint stores them (FP8 + block scales, MXFP4 blocks + scales, GPTQ words + zeros + scales, or plain
bf16 / fp32), each stored part on a 64-byte boundary, then the biases in the model dtype. Its views are
`StoredWeight`s of kind "stored": `linear` decodes each segment with its codec (formats/codecs.py), applies
the family op (gate and up may be separate stored tensors, or one interleaved tensor) into the rows of a
temporary [N, K] in x's dtype, then matmul.linear. Sparse execution (down rows) is not offered for it.

Two refinements on that layout:
- GGUF Q4_0 / Q8_0 matrices our own kernels read (`relay`): after each read the matrix's blocks are split in
  place into all their quants, then their fp16 scales, in the same bytes (`StoredWeight.relay`); the descriptor
  gives the kernels kind | MT_SF16 (kernels/step.py), and `decode` puts the blocks back together for the codec.
- MXFP4 matrices (GPT-OSS's safetensors `*_blocks` + `*_scales`, one tensor a matrix, or a GGUF file's MXFP4 rows):
  after each read they are re-laid in place for our kernels' kind 4 | MT_FP4 (csrc/mm.h): the quants [N, K / 2]
  (element j in the low and j + 16 in the high nibble of byte j of a block, where the safetensors file holds 2j low
  and 2j + 1 high), then each block's e8m0 exponent byte e as stored, uint8 [N, K / 32] (the kernels widen it to
  2^(e - 128), exact: their values are the e2m1 values doubled), rows in the matrix's order (GPT-OSS interleaves
  gate and up rows: gate first after the relay). The slot keeps the file's 17 bytes a block of 32, so the budget
  counts the stored bytes.
- A checkpoint whose MoE layers store their experts differently (a Q4_K_M GGUF file) gets `MixedStoredFormat`:
  one StoredFormat per layout on slots of the largest, each slot read as `StoredVariants`; whoever knows the
  layer takes its variant (`for_layer`).
GPTQ / AWQ / compressed-tensors int4 experts computed as stored go elsewhere: into the native int4 slots of
kernels/qformat.py ExpertFormat (store/source.py StoredIntSource).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from moetier.errors import CheckpointError, ConfigError
from moetier.formats.codecs_gguf import dequantize as dequantize_gguf
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import StoredTensor, apply_op, decode_stored
from moetier.kernels.decode import FP4_VALUES
from moetier.kernels.slots import Slice, align, check_row, slice_view


@dataclass(eq=False)
class StoredSegment:
    """One stored checkpoint tensor inside a stored-form slot, and the rows of its matrix it fills."""

    tensor: StoredTensor
    parts: list[torch.Tensor]  # views of the slot, each part in its stored dtype and shape
    rows: tuple[tuple[str, int, int], ...]  # (family op, first row, end row) per piece it feeds


@dataclass(eq=False)
class StoredWeight:
    """One matrix of a stored-form slot (kind "stored"): its segments decode into its [N, K] rows."""

    kind: str  # "stored"
    n: int
    k: int
    segments: tuple[StoredSegment, ...]
    # a GGUF Q4_0 / Q8_0 matrix our own kernels read (decode.OWN_KERNEL_TYPES): its type, and the slot bytes of
    # its rows, re-laid out in place after each read as [quants of every block][their fp16 scales] (`relay`);
    # "MXFP4": an MXFP4 matrix re-laid as quants then e8m0 exponent bytes for kind 4 | MT_FP4 (`mxfp4_relay`)
    relaid: str | None = None
    region: torch.Tensor | None = None  # uint8 [N * row bytes]

    def relay(self) -> None:
        """The matrix's blocks, as read, -> [quants][fp16 scales] in the same bytes (kernels: kind | MT_SF16); an
        MXFP4 matrix -> [quants][e8m0 exponent bytes] (kernels: 4 | MT_FP4, `mxfp4_relay`)."""
        assert self.relaid is not None and self.region is not None
        if self.relaid == "MXFP4":
            self.mxfp4_relay()
            return
        blocks = self.region.view(self.n, -1, _block_bytes(self.relaid)).clone()  # [N, nb, 2 + qb]
        q, d = self.relay_split()
        q.copy_(blocks[:, :, 2:].reshape(q.shape))
        d.copy_(blocks[:, :, :2].reshape(-1))

    def mxfp4_relay(self) -> None:
        """The file's MXFP4 blocks [R, G, 16] and exponents [R, G] (one segment), or GGUF MXFP4 rows [R, G, 17] (an
        exponent byte, then 16 of quants, a block) -> quants [N, G * 16] then the exponent bytes [N, G] from the start
        of the region, rows in the matrix's order (an interleaved gate/up tensor: even rows first)."""
        q, s = self.mxfp4_split()
        if all(seg.tensor.codec == "gguf:MXFP4" for seg in self.segments):  # GGUF rows: exponent byte, then qs
            segs = sorted(self.segments, key=lambda seg: seg.rows[0][1])
            raw = torch.cat([seg.parts[0].reshape(-1) for seg in segs]).view(self.n, -1, 17)  # a copy: [N, G, 17]
            q.copy_(raw[..., 1:].reshape(q.shape))  # ggml's nibble order is the kernel's
            s.copy_(raw[..., 0].reshape(s.shape))
            return
        (seg,) = self.segments
        blocks, scales = (p.clone() for p in seg.parts)  # [R, G, 16], [R, G]: the region overlaps them
        if seg.rows[0][0] == "T_even":  # GPT-OSS's gate_up: gate rows are the even ones, up the odd
            order = torch.cat([torch.arange(0, self.n, 2), torch.arange(1, self.n, 2)])
            blocks, scales = blocks[order], scales[order]
        nib = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [N, G, 32]: element order
        q.copy_((nib[..., :16] | (nib[..., 16:] << 4)).reshape(q.shape))  # byte j: elements j and j + 16
        s.copy_(scales.reshape(s.shape))

    def mxfp4_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(quants uint8 [N, K / 2], e8m0 exponent bytes uint8 [N, K / 32]): views of a re-laid MXFP4 matrix's
        region."""
        assert self.region is not None
        nq = self.n * self.k // 2
        return self.region[:nq].view(self.n, -1), self.region[nq : nq + self.n * self.k // 32].view(self.n, -1)

    def relay_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(quants uint8 [N, nb * qb], scale bytes uint8 [N * nb * 2]): views of a re-laid matrix's region."""
        assert self.relaid is not None and self.region is not None
        qb = _block_bytes(self.relaid) - 2
        nq = self.n * (self.k // 32) * qb
        return self.region[:nq].view(self.n, -1), self.region[nq:]

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix [N, K] in `dtype` (allocated per call; the codecs' float32 temporaries are transient)."""
        device = self.segments[0].parts[0].device
        if self.relaid == "MXFP4":  # quants and exponent bytes now, rows in the matrix's order
            q, e = self.mxfp4_split()
            blk = q.view(self.n, -1, 16)  # [N, G, 16]
            v = torch.cat([blk & 15, blk >> 4], dim=-1).reshape(self.n, self.k)  # [N, K], element order
            vals = torch.tensor(FP4_VALUES, dtype=torch.float32)[v.long()]  # the e2m1 values doubled
            return (vals * e8m0_scale(e).repeat_interleave(32, dim=1)).to(dtype)
        if self.relaid is not None:  # back to the file's blocks, then its codec
            q, d = self.relay_split()
            blocks = torch.cat([d.view(self.n, -1, 2), q.view(self.n, -1, _block_bytes(self.relaid) - 2)], dim=2)
            return dequantize_gguf(blocks.reshape(-1), self.relaid, (self.n, self.k)).to(dtype)
        out = torch.empty((self.n, self.k), dtype=dtype, device=device)  # [N, K]
        for seg in self.segments:
            src = decode_stored(seg.tensor, seg.parts)  # [seg.tensor.shape], float32 or as stored
            for op, r0, r1 in seg.rows:
                out[r0:r1].copy_(apply_op(src, op))
        return out


@dataclass
class StoredExpertViews:
    w13: StoredWeight  # [2I, H]
    w2: StoredWeight  # [H, I]
    b13: torch.Tensor | None  # [2I], model dtype
    b2: torch.Tensor | None  # [H]
    row: torch.Tensor  # uint8 [slot_bytes], the whole slot
    dests: list[list[torch.Tensor] | None]  # per stored tensor: uint8 views its raw parts are read into, or
    # None for one decoded into `pieces` when read (the biases)
    pieces: dict[str, torch.Tensor]  # gate_bias / up_bias / down_bias views of b13, b2


def e8m0_scale(e: torch.Tensor) -> torch.Tensor:
    """MXFP4 e8m0 exponents (uint8) -> float32 2^(e - 128), the scale of the e2m1 values doubled (exact, as the
    kernels widen them: e = 0 and 1 are float32 subnormals; 255 is NaN)."""
    return torch.exp2(e.double() - 128).masked_fill(e == 255, float("nan")).float()


_MATRIX_ROWS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}  # piece -> (matrix, block of I rows)
RELAID = {"Q4_0": 18, "Q8_0": 34}  # GGUF types a slot re-lays out for our own kernels: bytes a block of 32
MXFP4_BLOCK = 17  # slot bytes of a block of 32 MXFP4 values re-laid for our kernels: 16 of quants, its exponent byte
_MXFP4_ROWS = {"w13": (("T_even", "T_odd"), ("T",)), "w2": (("T",),)}  # the ops a matrix's one MXFP4 tensor may feed


def _block_bytes(type_name: str) -> int:
    return RELAID[type_name]


class StoredFormat:
    """The byte layout of one expert kept as the checkpoint stores it (`tensors`: ExpertReader.stored_tensors),
    plus its biases in the model dtype."""

    def __init__(self, layout: ExpertLayout, tensors: tuple[StoredTensor, ...], dtype: torch.dtype,
                 relay: bool = False) -> None:  # fmt: skip
        """`relay`: GGUF Q4_0 / Q8_0 matrices are re-laid out in their slot bytes after each read, for the native
        kernels (`StoredWeight.relay`)."""
        if layout.down_rows:
            raise ConfigError("the stored precision does not run sparse execution (down rows); use full or a "
                              "quantized tier from `moetier quantize`")  # fmt: skip
        self.layout, self.tensors, self.dtype = layout, tensors, dtype
        h, i = layout.hidden, layout.inter
        self.shapes = {"w13": (2 * i, h), "w2": (h, i)}
        self.part_slices: list[list[Slice] | None] = []
        self.rows: list[tuple[str, tuple[tuple[str, int, int], ...]] | None] = []  # per tensor: matrix, rows
        off = 0
        for t in tensors:
            kinds = {piece in _MATRIX_ROWS for piece, _ in t.pieces}
            if kinds == {False}:  # biases: decoded into the bias slices when read
                self.part_slices.append(None)
                self.rows.append(None)
                continue
            if kinds != {True} or len({_MATRIX_ROWS[p][0] for p, _ in t.pieces}) != 1:
                raise CheckpointError(f"stored tensor feeding {[p for p, _ in t.pieces]} mixes matrices and biases")
            slices = []
            for nbytes in t.part_bytes:
                slices.append(Slice(align(off), torch.uint8, (nbytes,)))
                off = slices[-1].offset + nbytes
            self.part_slices.append(slices)
            matrix = _MATRIX_ROWS[t.pieces[0][0]][0]
            size = i if matrix == "w13" else h
            rows = tuple((op, _MATRIX_ROWS[p][1] * size, (_MATRIX_ROWS[p][1] + 1) * size) for p, op in t.pieces)
            self.rows.append((matrix, rows))
        self.bias: dict[str, Slice] = {}
        if layout.has_bias:
            for piece, shape in (("b13", (2 * i,)), ("b2", (h,))):
                self.bias[piece] = sl = Slice(align(off), dtype, shape)
                off = sl.offset + sl.nbytes
        self.slot_bytes = align(off)
        self.relaid = self._relaid() if relay else {}  # matrix -> (GGUF type, first byte, end byte in the slot)
        # per call, per matrix: the decoded [N, K] in x's dtype plus the codec's float32 temporaries
        self.compute_scratch_bytes = max(n * k for n, k in self.shapes.values()) * (dtype.itemsize + 16)

    def _relaid(self) -> dict[str, tuple[str, int, int]]:
        """The matrices kept as one run of GGUF Q4_0 or Q8_0 rows (gate then up adjacent: one [2I, H] matrix), and
        those of MXFP4 (one safetensors tensor, or GGUF tensors of rows) re-laid for our kernels (`mxfp4_relay`)."""
        out: dict[str, tuple[str, int, int]] = {}
        for m, (n, k) in self.shapes.items():
            mx = self._mxfp4_span(m, n, k)
            if mx is not None:
                out[m] = ("MXFP4", *mx)
                continue
            spans: list[tuple[int, str | None, int, int]] = []
            for t, slices, rows in zip(self.tensors, self.part_slices, self.rows, strict=True):
                if rows is None or rows[0] != m or slices is None:
                    continue
                if len(slices) != 1 or any(op != "copy" for op, _, _ in rows[1]) or len(rows[1]) != 1:
                    spans = []
                    break
                spans.append((rows[1][0][1], t.codec, slices[0].offset, slices[0].offset + slices[0].nbytes))
            spans.sort()
            codecs = {c for _, c, _, _ in spans}
            if not spans or len(codecs) != 1 or k % 32:
                continue
            codec = next(iter(codecs)) or ""
            name = codec.removeprefix("gguf:")
            nbytes = n * (k // 32) * MXFP4_BLOCK
            if name == "MXFP4" and sum(b - a for _, _, a, b in spans) == nbytes:  # GGUF MXFP4 rows
                lo = min(a for _, _, a, _ in spans)  # re-laid over the rows' own bytes: no other tensor's among them
                others = [sl for sls, rows in zip(self.part_slices, self.rows, strict=True)
                          if sls is not None and rows is not None and rows[0] != m for sl in sls]  # fmt: skip
                if all(sl.offset + sl.nbytes <= lo or sl.offset >= lo + nbytes for sl in others):
                    out[m] = ("MXFP4", lo, lo + nbytes)
                continue
            contiguous = all(a[3] == b[2] for a, b in itertools.pairwise(spans))
            if name in RELAID and contiguous and spans[-1][3] - spans[0][2] == n * (k // 32) * RELAID[name]:
                out[m] = (name, spans[0][2], spans[-1][3])
        return out

    def _mxfp4_span(self, m: str, n: int, k: int) -> tuple[int, int] | None:
        """(first, end byte) of matrix m's region when one MXFP4 safetensors tensor (blocks, then exponents) feeds all
        of it, else None."""
        feeding = [(t, sl, rows) for t, sl, rows in zip(self.tensors, self.part_slices, self.rows, strict=True)
                   if rows is not None and rows[0] == m]  # fmt: skip
        if len(feeding) != 1 or feeding[0][0].codec != "mxfp4" or k % 32:
            return None
        t, slices, (_, rows) = feeding[0]
        if slices is None or len(slices) != 2 or tuple(op for op, _, _ in rows) not in _MXFP4_ROWS[m]:
            return None
        if t.part_bytes != (n * k // 2, n * k // 32):
            return None
        start = slices[0].offset  # the blocks, then (64-byte aligned) the exponents: the file's 17 bytes a block
        return start, start + n * (k // 32) * MXFP4_BLOCK

    def views(self, row: torch.Tensor) -> StoredExpertViews:
        """row: uint8 [slot_bytes], a pool slot (64-byte aligned) -> its views (no copy)."""
        check_row(row, self.slot_bytes)
        dests: list[list[torch.Tensor] | None] = []
        segments: dict[str, list[StoredSegment]] = {"w13": [], "w2": []}
        for t, slices, rows in zip(self.tensors, self.part_slices, self.rows, strict=True):
            if slices is None or rows is None:
                dests.append(None)
                continue
            raw = [slice_view(row, sl) for sl in slices]  # uint8 [part bytes]
            dests.append(raw)
            typed = [r.view(dt).view(shape) for r, (dt, shape) in zip(raw, t.parts, strict=True)]
            segments[rows[0]].append(StoredSegment(t, typed, rows[1]))
        (n13, k13), (n2, k2) = self.shapes["w13"], self.shapes["w2"]
        b13 = slice_view(row, self.bias["b13"]) if "b13" in self.bias else None
        b2 = slice_view(row, self.bias["b2"]) if "b2" in self.bias else None
        i = self.layout.inter
        pieces = {} if b13 is None or b2 is None else {"gate_bias": b13[:i], "up_bias": b13[i:], "down_bias": b2}
        relaid = {m: (name, row[a:b]) for m, (name, a, b) in self.relaid.items()}
        none: tuple[None, None] = (None, None)
        return StoredExpertViews(
            w13=StoredWeight("stored", n13, k13, tuple(segments["w13"]), *relaid.get("w13", none)),
            w2=StoredWeight("stored", n2, k2, tuple(segments["w2"]), *relaid.get("w2", none)),
            b13=b13, b2=b2, row=row, dests=dests, pieces=pieces,
        )  # fmt: skip


@dataclass(eq=False)
class StoredVariants:
    """One slot of a pool whose MoE layers store their experts differently (a Q4_K_M GGUF file: Q4_K down
    projections in some layers, Q6_K in others): the slot read as each layout; `for_layer` gives the views of the
    layout a layer's experts are stored in. The store hands these out as they are; whoever knows the layer (the
    source reading an expert in, the executors computing one) takes its variant."""

    row: torch.Tensor  # uint8 [slot_bytes], the whole slot
    variants: list[StoredExpertViews]
    of_layer: dict[int, int]

    def for_layer(self, layer: int) -> StoredExpertViews:
        return self.variants[self.of_layer[layer]]


def for_layer(views: Any, layer: int) -> Any:
    """The views of one expert of `layer` in a slot: a mixed stored slot's variant for that layer, else `views`."""
    return views.for_layer(layer) if isinstance(views, StoredVariants) else views


class MixedStoredFormat:
    """Stored-form slots for experts whose layout differs by layer: one StoredFormat per distinct layout on
    slots of the largest's size (the budget counts that), `of_layer` the layout of each MoE layer."""

    def __init__(self, layout: ExpertLayout, layouts: list[tuple[StoredTensor, ...]], of_layer: dict[int, int],
                 dtype: torch.dtype, relay: bool = False) -> None:  # fmt: skip
        self.layout, self.dtype = layout, dtype
        self.formats = [StoredFormat(layout, t, dtype, relay) for t in layouts]
        self.of_layer = dict(of_layer)
        self.slot_bytes = max(f.slot_bytes for f in self.formats)
        self.compute_scratch_bytes = max(f.compute_scratch_bytes for f in self.formats)

    def views(self, row: torch.Tensor) -> StoredVariants:
        check_row(row, self.slot_bytes)
        return StoredVariants(row, [f.views(row[: f.slot_bytes]) for f in self.formats], self.of_layer)
