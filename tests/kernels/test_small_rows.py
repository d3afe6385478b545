"""small_rows: oneDNN off only for 1-2 bf16 rows on CPU, always restored."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.small_rows import small_rows

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("rows", "dtype", "native"),
    [(1, torch.bfloat16, True), (2, torch.bfloat16, True), (3, torch.bfloat16, False), (1, torch.float32, False)],
)
def test_small_rows_switches_and_restores(rows: int, dtype: torch.dtype, native: bool) -> None:
    assert torch.backends.mkldnn.enabled
    with small_rows(rows, dtype, CPU):
        assert torch.backends.mkldnn.enabled is not native
    assert torch.backends.mkldnn.enabled


def test_small_rows_restores_after_an_error() -> None:
    with pytest.raises(RuntimeError), small_rows(1, torch.bfloat16, CPU):
        raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled


def test_native_bf16_gemv_is_close_to_onednn() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).bfloat16()
    x = torch.randn(1, 512, generator=g).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float())
    with small_rows(1, torch.bfloat16, CPU):
        native = torch.nn.functional.linear(x, w).float()
    onednn = torch.nn.functional.linear(x, w).float()
    scale = ref.abs().max()
    assert (native - ref).abs().max() <= 0.02 * scale  # both are bf16-rounded fp32 accumulations
    assert (onednn - ref).abs().max() <= 0.02 * scale
