"""Decoder over the transformers modules themselves (every family; the fallback path).

Attention, norms and embeddings are transformers' own; only the MoE blocks are ours.

Invariants: the cache is the one the model itself makes on its first call after `reset` (a DynamicCache, or
the family's own, e.g. hybrid linear-attention or MiniMax caches), fresh after `reset`; logits equal the
reference model's for the same ids (the MoE blocks are exact, everything else is the reference code).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache, PretrainedConfig


class HFDecoder:
    def __init__(self, model: nn.Module, config: PretrainedConfig) -> None:
        self.model, self.config = model, config
        self.cache: Cache | None = None

    def reset(self) -> None:
        self.cache = None  # the model makes its own on the next call

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """ids [1, T] appended to the cache -> logits [T, V] (all) or [1, V] (last)."""
        keep = 0 if all_logits else 1  # transformers: 0 keeps every position
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.cache = out.past_key_values
        return out.logits[0]
