"""GGUF block decoders (formats/codecs_gguf.py) against the numpy reference `gguf.quants.dequantize`, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moetier.formats.codecs_gguf import BLOCK_SIZES, GGUF_CODECS, NUMPY_DECODED
from moetier.formats.codecs_quant import QUANT_CODECS

# byte offsets of each block type's fp16 scales (random bytes there could be inf / nan, whose payloads
# numpy and torch need not agree on)
FP16_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_S": (0,), "IQ2_XS": (0,), "IQ2_XXS": (0,), "IQ1_S": (0,),
               "IQ1_M": (), "MXFP4": ()}  # fmt: skip


def random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks_per_row * type_size]: random quants, finite random fp16 scales (and finite F16/BF16)."""
    _block, size = BLOCK_SIZES[type_name]
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        vals = rng.normal(0, 3, (rows, blocks_per_row)).astype(np.float32)
        if type_name == "F16":
            return vals.astype(np.float16).view(np.uint8)
        if type_name == "BF16":
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    if type_name == "MXFP4":  # the block's e8m0 exponent byte: 255 is NaN
        raw[:, 0] = rng.integers(110, 130, len(raw))
    if type_name == "IQ1_M":  # its fp16 scale is spread over the top nibbles of the last 4 bytes: keep them finite
        raw[:, -4:] &= 0x3F
    for off in FP16_SCALES[type_name]:
        raw[:, off : off + 2] = rng.normal(0, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("type_name", sorted(set(BLOCK_SIZES) - set(NUMPY_DECODED)))
def test_decode_is_bit_exact_against_numpy_reference(type_name):
    block, _ = BLOCK_SIZES[type_name]
    raw = random_blocks(type_name, rows=6, blocks_per_row=3 if block > 1 else 96, seed=len(type_name))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])  # fp32 [6, n]
    out = GGUF_CODECS[f"gguf:{type_name}"].decode([torch.from_numpy(raw)], tuple(ref.shape))
    assert out.dtype == torch.float32 and tuple(out.shape) == ref.shape
    assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0  # a real comparison, not of zeros


@pytest.mark.parametrize("type_name", NUMPY_DECODED)
def test_numpy_decoded_types_keep_rows_and_blocks_in_order(type_name):
    """IQ and MXFP4 blocks decode through gguf-py itself; what is ours is the reshaping: each row decoded on its
    own gives the same values as the whole tensor at once."""
    block, _ = BLOCK_SIZES[type_name]
    raw = random_blocks(type_name, rows=4, blocks_per_row=2, seed=5)
    out = GGUF_CODECS[f"gguf:{type_name}"].decode([torch.from_numpy(raw)], (4, 2 * block)).numpy()
    t = gguf.GGMLQuantizationType[type_name]
    rows = np.stack([gguf.quants.dequantize(raw[r : r + 1], t)[0] for r in range(4)])
    assert np.isfinite(rows).all() and np.abs(rows).max() > 0
    assert np.array_equal(out, rows)
    assert not np.array_equal(out[0], out[1])


@pytest.mark.parametrize("type_name", ["F16", "Q8_0", "Q4_K", "IQ4_XS"])
def test_unpermute_restores_rotate_half_row_order(type_name):
    """Rows stored in llama.cpp's interleaved q/k order decode, with +unpermute, to transformers' order."""
    n_head, head_dim = 2, 8
    block, _ = BLOCK_SIZES[type_name]
    raw = random_blocks(type_name, rows=n_head * head_dim, blocks_per_row=1 if block > 1 else 32, seed=3)
    plain = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])  # rows in stored (permuted) order
    # the converter's permutation maps transformers' row (h, j, i) to stored row (h, i, j)
    want = plain.reshape(n_head, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(plain.shape)
    part = torch.from_numpy(raw).reshape(n_head, head_dim // 2, 2, -1)
    out = GGUF_CODECS[f"gguf:{type_name}+unpermute"].decode([part], tuple(plain.shape))
    assert np.array_equal(out.numpy(), want)
    assert not np.array_equal(want, plain)


def test_registry_names_and_bits():
    assert not set(GGUF_CODECS) & set(QUANT_CODECS)
    assert GGUF_CODECS["gguf:Q8_0"].bits == 8.5 and GGUF_CODECS["gguf:Q4_K"].bits == 4.5
    assert GGUF_CODECS["gguf:Q6_K"].bits == 6.5625 and GGUF_CODECS["gguf:F32"].bits == 32
    for name, codec in GGUF_CODECS.items():
        assert codec.name == name
