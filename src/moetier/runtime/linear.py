"""Static linear layers with weights prepacked for oneDNN where that is faster and exact.

On CPU in bf16, `F.linear` re-lays out its weight into oneDNN's blocked format on every
call; for a decode step (one row of activations) that costs as much as the matmul. A
weight packed once at load (`mkldnn._reorder_linear_weight`) skips it and gives
bit-identical results. Used for the resident non-expert weights of the lean decoder
(QKV, output projection, LM head). Elsewhere (fp32, CUDA, CPUs without bf16 support
in oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _can_pack(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class StaticLinear:
    """y = x @ w.T + b for x [T, K], w [N, K] -> [T, N]."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        self.bias = b
        self.out_features = w.shape[0]
        self.packed = _can_pack(w)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, 1) if self.packed else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
