"""Encoded tensors: a checkpoint tensor stored in a quantised form, and the codecs that decode it.

A quantised checkpoint stores one logical tensor (what transformers' model holds, e.g. an
expert's `gate_proj.weight` [I, H]) as several stored tensors: FP8 weights plus a block scale
grid, MXFP4 blocks plus E8M0 scales, GPTQ's packed int32 words plus zeros and scales, one GGUF
block array. `formats/checkpoint.py` indexes such a tensor as one `TensorLocation` whose `dtype`
is the codec's name (a key of `CODECS`) and whose `parts` are the stored tensors it decodes
from, in the codec's order; its `shape` is the logical shape.

A codec is a pure function of the parts' bytes: `decode(parts, shape) -> float32 [shape]`,
where `parts[i]` is the stored tensor `i` viewed in its stored dtype and shape (for one expert
of a fused tensor, the expert's slice). Validation of shapes, block sizes and scale grids
happens once when the index is built, so `decode` assumes consistent parts.

Registry: `CODECS` (formats/codecs.py) maps a codec name to its `Codec`; the quantised
safetensors methods live in formats/codecs_quant.py, the GGUF block types in
formats/codecs_gguf.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Decode = Callable[[list[torch.Tensor], tuple[int, ...]], torch.Tensor]  # parts, logical shape -> fp32 [shape]


@dataclass(frozen=True)
class Codec:
    name: str  # the TensorLocation.dtype of tensors it decodes, e.g. "fp8_block", "mxfp4", "gguf:Q4_K"
    decode: Decode
    bits: float  # stored bits per logical weight, scales included (for sizes and budgets in the docs)
