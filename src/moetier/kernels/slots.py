"""Pool slot rows and the pieces laid out in them: the byte layout helpers the slot formats share.

A quantised or stored expert lives in one pool slot, a contiguous uint8 row (store/pool.py RowPool); its format
(kernels/qformat.py ExpertFormat, kernels/stored.py StoredFormat) places each piece at a 64-byte aligned offset
and views it in place with `slice_view`: no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 64  # every piece of a slot starts on this boundary; slot sizes are multiples of it


@dataclass(frozen=True)
class Slice:
    """One piece of a slot: where it starts, its dtype and shape."""

    offset: int  # bytes from the start of the slot
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def slice_view(row: torch.Tensor, sl: Slice) -> torch.Tensor:
    """A slot row's bytes of `sl`, viewed as its dtype and shape (no copy)."""
    return row[sl.offset : sl.offset + sl.nbytes].view(sl.dtype).view(sl.shape)


def check_row(row: torch.Tensor, slot_bytes: int) -> None:
    """ValueError unless `row` is a contiguous uint8 slot row of `slot_bytes`."""
    if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() != slot_bytes or not row.is_contiguous():
        raise ValueError(
            f"a slot row must be a contiguous uint8 [{slot_bytes}] tensor, got {row.dtype} {list(row.shape)}"
        )


def align(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN
