"""Shared by the benchmarks: the Qwen3-MoE-shaped random benchmark model, built once and cached."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BENCH_CONFIG = dict(
    hidden_size=1024, num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
    intermediate_size=3072, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
    max_position_embeddings=2048, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def qwen3_bench_model(cache_dir: str | os.PathLike[str] = ".bench") -> Path:
    """Random bf16 Qwen3-MoE checkpoint of the engine issue's shape (seeded); cached on disk."""
    out = Path(cache_dir) / "qwen3moe-bench"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **BENCH_CONFIG)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out
