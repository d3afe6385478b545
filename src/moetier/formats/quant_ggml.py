"""ggml's block formats as quantized tiers: which GGUF type a matrix takes, quantising and decoding its rows.

`moetier quantize --precisions q4_k` (and q6_k, q5_k, iq4_xs, q3_k, q2_k: types.GGML_PRECISIONS) writes every
routed expert's matrices as rows of that GGUF block type, quantised by ggml's own quantiser (kernels/ggml.py
`quantize`: `ggml_quantize_chunk`, what llama-quantize runs, without an importance matrix). A tier's canonical
tensors are then one uint8 [N, row bytes] per matrix (`w13.q`, `w2.q`), the blocks as a GGUF file stores them: the
slot holds them unchanged and ggml's dot products compute them (kernels/qformat.py kind "gg"), the same kernels
that compute a GGUF file's experts as stored.

A matrix whose rows (its K) are not a whole number of the type's blocks takes llama-quantize's fallback type
(`FALLBACK`: a K-quant's super-block is 256 values; the fallbacks' blocks are 32), as a GGUF file of the model
would; `block_type` refuses a K neither tiles.

Invariants: rows are quantised independently of each other (ggml quantises block by block, no importance matrix),
so quantising several experts stacked gives each expert's bytes alone; `dequantize_rows` is gguf-py's reference
decoder, exact to the type's definition, and `quantize_rows` refuses (ConfigError naming why) where ggml is not
available rather than writing another format under the type's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from moetier.errors import ConfigError
from moetier.formats.codecs_gguf import dequantize as dequantize_gguf
from moetier.formats.layout import ExpertLayout
from moetier.kernels import ggml
from moetier.types import GGML_PRECISIONS, Precision

# llama-quantize's type for a matrix whose rows are not whole 256-value super-blocks (llama_tensor_get_type)
FALLBACK: Mapping[str, str] = MappingProxyType({
    "Q6_K": "Q8_0", "Q5_K": "Q5_1", "Q4_K": "Q5_0", "IQ4_XS": "IQ4_NL", "Q3_K": "IQ4_NL", "Q2_K": "IQ4_NL",
})  # fmt: skip
ROWS = 512  # rows quantised at a time: bounded fp32 temporaries, and chunks enough to share among the threads


def is_ggml(precision: Precision | str) -> bool:
    return str(precision) in GGML_PRECISIONS


def base_type(precision: Precision | str) -> str:
    """The GGUF type name of a ggml block precision ("q4_k" -> "Q4_K")."""
    return GGML_PRECISIONS[str(precision)][0]


def block_type(precision: Precision | str, k: int, shape: tuple[int, int] | None = None) -> str:
    """The GGUF type a matrix with K = `k` takes at `precision`: its own where its blocks tile K, else
    llama-quantize's fallback; ConfigError when neither does."""
    base = base_type(precision)
    for name in (base, FALLBACK[base]):
        if k > 0 and k % ggml.block_of(name) == 0:
            return name
    what = f"a matrix of shape {list(shape)}" if shape is not None else f"a matrix with K={k} in features"
    raise ConfigError(
        f"cannot quantize {what} to {precision}: its rows are not whole blocks of {base} "
        f"({ggml.block_of(base)} values) nor of its fallback {FALLBACK[base]} ({ggml.block_of(FALLBACK[base])})"
    )


def matrix_types(precision: Precision | str, layout: ExpertLayout) -> dict[str, str]:
    """The GGUF type each matrix of an expert takes at `precision`: w13 [2I, H] has rows of H, w2 [H, I] rows of I."""
    h, i = layout.hidden, layout.inter
    return {"w13": block_type(precision, h, (2 * i, h)), "w2": block_type(precision, i, (h, i))}


def row_bytes(precision: Precision | str, k: int) -> int:
    """Bytes of one row of K values at `precision` (in the type `block_type` gives)."""
    return ggml.row_bytes(block_type(precision, k), k)


def quantize_rows(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """w [N, K] (any float dtype) -> uint8 [N, row bytes] of `type_name`'s blocks by ggml's quantiser."""
    q = ggml.quantize(type_name, w, ROWS)
    if q is None:
        why = ggml.load_error() or f"ggml cannot quantize {type_name} rows of {w.shape[-1]} values without an imatrix"
        raise ConfigError(f"cannot write {type_name} blocks: {why}")
    return q


def dequantize_rows(q: torch.Tensor, type_name: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, row bytes] of `type_name` -> [N, K] in `dtype` (gguf-py's reference decoder)."""
    return dequantize_gguf(q.cpu(), type_name, (q.shape[0], k)).to(device=q.device, dtype=dtype)


def quantize_stack(w: torch.Tensor, precision: Precision | str) -> tuple[list[torch.Tensor], float]:
    """w [B, N, K], one matrix per expert -> (B uint8 [N, row bytes], each what quantize_rows gives for that
    expert alone, and the total squared error ||W - dequantize||^2 measured on the written blocks)."""
    b, n, k = w.shape
    t = block_type(precision, k, shape=(n, k))
    flat = w.reshape(b * n, k)  # [B * N, K]
    q = quantize_rows(flat, t)  # [B * N, row bytes]
    sq = 0.0
    for r in range(0, b * n, ROWS):
        d = dequantize_rows(q[r : r + ROWS], t, k)  # [rows, K] fp32
        sq += float(torch.linalg.vector_norm(d - flat[r : r + ROWS].float())) ** 2
    rows = q.view(b, n, -1)
    return [rows[e] for e in range(b)], sq


__all__ = ["FALLBACK", "base_type", "block_type", "dequantize_rows", "is_ggml", "matrix_types", "quantize_rows",
           "quantize_stack", "row_bytes"]  # fmt: skip
