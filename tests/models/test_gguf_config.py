"""GGUF models (models/gguf_config.py): config from metadata, names, and logits against transformers.

GGUF files are written here from tiny random checkpoints (tests/gguf_ref.py, no llama.cpp); the reference
is transformers on a twin checkpoint holding the values the GGUF file decodes to (numpy reference), so
every block type is held to the fp32 bound: max |logits - reference| <= 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import moetier
from gguf_ref import dequantized_twin, write_gguf
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import CheckpointError, UnknownArchitectureError
from moetier.models.gguf_config import open_gguf
from moetier.models.open import describe, read_config
from moetier.models.tiny import build_tiny_checkpoint

RUNTIME = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3")
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
            src = build_tiny_checkpoint(family, root / f"{family}_{qtype}_src", **_overrides(family, qtype))
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
    ("deepseek_v2", "Q4_0"),
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
