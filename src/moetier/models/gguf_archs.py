"""The GGUF architectures moetier reads: one `GGUFArch` row each (models/gguf_meta.py), in `ARCHS`.

A row's config function turns the `<arch>.*` metadata (`Meta`) into the transformers config fields of the family
llama.cpp's converter wrote the file from, checking every size against the tensor that carries it; its tables
name the arch's GGUF tensors back as the transformers checkpoint names them (models/gguf_config.py applies them).
Values llama.cpp keeps as constants rather than metadata come back as those constants, each said where it is.
"""

from __future__ import annotations

from typing import Any

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from moetier.errors import CheckpointError
from moetier.formats.layout import ExpertSource
from moetier.models.gguf_meta import GGUFArch, Meta, partial_rope, rope_parameters

# names of the DeepSeek-style layers (deepseek2, and the families that copy its router and attention)
_MLA_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}  # fmt: skip
_EXP_PROBS_B = {"exp_probs_b.bias": "{blk}.gate.e_score_correction_bias"}


def _qwen3moe(m: Meta) -> dict[str, Any]:
    inter = m.expert_inter()
    blocks = m.moe_blocks()
    dense = [i for i in range(int(m.need("block_count"))) if i not in blocks]
    return dict(
        moe_intermediate_size=inter,
        intermediate_size=int(m.get("feed_forward_length", inter)),
        num_experts=int(m.need("expert_count")),
        decoder_sparse_step=1,
        mlp_only_layers=dense,
        attention_bias="blk.0.attn_q.bias" in m.tensors,
    )


def _qwen2moe(m: Meta) -> dict[str, Any]:
    cfg = _qwen3moe(m)
    del cfg["attention_bias"]
    blocks = m.moe_blocks()
    shared_name = f"blk.{blocks[0]}.ffn_up_shexp.weight"
    shared = m.shape(shared_name)[0] if shared_name in m.tensors else 0
    meta_shared = m.get("expert_shared_feed_forward_length", shared)
    if int(meta_shared) != shared:
        raise CheckpointError(
            f"{m.path}: tensor {shared_name!r} has {shared} rows, metadata "
            f"{m.arch}.expert_shared_feed_forward_length says {meta_shared}"
        )
    cfg.update(shared_expert_intermediate_size=shared, qkv_bias="blk.0.attn_q.bias" in m.tensors)
    return cfg


def _olmoe(m: Meta) -> dict[str, Any]:
    return dict(intermediate_size=m.expert_inter(), num_experts=int(m.need("expert_count")),
                attention_bias="blk.0.attn_q.bias" in m.tensors)  # fmt: skip


def _mixtral(m: Meta) -> dict[str, Any]:
    blocks = m.moe_blocks()
    if len(blocks) != int(m.need("block_count")):
        raise CheckpointError(f"{m.path}: a llama GGUF with experts in only some layers is not a Mixtral model")
    return dict(intermediate_size=m.expert_inter(), num_local_experts=int(m.need("expert_count")), sliding_window=None)


def _leading_dense(m: Meta) -> int:
    """`<arch>.leading_dense_block_count`, checked against the blocks that hold a router."""
    blocks = m.moe_blocks()
    n = int(m.get("leading_dense_block_count", 0))
    expect = list(range(n, int(m.need("block_count"))))
    if blocks != expect:
        raise CheckpointError(f"{m.path}: routers in blocks {blocks}, but {m.arch}.leading_dense_block_count {n} "
                              f"says {expect}")  # fmt: skip
    return n


def _deepseek2_variant(m: Meta) -> tuple[str, str]:
    """DeepSeek-V3 (and R1, Kimi-K2...) route by sigmoid with a score bias; V2 / V2.5 by softmax. llama.cpp's
    `expert_gating_func` says which (1 softmax, 2 sigmoid; absent: softmax, as llama.cpp reads old files)."""
    gating = int(m.get("expert_gating_func", 1))
    if gating not in (1, 2):
        raise CheckpointError(f"{m.path}: {m.arch}.expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    if gating == 2:
        return "deepseek_v3", "DeepseekV3ForCausalLM"
    if any(n.endswith(".exp_probs_b.bias") for n in m.tensors):
        raise CheckpointError(f"{m.path}: a softmax-routed deepseek2 model with expert score biases (exp_probs_b) has "
                              "no transformers counterpart")  # fmt: skip
    return "deepseek_v2", "DeepseekV2ForCausalLM"


def _deepseek2(m: Meta) -> dict[str, Any]:
    """MLA attention: llama.cpp writes it as MQA over the compressed kv (head_count_kv 1, key_length kv_lora + rope,
    value_length kv_lora) and the per-head sizes as `*_mla`; files from before that split carry kv_b whole and the
    per-head sizes as key_length / value_length."""
    heads = int(m.need("attention.head_count"))
    rope_dim = int(m.need("rope.dimension_count"))
    kv_lora = int(m.need("attention.kv_lora_rank"))
    key = int(m.get("attention.key_length_mla") or m.need("attention.key_length"))
    value = int(m.get("attention.value_length_mla") or m.need("attention.value_length"))
    n_group = int(m.get("expert_group_count", 1))
    q_lora = m.get("attention.q_lora_rank")
    cfg: dict[str, Any] = dict(
        num_key_value_heads=heads, head_dim=rope_dim, q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, qk_nope_head_dim=key - rope_dim, v_head_dim=value,
        intermediate_size=int(m.need("feed_forward_length")), moe_intermediate_size=m.expert_inter(),
        n_routed_experts=int(m.need("expert_count")), n_shared_experts=int(m.get("expert_shared_count", 0)),
        first_k_dense_replace=_leading_dense(m), n_group=n_group,
        topk_group=int(m.get("expert_group_used_count", n_group)), num_nextn_predict_layers=0,
    )  # fmt: skip
    if _deepseek2_variant(m)[0] == "deepseek_v2":
        cfg["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    return cfg


def _gptoss(m: Meta) -> dict[str, Any]:
    """GPT-OSS: llama.cpp keeps two things as constants rather than metadata, so they come back as its constants:
    sliding-window attention on even layers (transformers' default layer_types for the family) and the SwiGLU clamp
    7.0. YaRN's correction range is not truncated (`truncate` False, as every GPT-OSS config sets it)."""
    n = int(m.need("block_count"))
    rope = rope_parameters(m)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return dict(
        rope_parameters=rope, intermediate_size=m.expert_inter(), num_local_experts=int(m.need("expert_count")),
        sliding_window=int(m.need("attention.sliding_window")), swiglu_limit=7.0, attention_bias=True,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    )  # fmt: skip


_GPTOSS_SOURCES = {
    "gate": ExpertSource("experts.{e}.gate_proj.weight"), "up": ExpertSource("experts.{e}.up_proj.weight"),
    "down": ExpertSource("experts.{e}.down_proj.weight"), "gate_bias": ExpertSource("experts.{e}.gate_proj.bias"),
    "up_bias": ExpertSource("experts.{e}.up_proj.bias"), "down_bias": ExpertSource("experts.{e}.down_proj.bias"),
}  # fmt: skip
_GPTOSS_NAMES = {
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    "attn_sinks.weight": "self_attn.sinks", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
}  # fmt: skip


def _sigmoid_router(m: Meta) -> None:
    """Routers that transformers scores by sigmoid only (DeepSeek-V3's, with the score bias): llama.cpp's
    `expert_gating_func` must be 2 (sigmoid) or absent (glm4moe reads absent as sigmoid; dots1's converter writes it
    from the published configs' `scoring_func: sigmoid`, and transformers' dots1 has no other router)."""
    gating = m.get("expert_gating_func")
    if gating is not None and int(gating) != 2:
        raise CheckpointError(f"{m.path}: {m.arch}.expert_gating_func {gating} is not supported: transformers' "
                              f"{m.arch} router is sigmoid (2)")  # fmt: skip


def _v3_moe(m: Meta, n_layers: int) -> dict[str, Any]:
    """The DeepSeek-V3-style MoE of glm4moe and dots1 over the model's first `n_layers` blocks: leading dense blocks,
    routed experts of `expert_feed_forward_length`, `expert_shared_count` shared experts (one MLP of count times the
    expert size), sigmoid router with score bias and groups (absent: one group, as llama.cpp reads it)."""
    _sigmoid_router(m)
    blocks = [b for b in m.moe_blocks() if b < n_layers]
    dense = int(m.get("leading_dense_block_count", 0))
    if not blocks or blocks != list(range(dense, n_layers)):
        raise CheckpointError(f"{m.path}: routers in blocks {blocks}, but {m.arch}.leading_dense_block_count {dense} "
                              f"says {list(range(dense, n_layers))}")  # fmt: skip
    inter, experts = m.expert_inter(), int(m.need("expert_count"))
    n_shared = int(m.need("expert_shared_count"))
    name = f"blk.{blocks[0]}.ffn_up_shexp.weight"
    if n_shared < 1 or m.shape(name)[0] != n_shared * inter:
        raise CheckpointError(f"{m.path}: tensor {name!r} has shape {list(m.shape(name))}, {m.arch}."
                              f"expert_shared_count {n_shared} x expert_feed_forward_length {inter} says "
                              f"{n_shared * inter} rows")  # fmt: skip
    n_group = int(m.get("expert_group_count") or 1)
    topk_group = int(m.get("expert_group_used_count") or n_group)
    if experts % n_group or not 0 < topk_group <= n_group:
        raise CheckpointError(f"{m.path}: {m.arch}.expert_group_count {n_group} / expert_group_used_count "
                              f"{topk_group} do not divide {experts} experts")  # fmt: skip
    return dict(
        intermediate_size=int(m.get("feed_forward_length", inter)), moe_intermediate_size=inter,
        n_routed_experts=experts, n_shared_experts=n_shared, first_k_dense_replace=dense, n_group=n_group,
        topk_group=topk_group, attention_bias="blk.0.attn_q.bias" in m.tensors,
    )  # fmt: skip


def _glm4moe(m: Meta) -> dict[str, Any]:
    """GLM-4.5 / 4.6 / 4.7: partial RoPE (`rope.dimension_count` of the head), optional q/k norm, q/k/v bias. llama.cpp
    counts the `nextn_predict_layers` MTP blocks in block_count and writes them last (blk.L...: a decoder layer plus
    nextn.*): num_hidden_layers excludes them, and hf_locations skips them (transformers does not run them)."""
    n_layers, nextn = m.layers_and_nextn()
    heads, head_dim = int(m.need("attention.head_count")), m.head_dim()
    q_rows = m.shape("blk.0.attn_q.weight")[0]
    if q_rows != heads * head_dim:
        raise CheckpointError(f"{m.path}: tensor 'blk.0.attn_q.weight' has {q_rows} rows, {m.arch}.attention."
                              f"head_count {heads} x key_length {head_dim} says {heads * head_dim}")  # fmt: skip
    sections = m.metadata.get(f"{m.arch}.rope.dimension_sections")
    if sections is not None and any(int(x) for x in sections):
        raise CheckpointError(f"{m.path}: {m.arch}.rope.dimension_sections (GLM-4.xV's M-RoPE) is not supported")
    rope = partial_rope(m, head_dim)
    return dict(
        _v3_moe(m, n_layers), num_hidden_layers=n_layers, num_nextn_predict_layers=nextn, head_dim=head_dim,
        rope_parameters=rope, use_qk_norm="blk.0.attn_q_norm.weight" in m.tensors,
    )  # fmt: skip


def _dots1(m: Meta) -> dict[str, Any]:
    """dots.llm1: q/k norm, full RoPE, no sliding window in llama.cpp (every layer full attention)."""
    rope_dim = m.get("rope.dimension_count")
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", hidden // heads))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise CheckpointError(f"{m.path}: {m.arch}.rope.dimension_count {rope_dim} is not the head size {head_dim}")
    return dict(_v3_moe(m, int(m.need("block_count"))), sliding_window=None)


# seam families' checkpoint names (no family row: no {shared} fill)
_V3_SHARED = {f"ffn_{p}_shexp.weight": f"{{blk}}.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
_GLM4MOE_NAMES = {**_V3_SHARED, **_EXP_PROBS_B, "post_attention_norm.weight": "post_attention_layernorm.weight"}
_DOTS1_NAMES = {**_V3_SHARED, **_EXP_PROBS_B, "attn_output.bias": "self_attn.o_proj.bias"}


def _ernie45moe(m: Meta) -> dict[str, Any]:
    """ERNIE-4.5 MoE. MoE layers: from `leading_dense_block_count` on, every `interleave_moe_layer_step`-th (llama.cpp's
    rule: transformers' moe_layer_start_index / moe_layer_interval, the end index the last layer), checked against the
    blocks that hold a router. Router: softmax, top-k chosen on probability + exp_probs_b (transformers'
    moe_statics.e_score_correction_bias), weights renormalised (both do so always). Shared experts: one MLP of
    expert_shared_count x the expert size (transformers' moe_num_shared_experts; llama.cpp sizes it by
    expert_shared_feed_forward_length: both checked against the tensor). RoPE: interleaved in both, q/k as stored."""
    n = int(m.need("block_count"))
    inter = m.expert_inter()
    blocks = m.moe_blocks()
    start = int(m.get("leading_dense_block_count", 0))
    step = int(m.need("interleave_moe_layer_step"))
    expect = [i for i in range(n) if i >= start and step > 0 and (i + 1) % step == 0]
    if blocks != expect:
        raise CheckpointError(f"{m.path}: routers in blocks {blocks}, but {m.arch}.leading_dense_block_count {start} "
                              f"and {m.arch}.interleave_moe_layer_step {step} say {expect}")  # fmt: skip
    if "blk.0.attn_q.bias" in m.tensors:
        raise CheckpointError(f"{m.path}: an ernie4_5-moe model with biases (blk.0.attn_q.bias) is not supported")
    for b in blocks:  # llama.cpp reads a missing one as zeros; transformers' router always loads its own
        if f"blk.{b}.exp_probs_b.bias" not in m.tensors:
            raise CheckpointError(f"{m.path}: GGUF tensor 'blk.{b}.exp_probs_b.bias' is missing: transformers' "
                                  "ERNIE-4.5 router always has its expert score bias")  # fmt: skip
    name = f"blk.{blocks[0]}.ffn_up_shexp.weight"
    count = int(m.get("expert_shared_count", 0))
    rows = m.shape(name)[0] if count or name in m.tensors else 0
    if rows != count * inter:
        raise CheckpointError(f"{m.path}: tensor {name!r} has {rows} rows, but {m.arch}.expert_shared_count {count} "
                              f"shared experts of {inter} make {count * inter}")  # fmt: skip
    meta_rows = m.get("expert_shared_feed_forward_length")
    if count and meta_rows is not None and int(meta_rows) != rows:
        raise CheckpointError(f"{m.path}: tensor {name!r} has {rows} rows, metadata "
                              f"{m.arch}.expert_shared_feed_forward_length says {meta_rows}")  # fmt: skip
    ff = int(m.get("feed_forward_length", inter))
    dense = [i for i in range(n) if i not in blocks]
    if dense and m.shape(f"blk.{dense[0]}.ffn_up.weight")[0] != ff:
        raise CheckpointError(f"{m.path}: tensor 'blk.{dense[0]}.ffn_up.weight' has "
                              f"{m.shape(f'blk.{dense[0]}.ffn_up.weight')[0]} rows, {m.arch}.feed_forward_length says "
                              f"{ff}")  # fmt: skip
    return dict(
        intermediate_size=ff, moe_intermediate_size=inter, moe_num_experts=int(m.need("expert_count")),
        moe_num_shared_experts=count, moe_layer_start_index=start, moe_layer_interval=step,
        moe_layer_end_index=n - 1, use_bias=False,
    )  # fmt: skip


_ERNIE_NAMES = {
    "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def _hunyuanmoe(m: Meta) -> dict[str, Any]:
    """Hunyuan-A13B (HunYuanMoEV1): every layer is MoE plus a shared MLP, q and k RMS-normed after RoPE (both as in
    llama.cpp). transformers sizes the experts and the shared MLP alike by intermediate_size, so the tensors and
    llama.cpp's expert_feed_forward_length, expert_shared_feed_forward_length and feed_forward_length (by which
    llama.cpp sizes its experts) must agree. The converter folds Hunyuan's NTK-alpha RoPE into rope.freq_base (scaling
    type none): the default RoPE at that base, which is what transformers' ntk_alpha computes."""
    n = int(m.need("block_count"))
    blocks = m.moe_blocks()
    if blocks != list(range(n)):
        raise CheckpointError(f"{m.path}: routers in blocks {blocks}; every layer of a hunyuan-moe model is MoE")
    inter = m.expert_inter()
    shared = m.shape("blk.0.ffn_up_shexp.weight")[0]
    if shared != inter:
        raise CheckpointError(f"{m.path}: tensor 'blk.0.ffn_up_shexp.weight' has {shared} rows, the experts {inter}: "
                              "transformers' HunYuanMoEV1 sizes both by one intermediate_size")  # fmt: skip
    for key in ("expert_shared_feed_forward_length", "feed_forward_length"):
        v = m.get(key)
        if v is not None and int(v) != inter:
            raise CheckpointError(f"{m.path}: {m.arch}.{key} {v} differs from the experts' {inter} rows "
                                  "(tensor 'blk.0.ffn_gate_exps.weight')")  # fmt: skip
    m.shape("blk.0.attn_q_norm.weight"), m.shape("blk.0.attn_k_norm.weight")  # transformers always norms q and k
    return dict(intermediate_size=inter, num_experts=int(m.need("expert_count")),
                attention_bias="blk.0.attn_q.bias" in m.tensors)  # fmt: skip


_HUNYUAN_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.wg.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.query_layernorm.weight", "attn_k_norm.weight": "self_attn.key_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_mlp.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_mlp.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_mlp.down_proj.weight",
}  # fmt: skip
_QWEN_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")


def _granitemoe_variant(m: Meta) -> tuple[str, str]:
    """llama.cpp's converter writes Granite MoE and Granite MoE Shared (a shared MLP beside the experts) alike."""
    if any(n.endswith(".ffn_up_shexp.weight") for n in m.tensors):
        return "granitemoeshared", "GraniteMoeSharedForCausalLM"
    return "granitemoe", "GraniteMoeForCausalLM"


def _granitemoe(m: Meta) -> dict[str, Any]:
    """Granite 3.x MoE (and MoE Shared): every layer MoE, top-k router renormalised (softmax of the k logits), q/k
    rows permuted by the converter (llama's interleaved RoPE; un-permuted on read), heads of hidden / head_count, and
    Granite's multipliers from llama.cpp's keys, read as llama.cpp reads them: attention.scale (absent or 0:
    1/sqrt(head dim)), embedding_scale and residual_scale (absent or 0: not applied, 1), logit_scale (required)."""
    n = int(m.need("block_count"))
    if m.moe_blocks() != list(range(n)):
        raise CheckpointError(f"{m.path}: routers in blocks {m.moe_blocks()}; every layer of a granitemoe model is MoE")
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = hidden // heads
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        v = m.get(key)
        if v is not None and int(v) != head_dim:
            raise CheckpointError(f"{m.path}: {m.arch}.{key} {v} is not hidden / head_count = {head_dim}, the head "
                                  "size transformers' Granite MoE uses")  # fmt: skip
    if any(n.startswith("blk.0.attn_") and n.endswith(".bias") for n in m.tensors):
        raise CheckpointError(f"{m.path}: a granitemoe model with attention biases (blk.0.attn_*.bias) is not "
                              "supported (the converter permutes the q/k bias rows too)")  # fmt: skip
    gating, norm = m.get("expert_gating_func"), m.get("expert_weights_norm")
    if (gating is not None and int(gating) != 1) or (norm is not None and not bool(norm)):
        key = "expert_gating_func" if gating is not None and int(gating) != 1 else "expert_weights_norm"
        raise CheckpointError(f"{m.path}: {m.arch}.{key} {m.get(key)}: transformers' Granite MoE router is a softmax "
                              "of the top-k logits (gating 1, weights normalised)")  # fmt: skip
    cfg: dict[str, Any] = dict(
        intermediate_size=m.expert_inter(), num_local_experts=int(m.need("expert_count")), attention_bias=False,
        attention_multiplier=float(m.get("attention.scale") or 0.0) or head_dim**-0.5,
        embedding_multiplier=float(m.get("embedding_scale") or 1.0),
        residual_multiplier=float(m.get("residual_scale") or 1.0), logits_scaling=float(m.need("logit_scale")),
    )  # fmt: skip
    shared = [n for n in m.tensors if n.endswith(".ffn_up_shexp.weight")]
    if shared:
        rows = m.shape(shared[0])[0]
        meta = m.get("expert_shared_feed_forward_length")
        if meta is None or int(meta) != rows:
            raise CheckpointError(f"{m.path}: tensor {shared[0]!r} has {rows} rows, metadata "
                                  f"{m.arch}.expert_shared_feed_forward_length says {meta}")  # fmt: skip
        cfg["shared_intermediate_size"] = rows
    return cfg


def _granite_converters() -> tuple[WeightConverter, ...]:
    """Granite's checkpoint fuses what llama.cpp stores apart: each layer's experts (input_linear [E, 2I, H], gate rows
    first, and output_linear) and the shared MLP's input_linear [2S, H] (gate rows first). The GGUF index names the
    pieces per expert and per projection, names no Granite checkpoint has; these converters (transformers' own ops)
    say how they fuse, so the seam reads the experts per expert and concatenates the shared MLP at load."""
    e = "block_sparse_moe.experts"
    return (
        WeightConverter([f"{e}.*.gate_proj.weight", f"{e}.*.up_proj.weight"], f"{e}.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(f"{e}.*.down_proj.weight", f"{e}.down_proj", operations=[MergeModulelist(dim=0)]),
        WeightConverter(["shared_mlp.gate_proj.weight", "shared_mlp.up_proj.weight"], "shared_mlp.input_linear.weight",
                        operations=[Concatenate(dim=0)]),
    )  # fmt: skip


_GRANITE_NAMES = {
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_gate_shexp.weight": "shared_mlp.gate_proj.weight", "ffn_up_shexp.weight": "shared_mlp.up_proj.weight",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
}  # fmt: skip


def _bailingmoe2(m: Meta) -> dict[str, Any]:
    """Ling / Ring 2.0 (BailingMoeV2) and Sarvam-MoE, which llama.cpp's converter writes alike, as transformers'
    sarvam_moe (its GLM-4.5 modules): q|k|v fused (attn_qkv: the Sarvam checkpoint's query_key_value, split at load
    by transformers' own rule), q/k RMS norm, rotate-half RoPE over the first `rope.dimension_count` of each head
    (Ling: half, Sarvam: all), the DeepSeek-V3-style MoE (_v3_moe), and `nextn_predict_layers` MTP blocks written
    last, skipped. The converter zero-means Sarvam's score bias: a shift common to every expert, the same top-k."""
    n_layers, nextn = m.layers_and_nextn()
    heads, head_dim = int(m.need("attention.head_count")), m.head_dim()
    kv_heads = int(m.get("attention.head_count_kv", heads))
    qkv = m.shape("blk.0.attn_qkv.weight")
    if qkv[0] != (heads + 2 * kv_heads) * head_dim:
        raise CheckpointError(f"{m.path}: tensor 'blk.0.attn_qkv.weight' has shape {list(qkv)}, {m.arch}.attention"
                              f".head_count {heads} + 2 x head_count_kv {kv_heads} heads of {head_dim} say "
                              "otherwise")  # fmt: skip
    m.shape("blk.0.attn_q_norm.weight"), m.shape("blk.0.attn_k_norm.weight")  # both norm q and k always
    rope = partial_rope(m, head_dim)
    return dict(
        _v3_moe(m, n_layers), num_hidden_layers=n_layers, num_nextn_predict_layers=nextn, head_dim=head_dim,
        rope_parameters=rope, use_qk_norm=True, attention_bias=False,
    )  # fmt: skip


_BAILING2_NAMES = {**_V3_SHARED, **_EXP_PROBS_B, "attn_qkv.weight": "attention.query_key_value.weight"}
# llama.cpp architectures of models transformers has no family for (refused, saying so)
NO_TRANSFORMERS_FAMILY = {
    "bailingmoe": "Ling / Ring 1.x (BailingMoeForCausalLM, remote code only)",
}


def _llama4(m: Meta) -> dict[str, Any]:
    """Llama-4 (Scout, Maverick): llama.cpp keeps its attention layout as constants rather than metadata, so they come
    back as its constants, which are also transformers' defaults: chunked attention (chunks of 8192) with RoPE on
    three layers of four and full attention without RoPE on the fourth, attention temperature tuning (scale 0.1,
    floor 8192), and the q/k L2 norm except on 128-expert models (Maverick). MoE on every
    `interleave_moe_layer_step`-th layer, checked against the blocks that hold a router."""
    n, step = int(m.need("block_count")), int(m.need("interleave_moe_layer_step"))
    blocks = m.moe_blocks()
    expect = [i for i in range(n) if step > 0 and (i + 1) % step == 0]
    if blocks != expect:
        raise CheckpointError(f"{m.path}: routers in blocks {blocks}, but {m.arch}.interleave_moe_layer_step {step} "
                              f"says {expect}")  # fmt: skip
    if m.get("attention.sliding_window") == 0:
        raise CheckpointError(f"{m.path}: {m.arch}.attention.sliding_window 0 (no chunked attention, RoPE on every "
                              "layer: a MobileLLM-style file) has no transformers Llama-4 counterpart")  # fmt: skip
    experts = int(m.need("expert_count"))
    return dict(
        intermediate_size=m.expert_inter(), intermediate_size_mlp=int(m.need("feed_forward_length")),
        num_local_experts=experts, interleave_moe_layer_step=step, moe_layers=None, no_rope_layers=None,
        layer_types=None, attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
        use_qk_norm=experts != 128,
    )  # fmt: skip


_LLAMA4_SOURCES = {
    "gate": ExpertSource("experts.{e}.gate_proj.weight"), "up": ExpertSource("experts.{e}.up_proj.weight"),
    "down": ExpertSource("experts.{e}.down_proj.weight"),
}  # fmt: skip
_LLAMA4_NAMES = {
    "ffn_gate_inp.weight": "feed_forward.router.weight", "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight", "ffn_down.weight": "feed_forward.down_proj.weight",
}  # fmt: skip


def _qwen3next(m: Meta) -> dict[str, Any]:
    """Qwen3-Next (Qwen3NextForCausalLM): gated DeltaNet linear attention on the layers `attention.recurrent_layers`
    marks (files without the list: all but every `full_attention_interval`-th, llama.cpp's rule, default 4), gated
    full attention on the others (q_proj holds each head's query and gate) with q/k norm and RoPE over the first
    `rope.dimension_count` of each head, MoE with a sigmoid-gated shared expert (softmax router, top-k renormalised:
    llama.cpp's constants), and `nextn_predict_layers` MTP blocks written last, skipped. DeltaNet sizes: key heads
    `ssm.group_count` of `ssm.state_size`, value heads `ssm.time_step_rank` of `ssm.inner_size` / that, conv kernel
    `ssm.conv_kernel`, each checked against the first linear layer's tensors."""
    n, nextn = m.layers_and_nextn()
    blocks = n + nextn
    if nextn and "blk.0.attn_norm.weight" not in m.tensors:
        raise CheckpointError(f"{m.path}: an MTP-only qwen3next file (no blk.0.attn_norm.weight: convert_hf_to_gguf "
                              "--mtp) has no decoder layers to run")  # fmt: skip
    for key, want in (("expert_gating_func", 1), ("expert_weights_norm", True)):
        v = m.get(key)
        if v is not None and (bool(v) if key == "expert_weights_norm" else int(v)) != want:
            raise CheckpointError(f"{m.path}: {m.arch}.{key} {v}: llama.cpp and transformers' Qwen3-Next route by a "
                                  "softmax, top-k renormalised (gating 1, weights normalised)")  # fmt: skip
    recurrent = m.metadata.get(f"{m.arch}.attention.recurrent_layers")
    if recurrent is not None:
        linear = [bool(x) for x in (recurrent.tolist() if hasattr(recurrent, "tolist") else recurrent)]
        if len(linear) != blocks or any(linear[n:]):
            raise CheckpointError(f"{m.path}: {m.arch}.attention.recurrent_layers {linear} is not one flag per block "
                                  f"of {blocks} with the MTP blocks full attention")  # fmt: skip
        linear, source = linear[:n], "attention.recurrent_layers"
    else:
        interval = int(m.get("full_attention_interval", 4))
        if interval < 1:
            raise CheckpointError(f"{m.path}: {m.arch}.full_attention_interval {interval} is not supported")
        linear, source = [(i + 1) % interval != 0 for i in range(n)], "full_attention_interval"
    for i, lin in enumerate(linear):
        name = f"blk.{i}.ssm_a" if lin else f"blk.{i}.attn_q.weight"
        if name not in m.tensors:
            kind = "linear" if lin else "full"
            raise CheckpointError(f"{m.path}: {m.arch}.{source} makes block {i} {kind} attention, but tensor "
                                  f"{name!r} is missing")  # fmt: skip
    hidden, heads, head_dim = int(m.need("embedding_length")), int(m.need("attention.head_count")), m.head_dim()
    kv_heads = int(m.get("attention.head_count_kv", heads))
    full = [i for i, lin in enumerate(linear) if not lin]
    for part, rows in (("q", 2 * heads * head_dim), ("k", kv_heads * head_dim)) if full else ():
        name = f"blk.{full[0]}.attn_{part}.weight"
        if m.shape(name)[0] != rows:
            raise CheckpointError(f"{m.path}: tensor {name!r} has {m.shape(name)[0]} rows, {m.arch}.attention."
                                  f"head_count(_kv) and key_length {head_dim} say {rows}"
                                  + (" (query and gate per head)" if part == "q" else ""))  # fmt: skip
    rope = partial_rope(m, head_dim)
    kernel, hk = int(m.need("ssm.conv_kernel")), int(m.need("ssm.state_size"))
    nk, nv, inner = int(m.need("ssm.group_count")), int(m.need("ssm.time_step_rank")), int(m.need("ssm.inner_size"))
    if nk < 1 or nv % nk or inner % nv:
        raise CheckpointError(f"{m.path}: {m.arch}.ssm.time_step_rank {nv} value heads are not whole groups of "
                              f"ssm.group_count {nk} key heads with ssm.inner_size {inner} split evenly")  # fmt: skip
    if any(linear):
        b = f"blk.{linear.index(True)}."
        legacy = b + "ssm_in.weight" in m.tensors  # older files: in_proj_qkvz whole, as stored
        sizes = {b + "ssm_conv1d.weight": (2 * nk * hk + inner, kernel), b + "ssm_ba.weight": (2 * nv, hidden),
                 b + "ssm_a": (nv,), b + "ssm_dt.bias": (nv,), b + "ssm_norm.weight": (inner // nv,),
                 **({b + "ssm_in.weight": (2 * nk * hk + 2 * inner, hidden)} if legacy else
                    {b + "attn_qkv.weight": (2 * nk * hk + inner, hidden), b + "attn_gate.weight": (inner, hidden)})}
        for name, shape in sizes.items():
            if tuple(m.shape(name)) != shape:
                raise CheckpointError(f"{m.path}: tensor {name!r} has shape {list(m.shape(name))}, the {m.arch}.ssm.* "
                                      f"sizes say {list(shape)}")  # fmt: skip
    inter, routers = m.expert_inter(), [b for b in m.moe_blocks() if b < n]
    if routers != list(range(n)):  # (llama.cpp's loader and converter know no dense Qwen3-Next layer)
        raise CheckpointError(f"{m.path}: routers in blocks {routers}; every layer of a qwen3next model is MoE")
    name = "blk.0.ffn_up_shexp.weight"
    shared = m.shape(name)[0]  # transformers' Qwen3-Next always has the shared expert (and its gate)
    meta_shared = m.get("expert_shared_feed_forward_length", shared)
    if int(meta_shared) != shared:
        raise CheckpointError(f"{m.path}: tensor {name!r} has {shared} rows, metadata "
                              f"{m.arch}.expert_shared_feed_forward_length says {meta_shared}")  # fmt: skip
    m.shape("blk.0.ffn_gate_inp_shexp.weight")
    return dict(
        num_hidden_layers=n, num_nextn_predict_layers=nextn, head_dim=head_dim, rope_parameters=rope,
        layer_types=["linear_attention" if lin else "full_attention" for lin in linear],
        linear_conv_kernel_dim=kernel, linear_key_head_dim=hk, linear_value_head_dim=inner // nv,
        linear_num_key_heads=nk, linear_num_value_heads=nv, num_experts=int(m.need("expert_count")),
        moe_intermediate_size=inter, shared_expert_intermediate_size=shared,
        intermediate_size=int(m.get("feed_forward_length", inter)), decoder_sparse_step=1, mlp_only_layers=[],
        attention_bias=bool(full) and f"blk.{full[0]}.attn_q.bias" in m.tensors,
    )  # fmt: skip


_QWEN3NEXT_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",  # older files: in_proj_qkvz whole, as stored
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}  # fmt: skip
# Qwen3NextModel (llama.cpp's converter) writes every zero-centred RMSNorm weight plus 1 (not the DeltaNet's gated
# norm, ssm_norm) and A_log as -exp(A_log)
_QWEN3NEXT_DECODE = {**dict.fromkeys(("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                                      "attn_k_norm.weight", "output_norm.weight"), "minus_one"),
                     "ssm_a": "log_neg"}  # fmt: skip
# in_proj_qkvz as llama.cpp's converter splits it (per key head q, k, v, z -> all q, all k, all v; all z)
QWEN3NEXT_QKVZ = ("attn_qkv.weight", "attn_gate.weight")


ARCHS: dict[str, GGUFArch] = {
    a.gguf_arch: a
    for a in (
        GGUFArch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe, norm_topk_default=True),
        GGUFArch("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", _qwen2moe),
        GGUFArch("olmoe", "olmoe", "OlmoeForCausalLM", _olmoe),
        GGUFArch("llama", "mixtral", "MixtralForCausalLM", _mixtral, unpermute_qk=True, norm_topk_default=True),
        GGUFArch("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM", _deepseek2, names={**_MLA_NAMES, **_EXP_PROBS_B},
                 scale_attr="routed_scaling_factor", variant=_deepseek2_variant, yarn_mscale=True),
        GGUFArch("ernie4_5-moe", "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", _ernie45moe, norm_topk_default=True,
                 names=_ERNIE_NAMES, experts=_QWEN_EXPERTS, row_vectors=frozenset({"exp_probs_b.bias"})),
        GGUFArch("hunyuan-moe", "hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", _hunyuanmoe, norm_topk_default=True,
                 names=_HUNYUAN_NAMES, experts=_QWEN_EXPERTS),
        GGUFArch("gpt-oss", "gpt_oss", "GptOssForCausalLM", _gptoss, names=_GPTOSS_NAMES, sources=_GPTOSS_SOURCES),
        GGUFArch("llama4", "llama4_text", "Llama4ForCausalLM", _llama4, names=_LLAMA4_NAMES, sources=_LLAMA4_SOURCES),
        GGUFArch("glm4moe", "glm4_moe", "Glm4MoeForCausalLM", _glm4moe, names=_GLM4MOE_NAMES,
                 scale_attr="routed_scaling_factor", experts=_QWEN_EXPERTS),
        GGUFArch("dots1", "dots1", "Dots1ForCausalLM", _dots1, names=_DOTS1_NAMES, scale_attr="routed_scaling_factor",
                 experts=_QWEN_EXPERTS),
        GGUFArch("granitemoe", "granitemoe", "GraniteMoeForCausalLM", _granitemoe, unpermute_qk=True,
                 variant=_granitemoe_variant, names=_GRANITE_NAMES, converters=_granite_converters,
                 experts=("block_sparse_moe", "gate_proj", "up_proj", "down_proj")),
        GGUFArch("bailingmoe2", "sarvam_moe", "Glm4MoeForCausalLM", _bailingmoe2, names=_BAILING2_NAMES,
                 scale_attr="routed_scaling_factor", experts=_QWEN_EXPERTS),
        GGUFArch("qwen3next", "qwen3_next", "Qwen3NextForCausalLM", _qwen3next, norm_topk_default=True,
                 names=_QWEN3NEXT_NAMES, experts=_QWEN_EXPERTS, decode=_QWEN3NEXT_DECODE),
    )
}
