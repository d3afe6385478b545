"""Shared by the benchmarks: the Qwen3-MoE-shaped random benchmark model, built once and cached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BENCH_CONFIG = dict(
    hidden_size=1024, num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
    intermediate_size=3072, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
    max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def bench_config(vocab: int | None = None, layers: int | None = None) -> dict[str, Any]:
    """BENCH_CONFIG, with `vocab` embedding and output-head rows and `layers` decoder layers when given."""
    return dict(BENCH_CONFIG, vocab_size=vocab or BENCH_CONFIG["vocab_size"],
                num_hidden_layers=layers or BENCH_CONFIG["num_hidden_layers"])  # fmt: skip


def bench_model_name(vocab: int | None = None, layers: int | None = None) -> str:
    """The cache folder's name: the vocabulary (and a layer count other than BENCH_CONFIG's) and a digest of the
    whole config, so that a checkpoint built from another config is never reused under the same name."""
    config = bench_config(vocab, layers)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    deep = f"-l{layers}" if layers and layers != BENCH_CONFIG["num_hidden_layers"] else ""
    return f"qwen3moe-bench-v{config['vocab_size']}{deep}-{digest}"


def qwen3_bench_model(cache_dir: str | os.PathLike[str] = ".bench", vocab: int | None = None,
                      layers: int | None = None) -> Path:  # fmt: skip
    """Random bf16 Qwen3-MoE checkpoint of the engine issue's shape (seeded; `vocab` rows of embedding and
    output head, default BENCH_CONFIG's 32000; `layers` decoder layers, default 8); cached on disk under a name
    that depends on the config."""
    out = Path(cache_dir) / bench_model_name(vocab, layers)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **bench_config(vocab, layers))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # written aside, then renamed: an interrupted build leaves no half checkpoint
    tmp.rename(out)
    return out
