"""Fixed-slot expert pools: one tensor allocated once, sliced into per-slot views.

`SlotPool` holds full-precision experts (a [S, numel] tensor of the model dtype);
`QuantPool` holds quantized ones (a [S, slot_bytes] uint8 tensor whose rows the
precision's ExpertFormat views as packed weights and scales); `StoredPool` holds experts as
the checkpoint stores them (uint8 rows a StoredFormat views as raw parts). A pool never allocates
after construction: loading an expert writes into a free slot's existing memory.
Per-slot views (w13, w2, b13, b2 and each named piece) are built once so that the hot
path indexes a Python list rather than slicing tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from moetier.formats.layout import ExpertLayout
from moetier.store import hostmem

if TYPE_CHECKING:
    from moetier.kernels.qformat import QExpertViews
    from moetier.kernels.stored import StoredExpertViews


V = TypeVar("V", covariant=True)


@dataclass
class SlotViews:
    w13: torch.Tensor  # [2I, H]
    w2: torch.Tensor  # [H, I] (a transposed view when the layout stores down rows)
    b13: torch.Tensor | None  # [2I]
    b2: torch.Tensor | None  # [H]
    row: torch.Tensor  # [numel], the whole slot
    pieces: dict[str, torch.Tensor]  # canonical pieces, see ExpertLayout
    down_rows: torch.Tensor | None = None  # [I, H] when the layout stores down rows


class SlotPool:
    def __init__(
        self, layout: ExpertLayout, n_slots: int, dtype: torch.dtype, device: torch.device, pin: bool = False
    ) -> None:
        if n_slots < 1:
            raise ValueError(f"a pool needs at least one slot, got {n_slots}")
        self.layout, self.n_slots, self.dtype, self.device = layout, n_slots, dtype, device
        pin = pin and device.type == "cpu" and torch.cuda.is_available()
        # [S, numel]; host pools on transparent huge pages (store/hostmem.py: decode streams them)
        self.buf = hostmem.empty((n_slots, layout.numel), dtype, device, pin)
        self.slot_bytes = layout.slot_bytes(self.buf.element_size())
        self.nbytes = n_slots * self.slot_bytes
        self.views = [self._views(s) for s in range(n_slots)]

    def _views(self, slot: int) -> SlotViews:
        h, i = self.layout.hidden, self.layout.inter
        row = self.buf[slot]
        pieces = {
            name: row[off : off + _numel(shape)].view(shape) for name, (off, shape) in self.layout.pieces.items()
        }
        b13 = row[3 * i * h : 3 * i * h + 2 * i] if self.layout.has_bias else None
        down = pieces["down"]
        return SlotViews(
            w13=row[: 2 * i * h].view(2 * i, h),
            w2=down.t() if self.layout.down_rows else down,
            b13=b13,
            b2=pieces.get("down_bias"),
            row=row,
            pieces=pieces,
            down_rows=down if self.layout.down_rows else None,
        )


class RowFormat(Protocol[V]):
    """A slot format laid out as one uint8 row per expert.

    Implemented by kernels/qformat.py ExpertFormat and kernels/stored.py StoredFormat.
    """

    slot_bytes: int

    def views(self, row: torch.Tensor) -> V: ...


class RowPool(Generic[V]):
    """Fixed slots of `fmt.slot_bytes` uint8 each, one contiguous buffer; `views[s]` are slot s's pieces."""

    def __init__(self, fmt: RowFormat[V], n_slots: int, device: torch.device, pin: bool = False) -> None:
        if n_slots < 1:
            raise ValueError(f"a pool needs at least one slot, got {n_slots}")
        self.fmt, self.n_slots, self.device = fmt, n_slots, device
        pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.slot_bytes = fmt.slot_bytes
        self.buf = hostmem.empty((n_slots, self.slot_bytes), torch.uint8, device, pin)
        self.nbytes = n_slots * self.slot_bytes
        self.views: list[V] = [fmt.views(self.buf[s]) for s in range(n_slots)]


if TYPE_CHECKING:
    QuantPool = RowPool[QExpertViews]  # quantised experts in their compute format (kernels/qformat.py ExpertFormat)
    StoredPool = RowPool[StoredExpertViews]  # experts as a quantised checkpoint stores them (StoredFormat)
else:
    QuantPool = StoredPool = RowPool


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
