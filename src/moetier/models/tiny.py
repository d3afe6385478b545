"""Tiny random checkpoints of every supported family, built from config.

Used by the tests (exactness against transformers), the benchmarks and anyone who
wants to try moetier without a download. Weights are random, seeded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
    max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, initializer_range=0.2,
)  # fmt: skip

TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=48, num_local_experts=6),
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=6, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=6, head_dim=8,
                      norm_topk_prob=True),
    "olmoe": dict(intermediate_size=16, num_experts=6),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_hidden_layers=3,
                        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5),
    "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1,
                        num_hidden_layers=3, routed_scaling_factor=2.5),
    "gpt_oss": dict(intermediate_size=16, num_local_experts=6, head_dim=8, sliding_window=8),
}  # fmt: skip


def build_tiny_checkpoint(
    model_type: str, out_dir: str | os.PathLike[str], seed: int = 0, dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:  # fmt: skip
    """Write a random `model_type` checkpoint (config.json + model.safetensors) to out_dir."""
    if model_type not in TINY:
        raise KeyError(f"no tiny config for {model_type!r}; known: {sorted(TINY)}")
    kwargs = {**_COMMON, **TINY[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random, non-trivial router biases where a family has them
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.5, 0.5)
        for name, p in model.named_parameters():
            if "router.bias" in name or name.endswith("sinks") or "proj_bias" in name:
                p.normal_(0, 0.5)
    out = Path(out_dir)
    model.to(dtype).save_pretrained(out)
    return out


# --------------------------------------------------------------------------- any family, from its default config

# Sizes a tiny model of any transformers MoE family gets, for each attribute its config has. Families
# name the same thing differently (num_experts / n_routed_experts / moe_num_experts ...); all are set.
SMALL: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=16, expert_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=256,
    num_experts_per_tok=2, num_experts_per_token=2, moe_k=2, moe_topk=2, top_k=2, experts_per_token=2, top_k_experts=2,
    num_experts=6, num_local_experts=6, n_routed_experts=6, moe_num_experts=6,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1, shared_expert_intermediate_size=24,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    n_group=2, topk_group=1, num_expert_group=1, first_k_dense_replace=1, num_dense_layers=1,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    sliding_window=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1,
    expert_layer_period=2, expert_layer_offset=1, mlp_only_layers=[0], decoder_sparse_step=1,
    index_head_dim=16, index_n_heads=2, index_topk=4,
)  # fmt: skip


# Families whose defaults the generic shrink cannot make valid on its own
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),  # its default lists only one kind
    "zaya": dict(num_experts_per_tok=1),  # ZAYA routes to one expert only
    # LFM2-MoE: layer_types defaults to None; short-conv and attention layers, both MoE past the dense first layer
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3),
    # Qwen4-Exp: every attention layer is QSA-indexed, whose sizes have no default; a small hyper-connection mixer
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2, hc_lowrank=8),
    # Inkling 2: the unembedding is stored padded to vocab_size, the model keeps unpadded_vocab_size rows
    "inkling2_text": dict(vocab_size=128, unpadded_vocab_size=96),
    "inkling2_loop_text": dict(vocab_size=128, unpadded_vocab_size=96),
    # DBRX: sizes under its own names and in nested attention / FFN configs (its attention reads a rope_theta
    # that DbrxAttentionConfig does not default)
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=6, moe_top_k=2)),
    # Llama-4: a dense layer between MoE ones (small), a NoPE layer, chunked attention and attention temperature
    # tuning reached within a short prompt
    "llama4_text": dict(num_hidden_layers=3, moe_layers=[0, 2], intermediate_size_mlp=64, no_rope_layers=[1, 1, 0],
                        layer_types=["chunked_attention", "chunked_attention", "full_attention"],
                        attention_chunk_size=8, floor_scale=4),
}  # fmt: skip


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of any transformers family: its defaults with every size in SMALL that it has set small,
    layer-type lists cut to one layer per kind (at least 2 layers), MLA with one key/value head per head."""
    defaults = AutoConfig.for_model(model_type).to_dict()
    kw = {k: v for k, v in SMALL.items() if k in defaults}
    if "enable_moe_block" in defaults:  # Gemma 4: MoE is off by default
        kw["enable_moe_block"] = True
    if "kv_lora_rank" in defaults:  # MLA: every head has its own key and value
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        kw.pop("head_dim", None)
    kinds = {key: list(dict.fromkeys(defaults[key])) for key in ("layer_types", "mlp_layer_types")
             if isinstance(defaults.get(key), list)}  # fmt: skip
    n_layers = max([kw.get("num_hidden_layers", 2), *map(len, kinds.values())])
    for key, ks in kinds.items():
        kw[key] = (ks * n_layers)[:n_layers]
    if "num_hidden_layers" in kw:
        kw["num_hidden_layers"] = n_layers
    return AutoConfig.for_model(model_type, **{**kw, **TINY_OVERRIDES.get(model_type, {}), **overrides})
