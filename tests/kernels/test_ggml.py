"""GGUF block types computed as stored: ggml's dot products lent to our kernels (kernels/ggml.py, csrc/mm.h
MT_KIND_GG), against float64 references of the values gguf-py's numpy reference decodes the blocks to.

ggml quantises the activation row to its type's vec_dot_type (Q8_0 / Q8_1 / Q8_K blocks: 8-bit values per
block of 32 or 256) before the integer dot product, so a product differs from the float64 reference by that
rounding (about 1% of the output's scale at most on these sizes) plus the bf16 rounding of the output; a
wrong layout, type or row stride is wrong by the output's whole scale.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from gguf_ref import random_blocks
from moetier.kernels import decode, ggml

BF16 = torch.bfloat16
# every family of GGUF block type people download: legacy, K-quants, IQ (4-, 3-, 2-bit), MXFP4, plain floats
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
         "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_S", "MXFP4", "F16", "BF16")  # fmt: skip


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = decode.load(True, None)
    if lib is None:
        pytest.skip("no kernel library (no C compiler)")
    assert ggml.available(), ggml.load_error()  # ggml-python is a dependency: its absence is a failure here
    return lib


def test_every_downloaded_type_is_registered(lib):
    names = ggml.register(lib)
    assert set(TYPES) <= names, sorted(set(TYPES) - names)
    assert ggml.kind_of("Q4_K", lib) == ggml.KIND_BASE + GGMLQuantizationType.Q4_K.value
    assert ggml.kind_of("F32", lib) is None  # plain fp32 is not lent: the bf16 path computes it
    assert ggml.type_name(ggml.KIND_BASE + GGMLQuantizationType.Q6_K.value) == "Q6_K"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_matches_the_float64_reference(lib, name, m):
    t = GGMLQuantizationType[name]
    n, k = 13, 512  # 13 rows: no multiple of any row block; K two super-blocks
    raw = random_blocks((n, k), t, seed=len(name) + m)  # uint8 [N, row bytes]
    w = quants.dequantize(raw, t).astype(np.float64).reshape(n, k)
    assert np.isfinite(w).all()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(BF16)
    y = decode.gemv(x, torch.from_numpy(raw), None, None, ggml.KIND_BASE + t.value, 0)  # [M, N] bf16
    ref = x.double().numpy() @ w.T
    scale = np.abs(ref).max()
    assert scale > 0
    err = np.abs(y.double().numpy() - ref).max() / scale
    assert err < 0.02, f"{name}: relative error {err:.4f}"


def test_gemv_refuses_rows_that_are_not_whole_blocks(lib):
    raw = random_blocks((4, 256), GGMLQuantizationType.Q4_K, seed=1)
    x = torch.randn(1, 256).to(BF16)
    with pytest.raises(ValueError, match="Q4_K weight must be contiguous uint8"):
        decode.gemv(x, torch.from_numpy(raw[:, :-1].copy()), None, None, ggml.KIND_BASE + 12, 0)
    with pytest.raises(ValueError, match="blocks tile K"):
        decode.gemv(torch.randn(1, 128).to(BF16), torch.from_numpy(raw), None, None, ggml.KIND_BASE + 12, 0)


def test_a_build_for_another_cpu_is_refused(monkeypatch):
    """A ggml-python wheel built with features this CPU lacks would die of SIGILL: refused, with the fix."""
    ggml._ggml.cache_clear()
    try:
        monkeypatch.setattr(ggml, "_cpu_flags", lambda: {"sse2"})  # a CPU with nothing the build may use
        assert ggml._ggml() is None
        err = ggml.load_error()
        assert err is not None and "built for another CPU" in err and "--no-binary ggml-python" in err
    finally:
        monkeypatch.undo()
        ggml._ggml.cache_clear()
        ggml._errors.clear()
    assert ggml.available()


def test_block_sizes_agree_with_gguf_py():
    for name in TYPES:
        blck, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert ggml.block_of(name) == blck
        assert ggml.row_bytes(name, 4 * 256) == 4 * 256 // blck * size
