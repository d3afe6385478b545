"""GGUF models (models/gguf_config.py): config from metadata, names, and logits against transformers.

GGUF files are written here from tiny random checkpoints (tests/gguf_ref.py, no llama.cpp); the reference
is transformers on a twin checkpoint holding the values the GGUF file decodes to (numpy reference), so
every block type is held to the fp32 bound: max |logits - reference| <= 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import moetier
from gguf_ref import dequantized_twin, tiny_checkpoint, write_gguf
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import CheckpointError, UnknownArchitectureError
from moetier.formats.codecs import CODECS
from moetier.formats.gguf import read_gguf
from moetier.models.gguf_config import open_gguf
from moetier.models.open import describe, read_config
from moetier.models.tiny import build_tiny_checkpoint

RUNTIME = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe", "dots1",
            "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "granitemoeshared", "sarvam_moe", "llama4_text",
            "qwen3_next")
BOUND = 1e-4


def _overrides(family: str, qtype: str) -> dict[str, Any]:
    """K-quants need rows of 256 weights: hidden and expert sizes 256 (and the shared expert's); quantised MLA
    files get k_b / v_b rows of whole 32-blocks (kv_lora and nope 32), so both halves of kv_b are block types."""
    if family.startswith("deepseek") and qtype != "F32":
        return {"kv_lora_rank": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}
    if not qtype.endswith("_K"):
        return {}
    out: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 256}
    if family in ("qwen3_moe", "qwen2_moe"):
        out["moe_intermediate_size"] = 256
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = 256
    return out


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory):
    """gguf_model(family, qtype) -> (src folder, GGUF file, dequantised twin folder), built once."""
    root = tmp_path_factory.mktemp("gguf_models")
    cache: dict[tuple[str, str], tuple[Path, Path, Path]] = {}

    def get(family: str, qtype: str) -> tuple[Path, Path, Path]:
        if (family, qtype) not in cache:
            src = tiny_checkpoint(family, root / f"{family}_{qtype}_src", **_overrides(family, qtype))
            g = write_gguf(src, root / f"{family}_{qtype}.gguf", family, qtype)
            cache[(family, qtype)] = (src, g, dequantized_twin(src, root / f"{family}_{qtype}_twin", family, qtype))
        return cache[(family, qtype)]

    return get


def _logits_diff(path: Path, ref_folder: Path, vocab: int = 96) -> float:
    ids = torch.randint(3, vocab, (1, 14), generator=torch.Generator().manual_seed(4))
    ref = AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids).logits
    engine = moetier.load(path, EngineConfig(runtime=RUNTIME))
    try:
        got = engine.logits(ids)
    finally:
        engine.close()
    assert want.abs().max().item() > 0.1  # non-trivial logits
    return float((got - want).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_matches_transformers_on_the_source_checkpoint(gguf_model, family):
    src, g, _ = gguf_model(family, "F32")
    assert _logits_diff(g, src) <= BOUND


@pytest.mark.parametrize(("family", "qtype"), [
    ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_K"), ("qwen3_moe", "Q6_K"), ("qwen3_moe", "Q5_0"),
    ("mixtral", "Q4_K"), ("mixtral", "Q8_0"), ("qwen2_moe", "Q5_K"), ("olmoe", "Q4_1"), ("olmoe", "Q3_K"),
    ("qwen2_moe", "Q2_K"), ("mixtral", "Q5_1"), ("qwen3_moe", "Q4_0"), ("deepseek_v3", "Q8_0"),
    ("deepseek_v2", "Q4_0"), ("gpt_oss", "MXFP4"), ("glm4_moe", "Q8_0"), ("dots1", "Q5_1"), ("llama4_text", "Q8_0"),
    ("ernie4_5_moe", "Q5_0"), ("hunyuan_v1_moe", "Q4_1"),
    ("granitemoe", "Q8_0"), ("granitemoeshared", "Q4_0"), ("sarvam_moe", "Q8_0"), ("qwen3_next", "Q4_0"),
])  # fmt: skip
def test_quantised_gguf_matches_its_dequantised_twin(gguf_model, family, qtype):
    _, g, twin = gguf_model(family, qtype)
    assert _logits_diff(g, twin) <= BOUND


def test_q8_0_stays_near_the_unquantised_model(gguf_model):
    """The stated loose bound for a real quantisation (Q8_0 of the tiny model, logits of magnitude ~4)."""
    src, g, _ = gguf_model("qwen3_moe", "Q8_0")
    assert _logits_diff(g, src) <= 0.2


def test_config_and_index_names(gguf_model):
    _, g, _ = gguf_model("qwen2_moe", "Q8_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "qwen2_moe" and cfg.architectures == ["Qwen2MoeForCausalLM"]
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (32, 16, 24)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == (6, 2, 2)
    assert cfg.qkv_bias and not cfg.norm_topk_prob and not cfg.tie_word_embeddings
    idx = ck.index
    loc = idx["model.layers.1.mlp.experts.5.gate_proj.weight"]
    assert loc.shape == (16, 32) and loc.dtype == "gguf:Q8_0"
    assert idx["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert "lm_head.weight" in idx and idx.folder == g.parent
    config, family = read_config(g)
    assert family is not None and family.name == "qwen2_moe" and config is cfg
    info = describe(g)
    assert info.num_experts == 6 and info.checkpoint_dtype == "gguf:Q8_0"
    mixtral = open_gguf(gguf_model("mixtral", "Q8_0")[1])
    assert mixtral.config.model_type == "mixtral" and mixtral.config.norm_topk_prob
    assert mixtral.index["model.layers.0.self_attn.q_proj.weight"].dtype == "gguf:Q8_0+unpermute"
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in mixtral.index


def test_tokenizer_from_metadata(tmp_path):
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src", vocab_size=4096)
    g = write_gguf(src, tmp_path / "tok.gguf", "qwen3_moe", tokenizer=True)
    ref = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe")
    tok = open_gguf(g).tokenizer()
    text = "To be, or not to be: that is the question.\nWhether 'tis nobler"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    engine = moetier.load(g, EngineConfig(runtime=RUNTIME))
    try:
        assert engine.encode(text) == ref.encode(text, add_special_tokens=False)
    finally:
        engine.close()


def test_metadata_that_contradicts_a_tensor_names_both(tmp_path):
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    g = write_gguf(src, tmp_path / "bad.gguf", "qwen3_moe", meta={"expert_feed_forward_length": 24})
    with pytest.raises(CheckpointError) as err:
        open_gguf(g)
    msg = str(err.value)
    assert str(g) in msg and "blk.0.ffn_gate_exps.weight" in msg and "expert_feed_forward_length" in msg
    g2 = write_gguf(src, tmp_path / "bad2.gguf", "qwen3_moe", meta={"embedding_length": 64})
    with pytest.raises(CheckpointError, match=r"token_embd\.weight"):
        open_gguf(g2)
    g3 = write_gguf(src, tmp_path / "bad3.gguf", "qwen3_moe", meta={"expert_count": 8})
    with pytest.raises(CheckpointError, match=r"ffn_\w+_exps.weight' has shape \[6, "):
        open_gguf(g3)
    g4 = write_gguf(src, tmp_path / "bad4.gguf", "qwen3_moe", skip_meta=("expert_used_count",))
    with pytest.raises(CheckpointError, match=r"lacks qwen3moe\.expert_used_count"):
        open_gguf(g4)


def test_unknown_gguf_architecture(gguf_model, tmp_path):
    _, g, _ = gguf_model("qwen3_moe", "F32")
    data = g.read_bytes().replace(b"qwen3moe", b"qwen9moe")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(data)
    with pytest.raises(UnknownArchitectureError, match="'qwen9moe' is not supported"):
        open_gguf(bad)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0}  # fmt: skip


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """rope.scaling.type yarn (as llama.cpp's converter writes a checkpoint's rope_scaling) -> transformers' YaRN:
    the same logits as transformers on the source checkpoint, which carries the same rope parameters."""
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src", rope_parameters=YARN, max_position_embeddings=64)
    meta = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
            "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_beta_slow": 2.0}  # fmt: skip
    g = write_gguf(src, tmp_path / "m.gguf", "qwen3_moe", meta=meta)
    cfg = open_gguf(g).config
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0
    assert cfg.rope_parameters["original_max_position_embeddings"] == 16
    assert _logits_diff(g, src) <= BOUND
    plain = write_gguf(src, tmp_path / "plain.gguf", "qwen3_moe")  # the same weights without the scaling keys
    assert _logits_diff(plain, src) > 10 * BOUND  # so the scaling is what makes them agree


@pytest.mark.parametrize(("meta", "names"), [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "longrope"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
      "rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "original_context_length"),
])  # fmt: skip
def test_rope_keys_without_a_transformers_counterpart_are_refused(tmp_path, meta, names):
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    g = write_gguf(src, tmp_path / "m.gguf", "qwen3_moe", meta=meta)
    with pytest.raises(CheckpointError, match=names):
        open_gguf(g)


def test_deepseek2_config_mla_and_router(gguf_model):
    """llama.cpp's deepseek2 arch: MLA sizes from the *_mla keys (head_count_kv 1 is its MQA view), the router
    variant from expert_gating_func, k_b / v_b merged back into kv_b_proj, the score bias and routed scale."""
    _, g, _ = gguf_model("deepseek_v3", "Q8_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "deepseek_v3" and cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert (cfg.num_key_value_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (4, 16, 32)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 8, 32)
    assert (cfg.first_k_dense_replace, cfg.n_routed_experts, cfg.n_shared_experts) == (1, 8, 1)
    assert (cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group) == (2.5, 2, 1)
    kv = ck.index["model.layers.1.self_attn.kv_b_proj.weight"]
    assert kv.dtype == "mla_kv_b" and kv.shape == (4 * 64, 32)
    assert [p.dtype for p in kv.parts] == ["gguf:Q8_0", "gguf:Q8_0"]  # both halves are blocks, decoded, then merged
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in ck.index
    assert "model.layers.0.mlp.gate_proj.weight" in ck.index  # the leading dense layer
    v2 = open_gguf(gguf_model("deepseek_v2", "F32")[1]).config
    assert v2.model_type == "deepseek_v2" and v2.q_lora_rank is None and v2.topk_method == "group_limited_greedy"
    assert v2.routed_scaling_factor == 1.5


def test_deepseek2_yarn_log_multiplier_is_mscale(tmp_path):
    src = build_tiny_checkpoint("deepseek_v2", tmp_path / "src")
    meta = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
            "rope.scaling.yarn_log_multiplier": 0.0707}  # fmt: skip
    rope = open_gguf(write_gguf(src, tmp_path / "y.gguf", "deepseek_v2", meta=meta)).config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["mscale"] == pytest.approx(0.707) and rope["mscale_all_dim"] == pytest.approx(0.707)
    qwen = build_tiny_checkpoint("qwen3_moe", tmp_path / "q")
    with pytest.raises(CheckpointError, match="yarn_log_multiplier"):  # only DeepSeek's converter means mscale by it
        open_gguf(write_gguf(qwen, tmp_path / "q.gguf", "qwen3_moe", meta=meta))


def test_deepseek2_damaged_files_are_refused(tmp_path):
    import gguf as gguf_py

    src = build_tiny_checkpoint("deepseek_v3", tmp_path / "src")
    with pytest.raises(CheckpointError, match="expert_gating_func 3"):
        open_gguf(write_gguf(src, tmp_path / "g.gguf", "deepseek_v3", meta={"expert_gating_func": 3}))
    with pytest.raises(CheckpointError, match="softmax-routed"):  # a V3 router bias without V3's sigmoid
        open_gguf(write_gguf(src, tmp_path / "s.gguf", "deepseek_v3", meta={"expert_gating_func": 1}))
    with pytest.raises(CheckpointError, match="leading_dense_block_count"):
        open_gguf(write_gguf(src, tmp_path / "d.gguf", "deepseek_v3", meta={"leading_dense_block_count": 2}))
    with pytest.raises(CheckpointError, match=r"attn_k_b\.weight' has shape"):  # MLA sizes that do not fit k_b
        open_gguf(write_gguf(src, tmp_path / "m.gguf", "deepseek_v3", meta={"attention.key_length_mla": 20}))
    # a file that lost one half of an MLA pair
    g = write_gguf(src, tmp_path / "ok.gguf", "deepseek_v3")
    r = gguf_py.GGUFReader(str(g))
    w = gguf_py.GGUFWriter(str(tmp_path / "half.gguf"), "deepseek2")
    for f in r.fields.values():
        if f.name.startswith("deepseek2.") and f.types and f.types[0] in (gguf_py.GGUFValueType.UINT32,
                                                                          gguf_py.GGUFValueType.FLOAT32):
            val = f.parts[f.data[0]][0]
            (w.add_uint32 if f.types[0] == gguf_py.GGUFValueType.UINT32 else w.add_float32)(f.name, val.item())
    for t in r.tensors:
        if t.name != "blk.1.attn_v_b.weight":
            w.add_tensor(t.name, t.data.reshape([int(x) for x in reversed(t.shape)]), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"blk\.1\.attn_v_b\.weight is missing"):
        open_gguf(tmp_path / "half.gguf")


def test_gpt_oss_config_and_split_experts(gguf_model):
    """llama.cpp's gpt-oss: gate and up written apart (from the fused, interleaved gate_up_proj), each with its
    bias; sliding windows on even layers and the SwiGLU clamp are llama.cpp constants; YaRN is not truncated."""
    _, g, _ = gguf_model("gpt_oss", "MXFP4")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "gpt_oss" and cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.swiglu_limit == 7.0 and cfg.sliding_window == 8 and cfg.rope_parameters["truncate"] is False
    assert ck.index["model.layers.1.mlp.experts.4.up_proj.weight"].dtype == "gguf:MXFP4"
    assert ck.index["model.layers.1.mlp.experts.4.up_proj.bias"].shape == (16,)
    assert "model.layers.0.self_attn.sinks" in ck.index and "model.layers.0.mlp.router.bias" in ck.index
    assert ck.family is not None and ck.family.sources["gate"].tensor == "experts.{e}.gate_proj.weight"


def test_glm4moe_config_names_and_nextn_blocks(gguf_model):
    """llama.cpp's glm4moe (GLM-4.5 / 4.6 / 4.7, a seam family): partial RoPE from rope.dimension_count, q/k/v bias,
    q/k norm, sigmoid router with score bias, groups and routed scale, a leading dense block; the MTP layer written as
    block 2 (block_count 3, nextn_predict_layers 1) is skipped on purpose, not taken for a layer."""
    _, g, _ = gguf_model("glm4_moe", "Q8_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "glm4_moe" and cfg.architectures == ["Glm4MoeForCausalLM"] and ck.family is None
    assert ck.metadata["glm4moe.block_count"] == 3 and "blk.2.nextn.eh_proj.weight" in read_gguf(g).tensors
    assert (cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.head_dim) == (2, 1, 16)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5 and cfg.use_qk_norm and cfg.attention_bias
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.first_k_dense_replace) == (6, 1, 1)
    assert (cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == (2.5, 2, 1, True)
    idx = ck.index
    assert idx["model.layers.1.mlp.experts.5.gate_proj.weight"].shape == (16, 32)
    assert idx["model.layers.1.self_attn.q_proj.weight"].dtype == "gguf:Q8_0"
    for name in ("mlp.shared_experts.up_proj.weight", "mlp.gate.e_score_correction_bias",
                 "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.v_proj.bias"):
        assert f"model.layers.1.{name}" in idx
    assert not any(n.startswith("model.layers.2.") for n in idx.names())


def test_dots1_config_and_names(gguf_model):
    """llama.cpp's dots1 (dots.llm1, a seam family): q/k norm, the DeepSeek-V3 router, two shared experts as one MLP
    of twice the expert size, every layer full attention (llama.cpp has no sliding window for it)."""
    _, g, _ = gguf_model("dots1", "Q5_1")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "dots1" and cfg.architectures == ["Dots1ForCausalLM"] and ck.family is None
    assert cfg.sliding_window is None and cfg.layer_types == ["full_attention", "full_attention"]
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.moe_intermediate_size) == (6, 2, 16)
    assert (cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == (2.5, 2, 1, True)
    assert ck.index["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, 32)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in ck.index
    assert "model.layers.0.mlp.gate_proj.weight" in ck.index  # the leading dense layer


@pytest.mark.parametrize(("family", "meta", "skip", "names"), [
    ("glm4_moe", {"expert_gating_func": 1}, (), "expert_gating_func 1"),
    ("dots1", {"expert_gating_func": 3}, (), "expert_gating_func 3"),
    ("glm4_moe", {"rope.dimension_count": 5}, (), "rope.dimension_count 5"),
    ("glm4_moe", {"nextn_predict_layers": 3}, (), "nextn_predict_layers 3"),
    ("glm4_moe", {}, ("nextn_predict_layers",), r"'blk\.2\.nextn\.\w+\.weight' has no"),  # undeclared MTP
    ("glm4_moe", {"expert_shared_count": 2}, (), r"ffn_up_shexp\.weight.*expert_shared_count 2"),
    ("dots1", {"leading_dense_block_count": 0}, (), "leading_dense_block_count 0"),
    ("dots1", {"expert_group_count": 4}, (), "expert_group_count 4"),
    ("dots1", {"rope.dimension_count": 4}, (), "rope.dimension_count 4"),
])  # fmt: skip
def test_glm4moe_dots1_damaged_files_are_refused(tmp_path, family, meta, skip, names):
    src = tiny_checkpoint(family, tmp_path / "src")
    g = write_gguf(src, tmp_path / "bad.gguf", family, meta=meta, skip_meta=skip)
    with pytest.raises(CheckpointError, match=names):
        open_gguf(g)


def test_ernie45_moe_config_shared_experts_and_score_bias(gguf_model):
    """llama.cpp's ernie4_5-moe (a seam family): MoE from leading_dense_block_count on, every
    interleave_moe_layer_step-th layer; expert_shared_count shared experts as one MLP; the router's score bias."""
    _, g, _ = gguf_model("ernie4_5_moe", "Q5_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "ernie4_5_moe" and cfg.architectures == ["Ernie4_5_MoeForCausalLM"] and ck.family is None
    assert (cfg.moe_layer_start_index, cfg.moe_layer_interval, cfg.moe_layer_end_index) == (1, 1, 2)
    assert (cfg.moe_num_experts, cfg.moe_k, cfg.moe_intermediate_size, cfg.moe_num_shared_experts) == (6, 2, 16, 2)
    assert cfg.intermediate_size == 64 and not cfg.use_bias
    idx = ck.index
    assert idx["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == (1, 6)
    assert idx["model.layers.2.mlp.shared_experts.up_proj.weight"].shape == (32, 32)
    assert idx["model.layers.1.mlp.experts.5.gate_proj.weight"].dtype == "gguf:Q5_0"
    assert "model.layers.0.mlp.gate_proj.weight" in idx  # the leading dense layer


def test_hunyuan_moe_config_and_names(gguf_model):
    """llama.cpp's hunyuan-moe (a seam family): every layer MoE plus a shared MLP of the experts' size, q/k norms
    named as transformers' query_layernorm / key_layernorm, the router as mlp.gate.wg."""
    _, g, _ = gguf_model("hunyuan_v1_moe", "Q4_1")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "hunyuan_v1_moe" and cfg.architectures == ["HunYuanMoEV1ForCausalLM"]
    assert (cfg.num_experts, cfg.moe_topk, cfg.intermediate_size, cfg.head_dim) == (6, 2, 48, 8)
    assert not cfg.attention_bias and cfg.rope_parameters["rope_theta"] == 10000.0 and ck.family is None
    idx = ck.index
    assert idx["model.layers.1.mlp.gate.wg.weight"].shape == (6, 32)
    assert idx["model.layers.0.self_attn.query_layernorm.weight"].shape == (8,)
    assert idx["model.layers.1.mlp.shared_mlp.down_proj.weight"].shape == (32, 48)
    assert idx["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == "gguf:Q4_1"


def _gguf_without(g: Path, out: Path, arch: str, drop: str, flat: str = "",
                  extra: dict[str, np.ndarray] | None = None) -> Path:  # fmt: skip
    """A copy of GGUF file `g` (its numeric `<arch>.*` keys and tensors) without tensor `drop`, the tensors whose
    names end with `flat` (when given) written 1-D, plus `extra` tensors (F32)."""
    import gguf as gguf_py

    r = gguf_py.GGUFReader(str(g))
    w = gguf_py.GGUFWriter(str(out), arch)
    kinds = {gguf_py.GGUFValueType.UINT32: w.add_uint32, gguf_py.GGUFValueType.FLOAT32: w.add_float32}
    for f in r.fields.values():
        if f.name.startswith(arch + ".") and f.types and f.types[0] in kinds:
            kinds[f.types[0]](f.name, f.parts[f.data[0]][0].item())
    for t in r.tensors:
        if t.name != drop:
            shape = [int(x) for x in reversed(t.shape)]
            if flat and t.name.endswith(flat):
                shape = [int(np.prod(shape))]
            w.add_tensor(t.name, t.data.reshape(shape), raw_dtype=t.tensor_type)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(("family", "meta", "drop", "names"), [
    # the converter's shared length (intermediate_size // kv heads) where that is not the shared MLP's size
    ("ernie4_5_moe", {"expert_shared_feed_forward_length": 24}, None,
     r"ffn_up_shexp\.weight' has 32 rows, metadata ernie4_5-moe\.expert_shared_feed_forward_length says 24"),
    ("ernie4_5_moe", {"expert_shared_count": 1}, None, r"ffn_up_shexp\.weight' has 32 rows.*expert_shared_count 1"),
    ("ernie4_5_moe", {"interleave_moe_layer_step": 2}, None, "interleave_moe_layer_step 2 say"),
    ("ernie4_5_moe", {"leading_dense_block_count": 0}, None, "leading_dense_block_count 0"),
    ("ernie4_5_moe", {}, "blk.1.exp_probs_b.bias", r"'blk\.1\.exp_probs_b\.bias' is missing"),
    ("hunyuan_v1_moe", {"expert_shared_feed_forward_length": 64}, None,
     r"hunyuan-moe\.expert_shared_feed_forward_length 64 differs"),
    ("hunyuan_v1_moe", {"feed_forward_length": 64}, None, r"hunyuan-moe\.feed_forward_length 64 differs"),
    ("hunyuan_v1_moe", {}, "blk.0.attn_q_norm.weight", r"'blk\.0\.attn_q_norm\.weight' is missing"),
])  # fmt: skip
def test_ernie_hunyuan_damaged_files_are_refused(tmp_path, family, meta, drop, names):
    src = tiny_checkpoint(family, tmp_path / "src")
    g = write_gguf(src, tmp_path / "bad.gguf", family, meta=meta)
    if drop is not None:
        arch = "ernie4_5-moe" if family == "ernie4_5_moe" else "hunyuan-moe"
        g = _gguf_without(g, tmp_path / "dropped.gguf", arch, drop)
    with pytest.raises(CheckpointError, match=names):
        open_gguf(g)


def test_granitemoe_config_multipliers_and_names(gguf_model, tmp_path):
    """llama.cpp's granitemoe (Granite 3.x MoE and MoE Shared, seam families): Granite's multipliers from its *_scale
    keys, q/k un-permuted, the experts llama.cpp splits from input_linear named per expert (names the GGUF index's own
    converters fuse for the seam), the shared MLP's gate and up concatenated back into input_linear at load."""
    _, g, _ = gguf_model("granitemoeshared", "Q4_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "granitemoeshared" and cfg.architectures == ["GraniteMoeSharedForCausalLM"]
    assert ck.family is None and cfg.shared_intermediate_size == 24 and cfg.num_local_experts == 6
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == pytest.approx((12.0, 0.22, 6.0))
    assert cfg.attention_multiplier == pytest.approx(0.0078125)
    idx = ck.index
    assert idx["model.layers.1.block_sparse_moe.experts.5.up_proj.weight"].shape == (48, 32)
    assert idx["model.layers.0.self_attn.q_proj.weight"].dtype == "gguf:Q4_0+unpermute"
    for name in ("block_sparse_moe.router.layer.weight", "shared_mlp.gate_proj.weight", "shared_mlp.up_proj.weight",
                 "shared_mlp.output_linear.weight"):  # fmt: skip
        assert f"model.layers.1.{name}" in idx
    assert len(idx.converters) == 3
    plain = open_gguf(gguf_model("granitemoe", "F32")[1]).config
    assert plain.model_type == "granitemoe" and plain.architectures == ["GraniteMoeForCausalLM"]
    # where a multiplier key is absent, llama.cpp's value: attention 1/sqrt(head dim), embedding and residual 1
    src = tiny_checkpoint("granitemoe", tmp_path / "src")
    g2 = write_gguf(src, tmp_path / "d.gguf", "granitemoe", skip_meta=("attention.scale", "embedding_scale",
                                                                       "residual_scale"))  # fmt: skip
    d = open_gguf(g2).config
    assert (d.attention_multiplier, d.embedding_multiplier, d.residual_multiplier) == (8**-0.5, 1.0, 1.0)


def test_bailingmoe2_config_names_and_mtp(gguf_model):
    """llama.cpp's bailingmoe2 (Ling / Ring 2.0 and Sarvam-MoE) as transformers' sarvam_moe, a seam family: the
    rotary part of each head from rope.dimension_count (Ling: half), attn_qkv under the Sarvam checkpoint's
    query_key_value (split at load by transformers' rule), the V3-style router, and the MTP layer written as block 3
    (block_count 4, nextn_predict_layers 1) skipped on purpose."""
    _, g, _ = gguf_model("sarvam_moe", "Q8_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "sarvam_moe" and cfg.architectures == ["Glm4MoeForCausalLM"] and ck.family is None
    assert ck.metadata["bailingmoe2.block_count"] == 4 and "blk.3.nextn.eh_proj.weight" in read_gguf(g).tensors
    assert (cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.head_dim) == (3, 1, 16)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5 and cfg.use_qk_norm and not cfg.attention_bias
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.first_k_dense_replace) == (6, 1, 1)
    assert (cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group) == (2.5, 2, 1)
    idx = ck.index
    assert idx["model.layers.1.attention.query_key_value.weight"].shape == (128, 32)
    assert idx["model.layers.1.attention.query_key_value.weight"].dtype == "gguf:Q8_0"
    assert idx["model.layers.2.mlp.experts.5.down_proj.weight"].shape == (32, 16)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in idx and "model.layers.0.mlp.gate_proj.weight" in idx
    assert not any(n.startswith("model.layers.3.") for n in idx.names())


def test_bailingmoe_has_no_transformers_family(tmp_path, monkeypatch):
    """llama.cpp's bailingmoe (Ling / Ring 1.x, BailingMoeForCausalLM: remote code only) has no transformers model
    type to run it as: refused, saying so."""
    import gguf_ref

    src = tiny_checkpoint("sarvam_moe", tmp_path / "src", num_nextn_predict_layers=0)
    monkeypatch.setitem(gguf_ref.ARCH, "sarvam_moe", "bailingmoe")
    g = write_gguf(src, tmp_path / "ling.gguf", "sarvam_moe")
    with pytest.raises(UnknownArchitectureError, match=r"'bailingmoe' \(Ling / Ring 1\.x.* has no transformers family"):
        open_gguf(g)


@pytest.mark.parametrize(("family", "meta", "skip", "names"), [
    ("granitemoe", {}, ("logit_scale",), r"lacks granitemoe\.logit_scale"),
    ("granitemoe", {"expert_gating_func": 2}, (), "granitemoe.expert_gating_func 2"),
    ("granitemoe", {"expert_weights_norm": 0}, (), "granitemoe.expert_weights_norm 0"),
    ("granitemoe", {"attention.key_length": 16}, (), "granitemoe.attention.key_length 16"),
    ("granitemoeshared", {"expert_shared_feed_forward_length": 16}, (),
     r"ffn_up_shexp\.weight' has 24 rows, metadata granitemoe\.expert_shared_feed_forward_length says 16"),
    ("sarvam_moe", {"expert_gating_func": 1}, (), "bailingmoe2.expert_gating_func 1"),
    ("sarvam_moe", {"rope.dimension_count": 5}, (), "rope.dimension_count 5"),
    ("sarvam_moe", {"attention.head_count_kv": 4}, (), r"attn_qkv\.weight' has shape \[128, 32\]"),
    ("sarvam_moe", {"expert_shared_count": 2}, (), r"ffn_up_shexp\.weight.*expert_shared_count 2"),
    ("sarvam_moe", {}, ("nextn_predict_layers",), r"'blk\.3\.[\w.]+' has no transformers counterpart"),  # MTP
])  # fmt: skip
def test_granite_bailing_damaged_files_are_refused(tmp_path, family, meta, skip, names):
    src = tiny_checkpoint(family, tmp_path / "src")
    g = write_gguf(src, tmp_path / "bad.gguf", family, meta=meta, skip_meta=skip)
    with pytest.raises(CheckpointError, match=names):
        open_gguf(g)


def test_ernie_score_bias_written_flat_loads(gguf_model, tmp_path):
    """llama-quantize writes ERNIE's exp_probs_b as [E] where the converter wrote [1, E]: both are the [1, E]
    moe_statics transformers holds, with the same logits."""
    src, g, _ = gguf_model("ernie4_5_moe", "F32")
    flat = _gguf_without(g, tmp_path / "flat.gguf", "ernie4_5-moe", "", flat="exp_probs_b.bias")
    assert open_gguf(flat).index["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == (1, 6)
    assert _logits_diff(flat, src) <= BOUND


def test_llama4_config_split_experts_and_layout(gguf_model, tmp_path):
    """llama.cpp's llama4: gate and up written apart from the fused gate_up_proj, read as per-expert pieces of the
    llama4 row; MoE every interleave step; the attention layout llama.cpp keeps as constants (chunks of 8192,
    temperature floor 8192, RoPE-less full attention every fourth layer, q/k norm except at 128 experts)."""
    _, g, _ = gguf_model("llama4_text", "Q8_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "llama4_text" and cfg.moe_layers == [1, 3] and cfg.no_rope_layers == [1, 1, 1, 0]
    assert cfg.attention_chunk_size == 8192 and cfg.floor_scale == 8192 and cfg.use_qk_norm
    assert cfg.intermediate_size == 48 and cfg.intermediate_size_mlp == 64
    assert ck.index["model.layers.1.feed_forward.experts.3.up_proj.weight"].shape == (48, 32)
    assert "model.layers.0.feed_forward.gate_proj.weight" in ck.index  # a dense layer
    assert "model.layers.1.feed_forward.shared_expert.down_proj.weight" in ck.index
    assert ck.family is not None and ck.family.sources["gate"].tensor == "experts.{e}.gate_proj.weight"
    src = tiny_checkpoint("llama4_text", tmp_path / "src")
    with pytest.raises(CheckpointError, match="interleave_moe_layer_step 1"):
        open_gguf(write_gguf(src, tmp_path / "step.gguf", "llama4_text", meta={"interleave_moe_layer_step": 1}))
    with pytest.raises(CheckpointError, match="sliding_window 0"):
        open_gguf(write_gguf(src, tmp_path / "swa.gguf", "llama4_text", meta={"attention.sliding_window": 0}))
    f32 = gguf_model("llama4_text", "F32")[1]
    junk = np.array([1.0, 3.0, 2.0, 7.0])  # factors no Llama-3 scaling gives
    freqs = _gguf_without(f32, tmp_path / "freqs.gguf", "llama4", "", extra={"rope_freqs.weight": junk})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        open_gguf(freqs)


@pytest.mark.parametrize(("low", "high", "orig"), [(1.0, 1.0, 8192), (1.0, 32.0, 32768)])
def test_llama3_rope_factors_come_back_as_rope_parameters(tmp_path, low, high, orig):
    """llama.cpp writes Llama-3 RoPE scaling as per-frequency factors (rope_freqs.weight); read back as transformers'
    llama3 parameters (Llama-4 Scout's equal low and high factors, and a smooth band over two frequencies), the
    logits are transformers' on the source checkpoint."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}  # fmt: skip
    src = tiny_checkpoint("llama4_text", tmp_path / "src", head_dim=16, rope_parameters=rope)
    g = write_gguf(src, tmp_path / "r.gguf", "llama4_text")
    got = open_gguf(g).config.rope_parameters
    assert got["rope_type"] == "llama3" and got["factor"] == 8.0
    assert "rope_freqs.weight" not in open_gguf(g).index  # consumed by the config
    assert _logits_diff(g, src) <= BOUND


def test_qwen3next_config_names_and_transforms(gguf_model, tmp_path, monkeypatch):
    """llama.cpp's qwen3next (Qwen3-Next, a seam family): linear layers from attention.recurrent_layers (or
    full_attention_interval), the DeltaNet sizes from ssm.*, the rotary part; what the converter transformed given
    back (norms written plus 1, A_log as -exp(A_log), in_proj_qkvz split into attn_qkv and attn_gate, each part
    decoded, then merged; older files' ssm_in as stored); the MTP layer (block 4) skipped on purpose."""
    import gguf_ref

    _, g, _ = gguf_model("qwen3_next", "Q4_0")
    ck = open_gguf(g)
    cfg = ck.config
    assert cfg.model_type == "qwen3_next" and cfg.architectures == ["Qwen3NextForCausalLM"] and ck.family is None
    assert ck.metadata["qwen3next.block_count"] == 5 and "blk.4.nextn.eh_proj.weight" in read_gguf(g).tensors
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] and cfg.num_hidden_layers == 4
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads) == (2, 8, 4)
    assert (cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.head_dim) == (16, 4, 8)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (6, 16, 24)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25 and cfg.norm_topk_prob and cfg.mlp_only_layers == []
    idx = ck.index
    qkvz = idx["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert qkvz.dtype == "qwen3next_qkvz" and qkvz.shape == (2 * (8 + 8 + 2 * 2 * 16), 32)
    assert [p.dtype for p in qkvz.parts] == ["gguf:Q4_0", "gguf:Q4_0"]  # both halves blocks, decoded, then merged
    assert idx["model.layers.0.linear_attn.A_log"].dtype == "log_neg"
    for name in ("model.layers.3.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight",
                 "model.layers.2.post_attention_layernorm.weight"):  # fmt: skip
        assert idx[name].dtype == "minus_one"
    assert idx["model.layers.0.linear_attn.norm.weight"].dtype == "F32"  # the gated norm is written as it is
    assert idx["model.layers.1.linear_attn.conv1d.weight"].shape == (96, 1, 4)
    assert idx["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 8, 32)  # query and gate per head
    assert idx["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert idx["model.layers.2.mlp.experts.5.gate_proj.weight"].dtype == "gguf:Q4_0"
    assert not any(n.startswith("model.layers.4.") for n in idx.names())
    with pytest.raises(ValueError, match="not -exp"):  # an ssm_a value no A_log gives
        CODECS["log_neg"].decode([torch.tensor([-1.0, 0.5])], (2,))
    # without the recurrent-layer list: llama.cpp's full_attention_interval rule; older files' ssm_in (in_proj_qkvz
    # as stored) with the same logits
    monkeypatch.setattr(gguf_ref, "QWEN3NEXT_LEGACY", True)
    f32 = gguf_model("qwen3_next", "F32")[0]
    old = write_gguf(f32, tmp_path / "old.gguf", "qwen3_next", skip_meta=("attention.recurrent_layers",))
    assert "blk.0.ssm_in.weight" in read_gguf(old).tensors
    assert open_gguf(old).config.layer_types == cfg.layer_types
    assert open_gguf(old).index["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == "F32"
    assert _logits_diff(old, f32) <= BOUND


@pytest.mark.parametrize(("meta", "skip", "drop", "names"), [
    ({"ssm.time_step_rank": 3}, (), None, r"ssm\.time_step_rank 3 value heads"),
    ({"ssm.group_count": 4}, (), None, r"'blk\.0\.ssm_conv1d\.weight' has shape \[96, 4\]"),
    ({"ssm.inner_size": 32}, (), None, r"'blk\.0\.ssm_conv1d\.weight' has shape"),
    ({"attention.recurrent_layers": [True, True, False, False, False]}, (), None,
     r"recurrent_layers makes block 2 full attention, but tensor 'blk\.2\.attn_q\.weight' is missing"),
    ({"attention.recurrent_layers": [True, True, True, False]}, (), None, "one flag per block"),
    ({"full_attention_interval": 2}, ("attention.recurrent_layers",), None, "full_attention_interval makes block 1"),
    ({"attention.head_count": 2}, (), None, r"'blk\.3\.attn_q\.weight' has 64 rows"),
    ({"rope.dimension_count": 5}, (), None, "rope.dimension_count 5"),
    ({"expert_gating_func": 2}, (), None, "qwen3next.expert_gating_func 2"),
    ({"expert_weights_norm": 0}, (), None, "qwen3next.expert_weights_norm 0"),
    ({"expert_shared_feed_forward_length": 16}, (), None, r"ffn_up_shexp\.weight' has 24 rows"),
    ({}, ("nextn_predict_layers",), None, r"'blk\.4\.nextn\.[\w.]+' has no transformers counterpart"),  # MTP
    ({}, (), "blk.1.attn_gate.weight", r"blk\.1\.attn_gate\.weight is missing \(Qwen3-Next's attn_qkv and"),
    ({}, (), "blk.0.attn_norm.weight", "MTP-only qwen3next file"),
    ({}, (), "blk.2.ffn_gate_inp.weight", r"routers in blocks \[0, 1, 3\]"),
])  # fmt: skip
def test_qwen3next_damaged_files_are_refused(gguf_model, tmp_path, meta, skip, drop, names):
    src = gguf_model("qwen3_next", "F32")[0]
    g = write_gguf(src, tmp_path / "bad.gguf", "qwen3_next", meta=meta, skip_meta=skip)
    if drop is not None:  # (the copy keeps the numeric keys: full_attention_interval gives the same layers)
        g = _gguf_without(g, tmp_path / "dropped.gguf", "qwen3next", drop)
    with pytest.raises(CheckpointError, match=names):
        open_gguf(g)
