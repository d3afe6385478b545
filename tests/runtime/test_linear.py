"""StaticLinear: prepacked bf16 weights give bit-identical results to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetier.runtime.linear import StaticLinear


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_static_linear_equals_f_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=g).to(dtype)
    lin = StaticLinear(w, b)
    assert lin.packed == (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    got = lin(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    assert torch.equal(got, F.linear(x, w, b))
