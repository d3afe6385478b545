"""What a model needs besides its experts, for `--memory` (policies/memory.py MemoryNeeds), before any pool.

`memory_needs(sk, cfg)` measures or bounds each part for an opened checkpoint (runtime/loader.py Skeleton):
- process: this process's resident set now (/proc/self/status VmRSS: the interpreter, torch, what the caller
  already holds);
- dense: every non-expert parameter at the model dtype, plus the quantised copies the lean decoder keeps
  beside them under a quantised --dense-precision or a checkpoint computed as stored (0.6 of the bf16 bytes
  bounds Q8_0's 34 bytes per 32 weights plus scales);
- kv: the KV cache at its full length (the lean decoder's max_len: --max-seq-len, else the model's limit
  capped at 4096), whether or not the sequence reaches it; serving sets it (Budgets.kv_bytes: its KV budget);
- scratch: a bound on the native step's buffers for RuntimeConfig.step_rows rows (residual, routing, logits,
  the kernels' scratch, measured at 3.6 MB for the bundled model and 26 MB for the 32000-token benchmark
  model, where this bound gives 7 and 37 MB); the wide step (RuntimeConfig.residual fp32, and auto for a GGUF
  file) holds its logits in fp32 beside the kernels' fp32 rows: 10 bytes a vocabulary entry and row, not 6;
- cache: dynamic precision's host DRAM cache (--host-cache-mem);
- margin: 64 MiB plus a step's logits in fp32 four times over (sampling, log-softmax and their copies), plus 8
  MiB and 1/32 of the dense bytes for huge pages (store/hostmem.py: whole 2 MiB pages committed where a buffer's
  page is touched; measured about 26 MB more resident on a 2.5 GiB process, the 40-layer benchmark model's Q8_0
  file, whose dense bytes are 528 MiB).
runtime/wire.py calls it and hands the needs to the store's build (runtime/memory.py fit).
"""

from __future__ import annotations

import os

from moetier.config import EngineConfig
from moetier.formats.gguf import is_gguf
from moetier.policies.memory import MemoryNeeds
from moetier.runtime.lean import kv_token_bytes
from moetier.runtime.loader import Skeleton
from moetier.runtime.memory import process_rss
from moetier.types import Precision

MARGIN = 64 * 1024**2
HUGE_SLACK = 8 * 1024**2  # huge pages' rounding of the pools (store/hostmem.py); the dense buffers': 1/32 of them
QUANT_COPY = 0.6  # quantised dense copies beside the bf16 weights, as a share of their bytes (bounds Q8_0's 0.53)


def memory_needs(sk: Skeleton, cfg: EngineConfig) -> MemoryNeeds:
    """The parts of the process budget besides the experts, for this checkpoint and config (module docstring)."""
    o, info = sk.opened, sk.info
    dtype = o.dtype
    model_cfg = o.config
    # 1. dense weights: the skeleton's non-expert parameters (on meta: no bytes yet) at the model dtype
    dense = sum(p.numel() for n, p in o.model.named_parameters() if ".experts." not in n) * dtype.itemsize
    if cfg.runtime.dense_precision != "full" or Precision.STORED.value in cfg.precision.precisions:
        dense += int(dense * QUANT_COPY)
    # 2. the KV cache at full length
    limit = int(getattr(model_cfg, "max_position_embeddings", 4096))
    max_len = cfg.runtime.max_seq_len or min(limit, 4096)
    kv = kv_token_bytes(model_cfg, dtype) * max_len if cfg.budgets.kv_bytes is None else cfg.budgets.kv_bytes
    # 3. the native step's buffers, bounded
    vocab = int(getattr(model_cfg, "vocab_size", 0) or 0)
    rows, hidden, layers = cfg.runtime.step_rows, info.hidden_size, info.num_layers
    experts = max(info.num_experts, 1)
    heads = int(getattr(model_cfg, "num_attention_heads", 1) or 1)
    threads = max(os.cpu_count() or 1, 1)
    # bytes a vocabulary entry and row: bf16 logits + the kernels' fp32 rows; wide: fp32 logits + rows
    per_vocab = 10 if cfg.runtime.wide(is_gguf(sk.path)) else 6
    scratch = rows * (per_vocab * vocab + 64 * hidden + 8 * experts * layers) + threads * heads * max_len * 8
    # 4. transient tensors: logits of a step, in fp32, four times over; huge-page rounding of the buffers
    margin = MARGIN + 16 * rows * vocab + HUGE_SLACK + dense // 32
    return MemoryNeeds(process_rss(), dense, kv, scratch, cfg.budgets.host_cache_bytes, margin)


__all__ = ["memory_needs"]
