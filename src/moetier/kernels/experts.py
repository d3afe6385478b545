"""Expert math on a pool slot's views: the `compute` step of the pipeline.

Each function takes tokens x [N, H] and one expert's slot views and returns [N, H].
They reproduce the families' reference expert code (transformers), reading the
canonical layout of formats/layout.py.

Invariants: the matmuls go through qformat.linear (plain weights: matmul.linear, whose kernel
for 1-2 bf16 rows is chosen per call), so an expert's result does not depend on process-wide
flags or on which thread runs it; the functions are stateless (frozen dataclasses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetier.kernels.qformat import linear

ExpertFn = Callable[[torch.Tensor, Any], torch.Tensor]  # x [N, H], slot views (full or quantized) -> [N, H]


@dataclass(frozen=True)
class SwiGLU:
    """act(x @ gate.T) * (x @ up.T) @ down.T (Mixtral, Qwen, OLMoE, DeepSeek)."""

    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, v: Any) -> torch.Tensor:
        h = linear(x, v.w13)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)  # [N, I] each
        return linear(self.act(gate) * up, v.w2)  # [N, H]


@dataclass(frozen=True)
class GptOssGLU:
    """GPT-OSS: biased projections, gate clamped above, up clamped both ways, gate*sigmoid(alpha*gate)*(up+1)."""

    alpha: float
    limit: float

    def __call__(self, x: torch.Tensor, v: Any) -> torch.Tensor:
        h = linear(x, v.w13, v.b13)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)  # de-interleaved at load: gate rows first
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return linear((up + 1) * glu, v.w2, v.b2)  # [N, H]
