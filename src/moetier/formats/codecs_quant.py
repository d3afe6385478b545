"""Codecs of quantised safetensors checkpoints: FP8 block-scaled, MXFP4, GPTQ / AWQ int4, compressed-tensors.

Every codec decodes the stored parts of one logical tensor (formats/encoded.py) to float32; which
stored tensors are the parts, in which order, and their validation live in formats/quantized.py.

    fp8_block:{bn}x{bk}  parts (weight F8_E4M3 [..., N, K], weight_scale_inv F32/BF16 [..., ceil(N/bn), ceil(K/bk)])
                         -> [..., N, K]; W = fp8 * scale of its (bn x bk) block (ragged last blocks allowed).
                         The block size is part of the name: a scale grid alone does not determine it.
    mxfp4                parts (blocks U8 [..., R, G, 16], scales U8 [..., R, G]) -> [..., 32G, R]:
                         byte j of a block holds elements 2j (low nibble) and 2j+1 (high nibble), each an
                         E2M1 value; the block's value is times 2**(scale - 127) (E8M0). The result is
                         transposed, as GPT-OSS's bf16 checkpoint stores `gate_up_proj` [E, H, 2I].
    gptq4 / gptq4_v2     parts (qweight I32 [K/8, N], qzeros I32 [G, N/8], scales F16 [G, N], g_idx I32 [K])
                         -> [N, K]; qweight word r holds rows k = 8r..8r+7 in nibbles 0..7 (low first), qzeros
                         word c holds columns 8c..8c+7 likewise; W[n, k] = (q - z) * s with the group g_idx[k].
                         v1 checkpoints (gptq4) store zero - 1, so z = stored + 1; v2 stores z itself.
    gptq4_noidx / gptq4_v2_noidx   the same without g_idx: group of row k is k // (K / G).
    awq4                 parts (qweight I32 [K, N/8], qzeros I32 [G, N/8], scales F16 [G, N]) -> [N, K];
                         word c holds columns 8c + AWQ_ORDER[i] in nibble i; W[n, k] = (q - z) * s[k // (K/G)].
    ct_int4 / ct_int4_zp compressed-tensors pack-quantized W4A16: parts (weight_packed I32 [N, K/8],
                         weight_scale [N, G], optional weight_zero_point I32 [N/8, G]) -> [N, K]; word c of a
                         row holds columns 8c..8c+7 in nibbles 0..7, each an int4 offset by +8;
                         W = (q - z) * s[n, k // (K/G)] (z = 0 when symmetric; zeros are packed along N).

Invariants: decode is pure and allocates its output (float32, the logical shape) on the parts' device; it
never reads past the parts it is given, and it assumes the shapes that formats/quantized.py validated.
"""

from __future__ import annotations

import torch

from moetier.formats.encoded import Codec

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
FP8_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # block sides with a registered fp8_block codec
_INT4_BITS = 4 + (16 + 4) / 128  # int4 weights + an fp16 scale and a 4-bit zero per group (of the usual 128)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8] nibble shifts of an int32 word
# [8] the shift of the nibble holding each of an AWQ word's 8 columns, in column order (no gather afterwards)
_AWQ_SHIFTS = torch.tensor([4 * AWQ_ORDER.index(j) for j in range(8)], dtype=torch.int32)


def fp8_codec_name(bn: int, bk: int) -> str:
    return f"fp8_block:{bn}x{bk}"


def _unpack_nibbles(words: torch.Tensor, shifts: torch.Tensor = _SHIFTS) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W, 8]: nibble i (bits 4i..4i+3) of every word, as 0..15; with `shifts` (e.g.
    _AWQ_SHIFTS), entry j is the nibble at bit shifts[j] instead: a reordering at the cost of the unpacking."""
    return (words.to(torch.int32).unsqueeze(-1) >> shifts.to(words.device)) & 0xF


def _fp8_decoder(bn: int, bk: int):  # type: ignore[no-untyped-def]
    def decode(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        weight, scale = parts  # [..., N, K] fp8, [..., ceil(N/bn), ceil(K/bk)]
        n, k = weight.shape[-2:]
        s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]  # [..., N, gk]
        s = s.repeat_interleave(bk, dim=-1)[..., :k]  # [..., N, K]
        return (weight.float() * s).reshape(shape)

    return decode


def decode_mxfp4(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    blocks, scales = parts  # [..., R, G, 16] u8, [..., R, G] u8
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int32)
    vals = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)  # [..., R, G, 16, 2]: element 2j low, 2j+1 high
    vals = vals.flatten(-2)  # [..., R, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).float())  # times 2**(e - 127)
    return vals.flatten(-2).transpose(-1, -2).contiguous().reshape(shape)  # [..., 32G, R]


def _gptq_decoder(zero_offset: int, has_g_idx: bool):  # type: ignore[no-untyped-def]
    def decode(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        qweight, qzeros, scales = parts[:3]  # [K/8, N], [G, N/8], [G, N]
        kw, n = qweight.shape
        k, groups = kw * 8, scales.shape[0]
        q = _unpack_nibbles(qweight).permute(0, 2, 1).reshape(k, n)  # [K, N]: row 8r + i from nibble i of word r
        z = _unpack_nibbles(qzeros).reshape(groups, n) + zero_offset  # [G, N]
        g = parts[3].to(torch.int64) if has_g_idx else torch.arange(k, device=q.device) // (k // groups)  # [K] groups
        w = (q - z[g]).float() * scales.float()[g]  # [K, N]
        return w.t().contiguous().reshape(shape)  # [N, K]

    return decode


def decode_awq(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    qweight, qzeros, scales = parts  # [K, N/8], [G, N/8], [G, N]
    k = qweight.shape[0]
    groups, n = scales.shape
    q = _unpack_nibbles(qweight, _AWQ_SHIFTS).reshape(k, n)  # [K, N], columns in order
    z = _unpack_nibbles(qzeros, _AWQ_SHIFTS).reshape(groups, n)  # [G, N]
    g = torch.arange(k, device=q.device) // (k // groups)  # [K]
    w = (q - z[g]).float() * scales.float()[g]  # [K, N]
    return w.t().contiguous().reshape(shape)  # [N, K]


def _ct_decoder(has_zero: bool):  # type: ignore[no-untyped-def]
    def decode(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        packed, scale = parts[:2]  # [N, K/8] i32, [N, G]
        n, kw = packed.shape
        k, groups = kw * 8, scale.shape[1]
        q = _unpack_nibbles(packed).reshape(n, k) - 8  # [N, K] signed int4
        g = torch.arange(k, device=q.device) // (k // groups)  # [K]
        if has_zero:
            z = (_unpack_nibbles(parts[2].t()).reshape(groups, n) - 8).t()  # [N/8, G] packed along N -> [N, G]
            q = q - z[:, g]
        return (q.float() * scale.float()[:, g]).reshape(shape)  # [N, K]

    return decode


# int4 codecs whose values, zeros and scales our kernels read as they are (groups along K; kernels/qformat.py
# ExpertFormat with fp16 or bf16 scales, as stored): codec -> the function giving (v int32 [N, K] in 0..15,
# zero int32 [N, G], scale [N, G] in its stored dtype) of one logical tensor's parts, W = (v - zero) * scale.
# GPTQ with g_idx only when its groups are sequential (desc_act off), checked on every tensor.
def _gptq_ints(zero_offset: int, has_g_idx: bool):  # type: ignore[no-untyped-def]
    def ints(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qweight, qzeros, scales = parts[:3]  # [K/8, N], [G, N/8], [G, N]
        kw, n = qweight.shape
        k, groups = kw * 8, scales.shape[0]
        if has_g_idx:
            want = torch.arange(k, dtype=torch.int32, device=qweight.device) // (k // groups)
            if not torch.equal(parts[3].to(torch.int32), want):
                raise ValueError("g_idx is not sequential (act-order): its groups are not runs along K")
        v = _unpack_nibbles(qweight).permute(0, 2, 1).reshape(k, n).t()  # [N, K]
        z = (_unpack_nibbles(qzeros).reshape(groups, n) + zero_offset).t()  # [N, G]
        return v, z, scales.t()

    return ints


def _awq_ints(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, qzeros, scales = parts  # [K, N/8], [G, N/8], [G, N]
    k = qweight.shape[0]
    groups, n = scales.shape
    v = _unpack_nibbles(qweight, _AWQ_SHIFTS).reshape(k, n).t()  # [N, K], columns in order
    z = _unpack_nibbles(qzeros, _AWQ_SHIFTS).reshape(groups, n).t()  # [N, G]
    return v, z, scales.t()


def _ct_ints(has_zero: bool):  # type: ignore[no-untyped-def]
    def ints(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed, scale = parts[:2]  # [N, K/8], [N, G]
        n, kw = packed.shape
        groups = scale.shape[1]
        v = _unpack_nibbles(packed).reshape(n, kw * 8)  # [N, K]: int4 + 8
        z = (_unpack_nibbles(parts[2].t()).reshape(groups, n)).t() if has_zero else torch.full((n, groups), 8)
        return v, z.to(torch.int32), scale

    return ints


INT4_INTS = {
    "gptq4": _gptq_ints(1, True), "gptq4_v2": _gptq_ints(0, True), "gptq4_noidx": _gptq_ints(1, False),
    "gptq4_v2_noidx": _gptq_ints(0, False), "awq4": _awq_ints, "ct_int4": _ct_ints(False),
    "ct_int4_zp": _ct_ints(True),
}  # fmt: skip


QUANT_CODECS: dict[str, Codec] = {
    **{
        fp8_codec_name(bn, bk): Codec(fp8_codec_name(bn, bk), _fp8_decoder(bn, bk), 8 + 32 / (bn * bk))
        for bn in FP8_BLOCK_SIZES
        for bk in FP8_BLOCK_SIZES
    },
    "mxfp4": Codec("mxfp4", decode_mxfp4, 4 + 8 / 32),
    "gptq4": Codec("gptq4", _gptq_decoder(1, True), _INT4_BITS),
    "gptq4_v2": Codec("gptq4_v2", _gptq_decoder(0, True), _INT4_BITS),
    "gptq4_noidx": Codec("gptq4_noidx", _gptq_decoder(1, False), _INT4_BITS),
    "gptq4_v2_noidx": Codec("gptq4_v2_noidx", _gptq_decoder(0, False), _INT4_BITS),
    "awq4": Codec("awq4", decode_awq, _INT4_BITS),
    "ct_int4": Codec("ct_int4", _ct_decoder(False), 4 + 16 / 128),
    "ct_int4_zp": Codec("ct_int4_zp", _ct_decoder(True), _INT4_BITS),
}
