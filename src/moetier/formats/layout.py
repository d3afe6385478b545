"""Canonical byte layout of one expert inside a pool slot (all pieces contiguous).

    [ gate (I*H) | up (I*H) | down (H*I) | gate_bias (I) | up_bias (I) | down_bias (H) ]
       \\_____ w13 [2I, H] ___/   w2 [H, I]     \\____ b13 [2I] ____/     b2 [H]

Biases are present only for families that have them. With `down_rows` (sparse execution,
kernels/sparse.py) the down projection is stored transposed, as rows [I, H], so that each
neuron's gate, up and down weights are contiguous rows of H. Every slot of every pool of a
store uses one layout, so a tier-to-tier move is one contiguous copy of `numel` elements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    hidden: int
    inter: int
    has_bias: bool
    down_rows: bool = False  # down stored as [I, H] (its transpose) instead of [H, I]

    @property
    def pieces(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """piece name -> (element offset in the slot, canonical shape)."""
        h, i = self.hidden, self.inter
        out: dict[str, tuple[int, tuple[int, ...]]] = {
            "gate": (0, (i, h)),
            "up": (i * h, (i, h)),
            "down": (2 * i * h, (i, h) if self.down_rows else (h, i)),
        }
        if self.has_bias:
            base = 3 * i * h
            out |= {"gate_bias": (base, (i,)), "up_bias": (base + i, (i,)), "down_bias": (base + 2 * i, (h,))}
        return out

    def as_dict(self) -> dict[str, int | bool]:
        """As recorded in quantized tiers' manifests (down_rows only when set, so older tiers still match)."""
        out: dict[str, int | bool] = {"hidden": self.hidden, "inter": self.inter, "has_bias": self.has_bias}
        return out | ({"down_rows": True} if self.down_rows else {})

    @property
    def numel(self) -> int:
        h, i = self.hidden, self.inter
        return 3 * i * h + ((2 * i + h) if self.has_bias else 0)

    def slot_bytes(self, itemsize: int) -> int:
        return self.numel * itemsize


@dataclass(frozen=True)
class ExpertSource:
    tensor: str  # relative to the checkpoint's MoE block prefix; `{e}` marks a per-expert tensor
    op: str = "copy"

    @property
    def fused(self) -> bool:
        return "{e}" not in self.tensor
