"""Codecs of GGUF block types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, ...), decoded with torch.

A GGUF tensor is stored row by row; each row of `n` weights is `n / block_size` blocks of
`type_size` bytes (GGML_QUANT_SIZES). An encoded GGUF tensor (formats/gguf.py) has one part: the
raw block bytes as uint8. Every decoder here turns the bytes of whole blocks into fp32 values in
row-major order, vectorised over all blocks at once (no Python loop over blocks), with the same
float32 operation order as the numpy reference `gguf.quants.dequantize`, so results are
bit-identical to it (tests/formats/test_gguf_codecs.py).

Two codecs per block type:
- `gguf:<TYPE>`: parts[0] holds the tensor's bytes in stored order (any shape; it is flattened).
- `mla_kv_b`: two parts, MLA's k_b and v_b (each a plain or a `gguf:<TYPE>` tensor of its own, read and
  decoded first), merged back into the kv_b_proj transformers holds.
- `qwen3next_qkvz`: two parts, Qwen3-Next's attn_qkv and attn_gate (each read and decoded first), merged back
  into the in_proj_qkvz transformers holds (per key head: q, k, v, z).
- `minus_one`, `log_neg`: one part (read and decoded first), given back as part - 1 (a zero-centred RMSNorm weight
  llama.cpp's converter wrote plus 1) or log(-part) (Qwen3-Next's A_log, written as -exp(A_log)).
- `gguf:<TYPE>+unpermute`: parts[0] has shape [n_head, head_dim / 2, 2, row_bytes]: the rows of
  a llama-architecture q or k projection that llama.cpp's converter permuted for its interleaved
  RoPE. The decoder restores transformers' row order (head, half, index within half) before
  dequantising; rows are whole blocks, so this is a byte-row reorder.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from moetier.formats.encoded import Codec

QK_K = 256  # weights per K-quant super-block

# type name -> (weights per block, bytes per block), as GGML_QUANT_SIZES in gguf.constants
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "IQ3_S": (256, 110), "IQ3_XXS": (256, 98), "IQ2_S": (256, 82),
    "IQ2_XS": (256, 74), "IQ2_XXS": (256, 66), "IQ1_S": (256, 50), "IQ1_M": (256, 56), "MXFP4": (32, 17),
}  # fmt: skip
# types decoded by gguf-py's numpy reference (grid lookups; exact, slower than the torch decoders below): only
# where a slot is decoded (--precision full, or stored without ggml); computed as stored they never decode
NUMPY_DECODED = ("IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "MXFP4")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2] (little-endian fp16) -> fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shift(x: torch.Tensor, shifts: list[int], dim: int) -> torch.Tensor:
    """int32 x with a new axis of size len(shifts) inserted at `dim`, holding x >> shift."""
    s = torch.tensor(shifts, dtype=torch.int32)
    view = [1] * (x.dim() + 1)
    view[dim] = len(shifts)
    return x.unsqueeze(dim) >> s.view(view)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # b: uint8 [n, 34] -> fp32 [n, 32]
    d = _f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> int32 [n, 32]: low nibbles (weights 0..15), then high nibbles (16..31)."""
    return (_shift(qs.int(), [0, 4], 1) & 0xF).reshape(qs.shape[0], 32)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> int32 [n, 32], bit j of the word."""
    return (_shift(qh.int(), list(range(8)), 2) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # [n, 18] -> [n, 32]
    d = _f16(b[:, :2])
    return d * (_nibbles(b[:, 2:]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # [n, 20] -> [n, 32]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # [n, 22] -> [n, 32]
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return d * (q - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # [n, 24] -> [n, 32]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return d * q.float() + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # [n, 84] -> [n, 256]
    n = b.shape[0]
    scales = b[:, :16].int()
    qs = b[:, 16:80].int()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = (_shift(qs.view(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, 16, 16).float()  # [n, half, shift, 32]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # [n, 110] -> [n, 256]
    n = b.shape[0]
    hmask, qs, packed = b[:, :32].int(), b[:, 32:96].int(), b[:, 96:108].int()
    d = _f16(b[:, 108:110])
    low = (_shift(packed[:, :8], [0, 4], 1) & 0xF).reshape(n, 16)  # [n, shift, 8]
    high = (_shift(packed[:, 8:12], [0, 2, 4, 6], 1) & 3).reshape(n, 16)  # [n, shift, 4]
    scales = ((low | (high << 4)) - 32).float()
    dl = (d * scales).view(n, 16, 1)
    ql = (_shift(qs.view(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, 16, 16)
    qh = (_shift(hmask.view(n, 1, 32), list(range(8)), 2) & 1).reshape(n, 16, 16)
    q = (ql - ((qh ^ 1) << 2)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed scale bytes of a Q4_K / Q5_K block -> 8 six-bit scales and 8 mins (int32 [n, 8])."""
    p = packed.int().view(-1, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # [n, 144] -> [n, 256]
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    q = (_shift(b[:, 16:].int().view(n, 4, 32), [0, 4], 2) & 0xF).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # [n, 176] -> [n, 256]
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    ql = (_shift(b[:, 48:].int().view(n, 4, 32), [0, 4], 2) & 0xF).reshape(n, 8, 32)
    qh = (_shift(b[:, 16:48].int().view(n, 1, 32), list(range(8)), 2) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # [n, 210] -> [n, 256]
    n = b.shape[0]
    ql_b, qh_b = b[:, :128].int(), b[:, 128:192].int()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    dl = (d * scales).view(n, 16, 1)
    ql = (_shift(ql_b.view(n, 2, 64), [0, 4], 2) & 0xF).reshape(n, 8, 32)
    qh = (_shift(qh_b.view(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


_BLOCK_DECODERS = {
    "F32": _f32, "F16": _fp16, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a GGUF tensor of `type_name` (uint8, any shape) -> fp32 [shape]."""
    _, type_size = BLOCK_SIZES[type_name]
    blocks = raw.reshape(-1, type_size)  # [n_blocks, type_size]
    if type_name in NUMPY_DECODED:
        values = gguf_quants.dequantize(blocks.contiguous().numpy(), GGMLQuantizationType[type_name])
        return torch.from_numpy(values.astype("float32", copy=False)).reshape(shape)
    return _BLOCK_DECODERS[type_name](blocks).reshape(shape)


def unpermute_rows(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [n_head, head_dim / 2, 2, row_bytes] (llama.cpp's q/k row order) -> [n_head, 2, head_dim / 2,
    row_bytes] (transformers' rotate-half order), contiguous."""
    if raw.dim() != 4 or raw.shape[2] != 2:
        raise ValueError(f"an unpermute part must have shape [n_head, head_dim/2, 2, row_bytes], got {list(raw.shape)}")
    return raw.transpose(1, 2).contiguous()


def _codec(type_name: str, unpermute: bool) -> Codec:
    block, size = BLOCK_SIZES[type_name]

    def decode(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        raw = unpermute_rows(parts[0]) if unpermute else parts[0]
        return dequantize(raw, type_name, shape)

    name = f"gguf:{type_name}" + ("+unpermute" if unpermute else "")
    return Codec(name, decode, bits=8.0 * size / block)


def _mla_kv_b(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """MLA's kv_b_proj [nh (nope + v), kv_lora] from the two tensors llama.cpp's deepseek2 converter splits it into,
    each already read (decoded where it is a block type): k_b [nh, kv_lora, nope] (transposed per head) and
    v_b [nh, v, kv_lora]. Per head, the nope rows of k, then the v rows, as transformers stores kv_b."""
    k_b, v_b = (p.float() for p in parts)
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(shape)  # [nh, nope + v, kv_lora] -> shape


def _qwen3next_qkvz(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz [nk (2 hk + 2 r hv), H] from the two tensors llama.cpp's converter splits it into,
    each already read (decoded where it is a block type): attn_qkv [nk hk (q) + nk hk (k) + nk r hv (v), H] and
    attn_gate viewed as [nk, r hv, H] (z, one group of value heads per key head). Per key head: q, k, v, z rows."""
    qkv, z = (p.float() for p in parts)
    nk, vz, cols = z.shape
    hk = (qkv.shape[0] - nk * vz) // (2 * nk)
    q, k, v = qkv.split([nk * hk, nk * hk, nk * vz])
    return torch.cat([q.view(nk, hk, cols), k.view(nk, hk, cols), v.view(nk, vz, cols), z], dim=1).reshape(shape)


def _minus_one(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-centred RMSNorm weight (transformers multiplies by 1 + w) that llama.cpp's converter wrote as w + 1:
    exact in fp32 for stored values in [0.5, 2] (Sterbenz), and 1 + (s - 1) gives back s wherever s - 1 is exact."""
    return (parts[0].float() - 1.0).reshape(shape)


def _log_neg(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Qwen3-Next's A_log from the -exp(A_log) llama.cpp's converter writes (ssm_a): log(-a), which needs a < 0."""
    a = parts[0].float()
    if not bool((a < 0).all()):
        raise ValueError(f"ssm_a holds {int((a >= 0).sum())} value(s) >= 0: not -exp(A_log)")
    return torch.log(-a).reshape(shape)


GGUF_CODECS: dict[str, Codec] = {
    c.name: c for t in BLOCK_SIZES for c in (_codec(t, unpermute=False), _codec(t, unpermute=True))
}
GGUF_CODECS["mla_kv_b"] = Codec("mla_kv_b", _mla_kv_b, bits=32.0)  # bits: of its parts, which say their own
GGUF_CODECS["qwen3next_qkvz"] = Codec("qwen3next_qkvz", _qwen3next_qkvz, bits=32.0)
GGUF_CODECS["minus_one"] = Codec("minus_one", _minus_one, bits=32.0)
GGUF_CODECS["log_neg"] = Codec("log_neg", _log_neg, bits=32.0)

