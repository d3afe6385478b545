"""The quantised-safetensors codecs (formats/codecs_quant.py) against float64 references written from the
formats' specifications (quant_ref.py), and against transformers' own dequantisation where it is importable."""

from __future__ import annotations

import math

import pytest
import torch
from quant_ref import (
    awq_quantise,
    awq_reference,
    ct_quantise,
    ct_reference,
    fp8_quantise,
    fp8_reference,
    gptq_quantise,
    gptq_reference,
    mxfp4_quantise,
    mxfp4_reference,
)

from moetier.formats.codecs import CODECS
from moetier.formats.codecs_quant import QUANT_CODECS, fp8_codec_name

ATOL = 1e-6  # fp32 decode vs float64 reference, on weights of magnitude ~1


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))  # [N, K]


def test_registry_holds_the_quant_codecs():
    for name, codec in QUANT_CODECS.items():
        assert CODECS[name] is codec and codec.name == name and codec.bits > 4


@pytest.mark.parametrize(
    ("n", "k", "bn", "bk"), [(32, 64, 8, 8), (24, 40, 16, 16), (7, 130, 128, 128), (48, 16, 1, 16)]
)
def test_fp8_block_matches_float64_reference(n, k, bn, bk):
    q, s = fp8_quantise(_weight(n, k), bn, bk)  # ragged last blocks when bn/bk do not divide
    out = CODECS[fp8_codec_name(bn, bk)].decode([q, s], (n, k))
    assert out.dtype == torch.float32 and out.shape == (n, k)
    ref = fp8_reference(q, s, bn, bk)
    assert (out.double() - ref).abs().max().item() <= ATOL * ref.abs().max().item()
    assert (out.double() - _weight(n, k).double()).abs().max().item() < 0.2  # it is the weight, coarsely


def test_fp8_block_fused_experts_match_per_expert():
    qs = [fp8_quantise(_weight(16, 32, seed=e), 8, 8) for e in range(3)]
    q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])  # [3, 16, 32], [3, 2, 4]
    out = CODECS[fp8_codec_name(8, 8)].decode([q, s], (3, 16, 32))
    for e, (qe, se) in enumerate(qs):
        assert torch.equal(out[e], CODECS[fp8_codec_name(8, 8)].decode([qe, se], (16, 32)))


def test_fp8_block_matches_transformers():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    q, s = fp8_quantise(_weight(40, 72), 16, 32)  # ragged in both directions
    ref = fp8._dequantize_fp8_weight(q, s, [16, 32], torch.float32)
    out = CODECS[fp8_codec_name(16, 32)].decode([q, s], (40, 72))
    assert torch.equal(out, ref)


def test_mxfp4_matches_float64_reference_and_orientation():
    w = torch.randn(2, 64, 24, generator=torch.Generator().manual_seed(3))  # logical [E, K, R] as GPT-OSS stores
    blocks, scales = mxfp4_quantise(w)  # [2, 24, 2, 16], [2, 24, 2]
    out = CODECS["mxfp4"].decode([blocks, scales], (2, 64, 24))
    ref = mxfp4_reference(blocks, scales)
    assert out.shape == (2, 64, 24)
    assert (out.double() - ref).abs().max().item() == 0.0  # E2M1 times a power of two is exact in fp32
    assert (out - w).abs().max().item() < 0.5 * w.abs().max().item()  # the right orientation, coarsely
    one = CODECS["mxfp4"].decode([blocks[1], scales[1]], (64, 24))  # one expert's slice of the fused parts
    assert torch.equal(one, out[1])


def test_mxfp4_matches_transformers():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    ref = mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    out = CODECS["mxfp4"].decode([blocks, scales], (3, 128, 10))
    assert torch.equal(out, ref)


@pytest.mark.parametrize(("sym", "v1", "act_order"), [(True, True, False), (False, True, False),
                                                      (False, False, False), (False, False, True)])  # fmt: skip
def test_gptq_matches_float64_reference(sym, v1, act_order):
    w = _weight(24, 32, seed=5)  # [N, K]
    parts = gptq_quantise(w, 8, sym, v1, act_order)
    codec = "gptq4" if v1 else "gptq4_v2"
    out = CODECS[codec].decode([parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]], (24, 32))
    ref = gptq_reference(parts, v1)
    assert (out.double() - ref).abs().max().item() <= ATOL
    if not act_order:  # the contiguous groups: the g_idx-free codec agrees, and it is the weight
        noidx = CODECS[codec + "_noidx"].decode([parts["qweight"], parts["qzeros"], parts["scales"]], (24, 32))
        assert torch.equal(noidx, out)
        assert (out - w).abs().max().item() < 0.5


def test_gptq_v1_zero_convention():
    """A v1 checkpoint stores zero - 1: the same words read as v2 are off by one scale everywhere."""
    parts = gptq_quantise(_weight(8, 16, seed=6), 8, True, True, False)
    args = [parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]]
    diff = CODECS["gptq4_v2"].decode(args, (8, 16)) - CODECS["gptq4"].decode(args, (8, 16))
    scale = parts["scales"].float()[parts["g_idx"].long()].t()  # [N, K]
    assert torch.allclose(diff, scale)


def test_awq_matches_float64_reference():
    w = _weight(16, 48, seed=7)
    parts = awq_quantise(w, 16)
    out = CODECS["awq4"].decode([parts["qweight"], parts["qzeros"], parts["scales"]], (16, 48))
    ref = awq_reference(parts)
    assert (out.double() - ref).abs().max().item() <= ATOL
    assert (out - w).abs().max().item() < 0.5


@pytest.mark.parametrize("with_zero", [False, True])
def test_compressed_tensors_int4_matches_float64_reference(with_zero):
    g = torch.Generator().manual_seed(8)
    packed = torch.randint(-(2**31), 2**31 - 1, (16, 4), dtype=torch.int32, generator=g)  # [N, K/8]
    scale = torch.rand(16, 2, generator=g).to(torch.bfloat16)  # [N, G]
    zp = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int32, generator=g) if with_zero else None
    parts = [packed, scale] + ([zp] if zp is not None else [])
    out = CODECS["ct_int4_zp" if with_zero else "ct_int4"].decode(parts, (16, 32))
    named = {"weight_packed": packed, "weight_scale": scale} | ({"weight_zero_point": zp} if zp is not None else {})
    assert (out.double() - ct_reference(named)).abs().max().item() <= ATOL


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_int4_round_trip(sym):
    w = _weight(16, 32, seed=9)
    parts = ct_quantise(w, 8, sym)
    args = [parts["weight_packed"], parts["weight_scale"]] + ([] if sym else [parts["weight_zero_point"]])
    out = CODECS["ct_int4" if sym else "ct_int4_zp"].decode(args, (16, 32))
    assert (out.double() - ct_reference(parts)).abs().max().item() <= ATOL
    assert (out - w).abs().max().item() < 0.5


def test_bits_count_the_scales():
    assert math.isclose(CODECS[fp8_codec_name(128, 128)].bits, 8 + 32 / 128**2)
    assert CODECS["mxfp4"].bits == 4.25
