"""FP8 slots: a block-scaled FP8 checkpoint's experts computed as stored (kind "f8", csrc/mm.h kind 9).

DeepSeek-V3 / R1, Qwen3-FP8 and their kin store each expert matrix as e4m3fn bytes [N, K] plus a float32 (or
bf16) scale grid [ceil(N / bn), ceil(K / bk)], one scale per bn x bk block (`fp8_block:{bn}x{bk}`,
formats/codecs_quant.py). `Fp8Format` lays one expert out in a pool slot as:

    w13: q uint8 [2I, H] (gate rows, then up rows) | scale fp32 [2I, H / bk]
    w2:  q uint8 [H, I]                             | scale fp32 [H, I / bk]

each piece on a 64-byte boundary: the checkpoint's bytes as stored, its scale grid with one row per weight row
(row r of a matrix takes grid row r // bn; a ragged last row block is fine), so nothing is rounded. The kernels
(csrc/mm.c `mm_f8`) widen each 32 values to bf16 exactly and accumulate per group in fp32; the slot is 1 byte a
weight plus 4 bytes per bk weights of a row. Column blocks must be whole (K % bk == 0) and bk a multiple of 32:
anything else stays on the per-call decode of kernels/stored.py.
"""

from __future__ import annotations

import torch

from moetier.formats.layout import ExpertLayout
from moetier.kernels.decode import KIND_F8, QDense
from moetier.kernels.qformat import QExpertViews, QLinearWeight
from moetier.kernels.slots import ALIGN, Slice, align, check_row, slice_view

_F32 = torch.float32


def fits_fp8(n: int, k: int, bk: int) -> bool:
    """Whether an [N, K] matrix of column blocks bk fits the kernel: whole blocks, groups of 32s."""
    return n > 0 and bk > 0 and bk % 32 == 0 and k % bk == 0


class Fp8Format:
    """The byte layout of one FP8 expert in a pool slot (see the module docstring). `bk`: the checkpoint's column
    block (the kernels' group)."""

    def __init__(self, layout: ExpertLayout, bk: int) -> None:
        if layout.has_bias or layout.down_rows:
            raise ValueError("fp8 slots hold bias-free experts in the gate/up + down layout")
        h, i = layout.hidden, layout.inter
        self.layout, self.group = layout, bk
        self.shapes = {"w13": (2 * i, h), "w2": (h, i)}  # matrix -> (N, K)
        for m, (n, k) in self.shapes.items():
            if not fits_fp8(n, k, bk):
                raise ValueError(f"fp8 {m} [{n}, {k}] with column blocks of {bk} does not fit the kernels")
        self.slices: dict[str, dict[str, Slice]] = {}
        off = 0
        for m, (n, k) in self.shapes.items():
            q = Slice(align(off), torch.uint8, (n, k))
            s = Slice(align(q.offset + q.nbytes), _F32, (n, k // bk))
            self.slices[m] = {"q": q, "scale": s}
            off = s.offset + s.nbytes
        self.slot_bytes = align(off)

    def views(self, row: torch.Tensor) -> QExpertViews:
        """row: uint8 [slot_bytes], a pool slot (64-byte aligned) -> views of its pieces (no copy)."""
        check_row(row, self.slot_bytes)
        if row.data_ptr() % ALIGN:
            raise ValueError(f"slot row at address {row.data_ptr():#x} is not {ALIGN}-byte aligned")
        mats = {
            m: QLinearWeight("f8", n, k, self.group, 8, slice_view(row, self.slices[m]["q"]),
                             slice_view(row, self.slices[m]["scale"]), None)
            for m, (n, k) in self.shapes.items()
        }  # fmt: skip
        return QExpertViews(mats["w13"], mats["w2"], None, None, row)


def fp8_dense(weight: torch.Tensor, grid: torch.Tensor, bn: int, bk: int) -> QDense | None:
    """A block-scaled FP8 dense matrix (an attention projection): weight e4m3fn (or its uint8 bytes) [N, K] as
    stored, scale grid [ceil(N / bn), K / bk] -> a QDense of kind 9 the kernels compute as stored (the bytes as
    they are, the grid fp32 with one row per weight row), or None where the blocks do not fit the kernel."""
    n, k = weight.shape
    if not fits_fp8(n, k, bk) or grid.shape[1] != k // bk:
        return None
    q = weight.contiguous().view(torch.uint8)
    scale = grid.float().repeat_interleave(bn, dim=0)[:n].contiguous()  # [N, K / bk]
    return QDense(KIND_F8, n, k, q, scale, None, bk)


def fill(w: QLinearWeight, r0: int, weight: torch.Tensor, grid: torch.Tensor, bn: int) -> None:
    """Rows [r0, r0 + N) of slot matrix `w` from one stored FP8 tensor: weight uint8 (or float8) [N, K] as stored,
    its scale grid [ceil(N / bn), K / bk] (fp32 or bf16: widened exactly) expanded to one row per weight row."""
    n = weight.shape[0]
    assert w.scale is not None
    w.q[r0 : r0 + n].copy_(weight.view(torch.uint8))
    w.scale[r0 : r0 + n].copy_(grid.float().repeat_interleave(bn, dim=0)[:n])  # [N, K / bk]
