"""Kernel choice for matmuls with very few activation rows (decode).

For one or two rows of bf16 activations on CPU, oneDNN (torch's default bf16 matmul
backend there) re-lays out the weight into its blocked format on every call, which
costs more than the matmul itself; torch's native bf16 GEMV reads the weight as it
is. Measured on this project's reference CPU (AVX-512 bf16, one thread, 64 cache-cold
expert matrices of 512x1024): 10.1 ms with oneDNN, 4.5 ms native; from 4 rows up oneDNN
wins. `small_rows` turns oneDNN off for such calls and restores it after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

NATIVE_MAX_ROWS = 2


@contextlib.contextmanager
def small_rows(rows: int, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    use_native = (
        rows <= NATIVE_MAX_ROWS and dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.enabled
    )
    if not use_native:
        yield
        return
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(True)
