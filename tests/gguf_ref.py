"""Writing GGUF files from tiny transformers checkpoints, for the tests of GGUF input (no llama.cpp needed).

`write_gguf(src, out, qtype)` renames a tiny checkpoint's tensors to llama.cpp's GGUF names (the
inverse mapping, written out here by hand, independent of moetier.models.gguf_config), stacks
each layer's experts into [E, ...] tensors as llama.cpp's converter does, permutes the q/k rows
of the llama arch (Mixtral) as that converter does, quantises 2-D weights to `qtype` with the
numpy reference (`gguf.quants.quantize`), and writes metadata with `gguf.GGUFWriter`.
`dequantized_twin(src, out, qtype)` writes the transformers checkpoint whose weights are the values
that GGUF file decodes to (numpy reference `gguf.quants.dequantize`), the reference for logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_JSON = REPO / "models" / "tiny-shakespeare-moe" / "tokenizer.json"

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "llama4_text": "llama4"}
ARCH.update(glm4_moe="glm4moe", dots1="dots1")
ARCH.update(ernie4_5_moe="ernie4_5-moe", hunyuan_v1_moe="hunyuan-moe")
ARCH.update(granitemoe="granitemoe", granitemoeshared="granitemoe", sarvam_moe="bailingmoe2")
ARCH.update(qwen3_next="qwen3next")
_GRANITE = ("granitemoe", "granitemoeshared")  # experts fused in the checkpoint (input_linear), split in the GGUF
_PERMUTED = ("mixtral", *_GRANITE)  # llama-style converters: q/k rows permuted for interleaved RoPE
# (checkpoint block, gate, up, down) of each family's per-expert tensors
EXPERTS = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"), "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "gpt_oss": ("mlp", "gate_proj", "up_proj", "down_proj"),  # (as moetier names GPT-OSS's split pieces)
    "llama4_text": ("feed_forward", "gate_proj", "up_proj", "down_proj"),  # (and Llama-4's)
    "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "dots1": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "ernie4_5_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "hunyuan_v1_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "sarvam_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("mlp", "gate_proj", "up_proj", "down_proj"),
    # Granite: as moetier names the pieces llama.cpp splits from input_linear / output_linear
    "granitemoe": ("block_sparse_moe", "gate_proj", "up_proj", "down_proj"),
    "granitemoeshared": ("block_sparse_moe", "gate_proj", "up_proj", "down_proj"),
}  # fmt: skip
# per-family names where llama.cpp's converter names a tensor otherwise than _LAYER does
_FAMILY_LAYER = {
    "gpt_oss": {"post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                "self_attn.o_proj.bias": "attn_output.bias"},
    "glm4_moe": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
    "llama4_text": {"feed_forward.router.weight": "ffn_gate_inp.weight",
                    **{f"feed_forward.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
                    **{f"feed_forward.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
                       for p in ("gate", "up", "down")}},
    "ernie4_5_moe": {"mlp.moe_statics.e_score_correction_bias": "exp_probs_b.bias"},
    "hunyuan_v1_moe": {"mlp.gate.wg.weight": "ffn_gate_inp.weight", "self_attn.o_proj.bias": "attn_output.bias",
                       "self_attn.query_layernorm.weight": "attn_q_norm.weight",
                       "self_attn.key_layernorm.weight": "attn_k_norm.weight",
                       "mlp.shared_mlp.gate_proj.weight": "ffn_gate_shexp.weight",
                       "mlp.shared_mlp.up_proj.weight": "ffn_up_shexp.weight",
                       "mlp.shared_mlp.down_proj.weight": "ffn_down_shexp.weight"},
    # the Sarvam checkpoint's names (transformers' sarvam_moe saves them) as llama.cpp's bailingmoe2 converter maps them
    "sarvam_moe": {"attention.query_key_value.weight": "attn_qkv.weight", "mlp.gate.expert_bias": "exp_probs_b.bias",
                   "attention.dense.weight": "attn_output.weight",
                   "attention.query_layernorm.weight": "attn_q_norm.weight",
                   "attention.key_layernorm.weight": "attn_k_norm.weight"},
    **{f: {"block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
           "shared_mlp.output_linear.weight": "ffn_down_shexp.weight"} for f in _GRANITE},
    # (in_proj_qkvz: split into attn_qkv and attn_gate by qwen3next_tensors unless QWEN3NEXT_LEGACY)
    "qwen3_next": {"post_attention_layernorm.weight": "post_attention_norm.weight", "linear_attn.A_log": "ssm_a",
                   "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
                   "linear_attn.in_proj_qkvz.weight": "ssm_in.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
                   "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"},
}  # fmt: skip
_FAMILY_GLOBAL = {"sarvam_moe": {"model.word_embeddings.weight": "token_embd.weight"}}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # dense MLP layers, DeepSeek's shared experts and score bias, MLA (kv_b_proj: split, see _split)
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for the llama arch's q / k (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(src: Path, family: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (fp32 numpy) under GGUF names, experts stacked, q/k permuted for llama."""
    cfg = json.loads((src / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    block, g, u, d = EXPERTS[family]
    n_exp = (cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
             or cfg.get("moe_num_experts"))
    out: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if family == "gpt_oss":  # fused [E, H, 2I] gate/up interleaved, [E, I, H] down: split and transposed
            gu = sd.pop(f"{pre}mlp.experts.gate_up_proj").swapaxes(1, 2)
            gub = sd.pop(f"{pre}mlp.experts.gate_up_proj_bias")
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gu[:, ::2], gu[:, 1::2]
            out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = gub[:, ::2], gub[:, 1::2]
            out[f"blk.{i}.ffn_down_exps.weight"] = sd.pop(f"{pre}mlp.experts.down_proj").swapaxes(1, 2)
            out[f"blk.{i}.ffn_down_exps.bias"] = sd.pop(f"{pre}mlp.experts.down_proj_bias")
        if family == "llama4_text" and f"{pre}feed_forward.experts.gate_up_proj" in sd:  # [E, H, 2I]: halves, .T
            gu = sd.pop(f"{pre}feed_forward.experts.gate_up_proj").swapaxes(1, 2)
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = np.split(gu, 2, axis=1)
            out[f"blk.{i}.ffn_down_exps.weight"] = sd.pop(f"{pre}feed_forward.experts.down_proj").swapaxes(1, 2)
        if family in _GRANITE:  # llama.cpp's GraniteMoeModel: fused [E, 2I, H] (and the shared [2S, H]) split in two
            gu = sd.pop(f"{pre}block_sparse_moe.input_linear.weight")
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = np.split(gu, 2, axis=1)
            out[f"blk.{i}.ffn_down_exps.weight"] = sd.pop(f"{pre}block_sparse_moe.output_linear.weight")
            if f"{pre}shared_mlp.input_linear.weight" in sd:
                sh = np.split(sd.pop(f"{pre}shared_mlp.input_linear.weight"), 2, axis=0)
                out[f"blk.{i}.ffn_gate_shexp.weight"], out[f"blk.{i}.ffn_up_shexp.weight"] = sh
        for piece, gname in ((g, "ffn_gate_exps"), (u, "ffn_up_exps"), (d, "ffn_down_exps")):
            names = [f"{pre}{block}.experts.{e}.{piece}.weight" for e in range(n_exp)]
            if names[0] in sd:  # (DeepSeek's leading layers are dense)
                out[f"blk.{i}.{gname}.weight"] = np.stack([sd.pop(n) for n in names])
        for k in [k for k in sd if k.startswith(pre)]:
            name = {**_LAYER, **_FAMILY_LAYER.get(family, {})}[k[len(pre) :]]
            w = np.ascontiguousarray(sd.pop(k))
            if family in _PERMUTED and name == "attn_q.weight":
                w = permute_qk(w, cfg["num_attention_heads"])
            elif family in _PERMUTED and name == "attn_k.weight":
                w = permute_qk(w, cfg["num_key_value_heads"])
            if name == "attn_kv_b.weight":  # llama.cpp's deepseek2 converter: k_b (transposed per head) and v_b
                out[f"blk.{i}.attn_k_b.weight"], out[f"blk.{i}.attn_v_b.weight"] = split_kv_b(w, cfg)
                continue
            out[f"blk.{i}.{name}"] = w
    if family == "glm4_moe":
        out.update(nextn_blocks(out, cfg))
    if family == "sarvam_moe":  # as BailingMoeV2Model writes Ling 2.0 (SarvamMoEModel also zero-means exp_probs_b)
        out.update(nextn_blocks(out, cfg, ("nextn.enorm", "nextn.hnorm", "layer_output_norm"), (), seed=8))
    for k, v in sd.items():
        out[{**_GLOBAL, **_FAMILY_GLOBAL.get(family, {})}[k]] = v
    if family == "qwen3_next":
        out = qwen3next_tensors(out, cfg)
        out.update(qwen3next_mtp_blocks(out, cfg))
    return out


_GLM_NEXTN_NORMS = ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")
_GLM_NEXTN_VOCAB = ("nextn.embed_tokens", "nextn.shared_head_head")


def nextn_blocks(out: dict[str, np.ndarray], cfg: dict[str, Any], norms: tuple[str, ...] = _GLM_NEXTN_NORMS,
                 vocab: tuple[str, ...] = _GLM_NEXTN_VOCAB, seed: int = 7) -> dict[str, np.ndarray]:  # fmt: skip
    """Multi-token-prediction layers as llama.cpp's converters write them from a real checkpoint's model.layers.L.*
    (L = num_hidden_layers; counted in block_count): a decoder layer plus nextn.eh_proj [H, 2H], the `norms` [H]
    and the `vocab` tensors [V, H]. GLM (glm4moe): nextn.enorm / hnorm / shared_head_norm and, where the checkpoint
    has them, nextn.embed_tokens / shared_head_head; Ling 2.0 (bailingmoe2): nextn.enorm / hnorm and
    layer_output_norm (the layer's final_layernorm). transformers does not keep them in a saved checkpoint, so
    here: a copy of the last layer's tensors and random others."""
    n_layers, hidden, n_vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    last = f"blk.{n_layers - 1}."
    extra: dict[str, np.ndarray] = {}
    for j in range(cfg.get("num_nextn_predict_layers") or 0):
        b = f"blk.{n_layers + j}."
        extra.update({b + k[len(last) :]: v.copy() for k, v in out.items() if k.startswith(last)})
        extra[b + "nextn.eh_proj.weight"] = (rng.standard_normal((hidden, 2 * hidden)) * 0.05).astype(np.float32)
        for n in norms:
            extra[f"{b}{n}.weight"] = np.ones(hidden, np.float32)
        for n in vocab:
            extra[f"{b}{n}.weight"] = (rng.standard_normal((n_vocab, hidden)) * 0.05).astype(np.float32)
    return extra


# write Qwen3-Next's in_proj_qkvz whole (ssm_in, as stored), as llama.cpp's converter did before splitting it
QWEN3NEXT_LEGACY = False
_QWEN3NEXT_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def qwen3next_tensors(out: dict[str, np.ndarray], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """What llama.cpp's Qwen3NextModel does to the renamed tensors: every zero-centred RMSNorm weight plus 1 (not the
    DeltaNet's ssm_norm), A_log as -exp(A_log), conv1d squeezed to [C, K], in_proj_qkvz (per key head q, k, v, z)
    split into attn_qkv (all q, all k, all v) and attn_gate (all z)."""
    nk, hk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vz = cfg["linear_num_value_heads"] // nk * cfg["linear_value_head_dim"]
    res: dict[str, np.ndarray] = {}
    for name, w in out.items():
        rest = name.split(".", 2)[-1]
        if name == "output_norm.weight" or rest in _QWEN3NEXT_NORMS:
            w = w + np.float32(1)
        elif rest == "ssm_a":
            w = -torch.from_numpy(w).exp().numpy()  # (torch's exp, as the converter's: numpy's differs in the ulp)
        elif rest == "ssm_conv1d.weight":
            w = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[-1]))
        elif rest == "ssm_in.weight" and not QWEN3NEXT_LEGACY:
            q, k, v, z = np.split(w.reshape(nk, 2 * hk + 2 * vz, -1), [hk, 2 * hk, 2 * hk + vz], axis=1)
            base = name[: -len(rest)]
            flat = [np.ascontiguousarray(x).reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
            res[base + "attn_qkv.weight"], res[base + "attn_gate.weight"] = np.concatenate(flat[:3]), flat[3]
            continue
        res[name] = w
    return res


def qwen3next_back(rest: str, deq: np.ndarray, family: str) -> np.ndarray:
    """The transformers value of a decoded qwen3next tensor (the inverse of qwen3next_tensors but for the split)."""
    if family != "qwen3_next":
        return deq
    if rest in (*_QWEN3NEXT_NORMS, "output_norm.weight"):
        return deq - np.float32(1)
    if rest == "ssm_a":
        return np.log(-deq)
    if rest == "ssm_conv1d.weight":
        return deq.reshape(deq.shape[0], 1, deq.shape[1])
    return deq


def merge_qkvz(qkv: np.ndarray, z: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """in_proj_qkvz [nk (2 hk + 2 vz), H] back from attn_qkv and attn_gate."""
    nk, hk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vz, h = cfg["linear_num_value_heads"] // nk * cfg["linear_value_head_dim"], qkv.shape[-1]
    q, k, v = np.split(qkv, [nk * hk, 2 * nk * hk])
    parts = [q.reshape(nk, hk, h), k.reshape(nk, hk, h), v.reshape(nk, vz, h), z.reshape(nk, vz, h)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(-1, h))


def qwen3next_mtp_blocks(out: dict[str, np.ndarray], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Qwen3-Next's MTP layer as llama.cpp's converter writes it from the checkpoint's mtp.* (block L, counted in
    block_count): a full-attention MoE decoder layer plus nextn.eh_proj [H, 2H] and nextn.enorm / hnorm /
    shared_head_norm. transformers does not save mtp.*, so here: a copy of the last full-attention layer and random
    nextn tensors."""
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = f"blk.{max(i for i, t in enumerate(cfg['layer_types']) if t == 'full_attention')}."
    rng = np.random.default_rng(9)
    b = f"blk.{n_layers}."
    extra = {b + k[len(last) :]: v.copy() for k, v in out.items() if k.startswith(last)}
    extra[b + "nextn.eh_proj.weight"] = (rng.standard_normal((hidden, 2 * hidden)) * 0.05).astype(np.float32)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        extra[f"{b}nextn.{n}.weight"] = np.ones(hidden, np.float32)
    return extra


def split_kv_b(w: np.ndarray, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b [nh (nope + v), kv_lora] -> (k_b [nh, kv_lora, nope], v_b [nh, v, kv_lora]), as llama.cpp's
    deepseek2 converter writes them."""
    nh, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv = w.reshape(nh, nope + v, w.shape[-1])
    return np.ascontiguousarray(kv[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(kv[:, nope:])


def llama3_factors(cfg: dict[str, Any]) -> np.ndarray:
    """rope_freqs.weight [head_dim / 2] F32 as llama.cpp's converter computes it from a `llama3` rope_parameters."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < orig / high:
            out.append(1.0)
        elif wl > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def arch_meta(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The arch-specific `<arch>.*` keys llama.cpp's converter writes for `family` (beyond write_gguf's common ones)."""
    if family in (*_GRANITE, "sarvam_moe"):
        return granite_bailing_meta(family, cfg)
    if family == "llama4_text":
        return {"interleave_moe_layer_step": cfg["interleave_moe_layer_step"],
                "expert_feed_forward_length": cfg["intermediate_size"],
                "feed_forward_length": cfg["intermediate_size_mlp"]}  # fmt: skip
    if family == "gpt_oss":
        rope = cfg["rope_parameters"]
        return {"attention.sliding_window": cfg["sliding_window"],
                "expert_feed_forward_length": cfg["intermediate_size"],
                "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
                "rope.scaling.yarn_beta_slow": float(rope["beta_slow"])}  # fmt: skip
    if family in ("glm4_moe", "dots1"):
        return v3_meta(family, cfg)
    if family in ("ernie4_5_moe", "hunyuan_v1_moe"):
        return ernie_hunyuan_meta(family, cfg)
    if family == "qwen3_next":
        return qwen3next_meta(cfg)
    if ARCH[family] != "deepseek2":
        return {}
    rope = cfg["qk_rope_head_dim"]
    meta: dict[str, Any] = {
        "attention.head_count_kv": 1, "attention.kv_lora_rank": cfg["kv_lora_rank"],
        "attention.key_length": cfg["kv_lora_rank"] + rope, "attention.value_length": cfg["kv_lora_rank"],
        "attention.key_length_mla": cfg["qk_nope_head_dim"] + rope, "attention.value_length_mla": cfg["v_head_dim"],
        "rope.dimension_count": rope, "leading_dense_block_count": cfg["first_k_dense_replace"],
        "expert_count": cfg["n_routed_experts"], "expert_shared_count": cfg["n_shared_experts"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_weights_scale": float(cfg["routed_scaling_factor"]), "expert_group_count": cfg["n_group"],
        "expert_group_used_count": cfg["topk_group"], "expert_gating_func": 2 if family == "deepseek_v3" else 1,
    }  # fmt: skip
    if cfg.get("norm_topk_prob"):
        meta["expert_weights_norm"] = 1
    if cfg.get("q_lora_rank"):
        meta["attention.q_lora_rank"] = cfg["q_lora_rank"]
    return meta


def qwen3next_meta(cfg: dict[str, Any]) -> dict[str, Any]:
    """qwen3next's keys (Qwen3NextModel over Qwen2MoeModel): the DeltaNet sizes as ssm.*, the recurrent layers (one
    bool per block, the MTP block full attention), full_attention_interval (the config's, else 4: written always),
    the rotary part, one MTP layer (counted in block_count)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nv, n = cfg["linear_num_value_heads"], cfg["num_hidden_layers"]
    return {
        "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": cfg["linear_key_head_dim"],
        "ssm.group_count": cfg["linear_num_key_heads"], "ssm.time_step_rank": nv,
        "ssm.inner_size": cfg["linear_value_head_dim"] * nv, "attention.value_length": head_dim,
        "attention.recurrent_layers": [t == "linear_attention" for t in cfg["layer_types"]] + [False],
        "full_attention_interval": cfg.get("full_attention_interval", 4),
        "rope.dimension_count": int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 0.25)),
        "block_count": n + 1, "nextn_predict_layers": 1,
    }  # fmt: skip


def ernie_hunyuan_meta(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ernie4_5-moe's keys (Ernie4_5MoeModel: its shared expert length is intermediate_size // num_key_value_heads,
    which is the shared MLP's size in the published configs) and hunyuan-moe's (HunYuanMoEModel: the first entry of
    each per-layer list; the shared MLP's length is intermediate_size)."""
    if family == "ernie4_5_moe":
        meta: dict[str, Any] = {
            "expert_count": cfg["moe_num_experts"], "expert_used_count": cfg["moe_k"],
            "interleave_moe_layer_step": cfg["moe_layer_interval"],
            "leading_dense_block_count": cfg["moe_layer_start_index"],
            "expert_feed_forward_length": cfg["moe_intermediate_size"],
            "expert_shared_count": cfg["moe_num_shared_experts"],
        }  # fmt: skip
        if cfg["moe_num_shared_experts"]:
            meta["expert_shared_feed_forward_length"] = cfg["intermediate_size"] // cfg["num_key_value_heads"]
        return meta

    def first(v: Any) -> Any:
        return v[0] if isinstance(v, list) else v

    return {
        "expert_shared_feed_forward_length": cfg["intermediate_size"],
        "expert_feed_forward_length": first(cfg["moe_intermediate_size"]), "expert_used_count": first(cfg["moe_topk"]),
        "expert_shared_count": first(cfg["num_shared_expert"]), "attention.value_length": cfg["head_dim"],
    }  # fmt: skip


def v3_meta(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """glm4moe's and dots1's keys (their converters: Glm4MoeModel, Dots1Model over Qwen2MoeModel); dots1's gating
    func comes from the published configs' `scoring_func: sigmoid`, glm4moe's is written always."""
    meta: dict[str, Any] = {
        "leading_dense_block_count": cfg["first_k_dense_replace"], "expert_shared_count": cfg["n_shared_experts"],
        "expert_weights_scale": float(cfg["routed_scaling_factor"]), "expert_weights_norm": int(cfg["norm_topk_prob"]),
        "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"], "expert_gating_func": 2,
    }  # fmt: skip
    if family == "glm4_moe":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        meta["rope.dimension_count"] = int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 0.5))
        if cfg.get("head_dim"):
            meta["attention.value_length"] = head_dim
        nextn = cfg.get("num_nextn_predict_layers") or 0
        if nextn:
            meta.update(block_count=cfg["num_hidden_layers"] + nextn, nextn_predict_layers=nextn)
    return meta


def granite_bailing_meta(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """granitemoe's keys (GraniteMoeModel: Granite's multipliers as *_scale, each where the config sets it non-zero,
    and the shared MLP's length) and bailingmoe2's (BailingMoeV2Model / SarvamMoEModel: the V3-style MoE keys, the
    rotary part as rope.dimension_count, the shared experts' total length, nextn_predict_layers always)."""
    heads = cfg["num_attention_heads"]
    if family in _GRANITE:
        meta: dict[str, Any] = {"rope.dimension_count": cfg["hidden_size"] // heads, "vocab_size": cfg["vocab_size"]}
        for key, attr in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                          ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):  # fmt: skip
            if cfg.get(attr):
                meta[key] = float(cfg[attr])
        if cfg.get("shared_intermediate_size"):
            meta["expert_shared_feed_forward_length"] = cfg["shared_intermediate_size"]
        return meta
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    nextn = cfg.get("num_nextn_predict_layers") or 0
    return {
        **v3_meta(family, cfg), "attention.value_length": head_dim, "vocab_size": cfg["vocab_size"],
        "rope.dimension_count": int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 1.0)),
        "expert_shared_feed_forward_length": cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
        "block_count": cfg["num_hidden_layers"] + nextn, "nextn_predict_layers": nextn,
    }  # fmt: skip


def _qtype_for(name: str, a: np.ndarray, qtype: str) -> gguf.GGMLQuantizationType:
    t = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[t][0]
    if a.ndim < 2 or "norm" in name or "ffn_gate_inp" in name or a.shape[-1] % block:
        return gguf.GGMLQuantizationType.F32  # norms and routers stay F32, as llama.cpp keeps them
    return t


def encode(name: str, a: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    t = _qtype_for(name, a, qtype)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if t == gguf.GGMLQuantizationType.F32:
        return a, t
    if t == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16), t
    if t.name in K_SCALES:
        return random_k_blocks(a.shape, t, seed=sum(name.encode())), t
    if t.name in SCALE_AT:
        return random_blocks(a.shape, t, seed=sum(name.encode())), t
    return gguf.quants.quantize(a, t), t


# K-quants: byte offsets of the fp16 super-block scales (d, then dmin where there is one) and their magnitude
K_SCALES = {"Q2_K": ((80, 82), 2e-3), "Q3_K": ((108,), 2e-3), "Q4_K": ((0, 2), 1e-3), "Q5_K": ((0, 2), 5e-4),
            "Q6_K": ((208,), 2e-5)}  # fmt: skip


def random_k_blocks(shape: tuple[int, ...], t: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random valid K-quant bytes for a tensor of `shape` (gguf-py cannot quantise K-quants): random
    quants and sub-block scales, finite fp16 super-block scales of a small magnitude."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    offsets, mag = K_SCALES[t.name]
    for off in offsets:
        raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, (n, 1)) * mag).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


# types gguf-py cannot quantise: byte offset of the block's scale (fp16 d; MXFP4: an e8m0 exponent byte)
SCALE_AT = {"IQ4_NL": 0, "IQ4_XS": 0, "IQ3_S": 0, "IQ3_XXS": 0, "IQ2_XXS": 0, "IQ2_XS": 0, "IQ2_S": 0, "MXFP4": 0}


def random_blocks(shape: tuple[int, ...], t: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Valid bytes of type `t` for a tensor of `shape` (last axis in values): gguf-py's quantiser of random normal
    values where it has one, random K-quant blocks, else random blocks with finite scales of a small magnitude;
    uint8 [..., row bytes] (F16 / BF16 as their raw bytes too)."""
    rng = np.random.default_rng(seed)
    if t.name in K_SCALES:
        return random_k_blocks(shape, t, seed)
    if t.name in SCALE_AT:
        block, size = gguf.GGML_QUANT_SIZES[t]
        n = int(np.prod(shape)) // block
        raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
        off = SCALE_AT[t.name]
        if t.name == "MXFP4":
            raw[:, off] = rng.integers(118, 124, n)  # 2^-9 .. 2^-4
        else:
            raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, (n, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        return raw.reshape(*shape[:-1], shape[-1] // block * size)
    a = rng.standard_normal(shape).astype(np.float32) * 0.05
    if t == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16).view(np.uint8)
    q = gguf.quants.quantize(a, t)
    return q.view(np.uint8) if q.dtype != np.uint8 else q


def decode(raw: np.ndarray, t: gguf.GGMLQuantizationType) -> np.ndarray:
    if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw, t)


def write_gguf(src: Path, out: Path, family: str, qtype: str = "F32", *, tokenizer: bool = False,
               meta: dict[str, Any] | None = None, skip_meta: tuple[str, ...] = (),
               types: dict[str, str] | None = None) -> Path:  # fmt: skip
    """GGUF file `out` of the tiny checkpoint `src`; `meta` overrides / adds `<arch>.KEY` values, `skip_meta` drops
    keys, `types` gives some tensors (GGUF name) another type than `qtype` (a mixed file such as Q4_K_M)."""
    cfg = json.loads((src / "config.json").read_text())
    arch = ARCH[family]
    w = gguf.GGUFWriter(str(out), arch)
    heads = cfg["num_attention_heads"]
    n_exp = (cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
             or cfg.get("moe_num_experts"))
    values: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.freq_base": float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": n_exp, "expert_used_count": cfg.get("num_experts_per_tok"),
        "attention.key_length": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }  # fmt: skip
    if "moe_intermediate_size" in cfg:
        values["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if "shared_expert_intermediate_size" in cfg:
        values["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    values.update(arch_meta(family, cfg))
    values.update(meta or {})
    for key, v in values.items():
        if key in skip_meta:
            continue
        full = f"{arch}.{key}"
        if isinstance(v, float):
            w.add_float32(full, v)
        elif isinstance(v, list):
            w.add_array(full, v)
        elif isinstance(v, str):
            w.add_string(full, v)
        else:
            w.add_uint32(full, int(v))
    if tokenizer:
        add_tokenizer(w)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter bakes Llama-3 scaling into per-frequency factors
        w.add_tensor("rope_freqs.weight", llama3_factors(cfg))
    for name, a in gguf_tensors(src, family).items():
        raw, t = encode(name, a, (types or {}).get(name, qtype))
        w.add_tensor(name, raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tokenizer(w: gguf.GGUFWriter) -> None:
    """The bundled model's byte-level BPE tokenizer as GGUF metadata (what llama.cpp's converter writes)."""
    tok = json.loads(TOKENIZER_JSON.read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    special = {a["id"] for a in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


def dequantized_twin(src: Path, out: Path, family: str, qtype: str, types: dict[str, str] | None = None) -> Path:
    """A transformers checkpoint whose weights are what the `qtype` GGUF of `src` (`types`: as write_gguf)
    decodes to (numpy reference), q/k rows back in transformers' order."""
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    back = {v: k for k, v in {**_GLOBAL, **_FAMILY_GLOBAL.get(family, {})}.items()}
    twin: dict[str, torch.Tensor] = {}
    granite: dict[str, dict[str, np.ndarray]] = {}  # Granite: the split pieces per layer, fused back below
    mla: dict[str, np.ndarray] = {}
    fused: dict[str, dict[str, np.ndarray]] = {}  # GPT-OSS: pieces per layer, fused back below
    qkvz: dict[str, dict[str, np.ndarray]] = {}  # Qwen3-Next: attn_qkv and attn_gate per layer, merged below
    for name, a in gguf_tensors(src, family).items():
        raw, t = encode(name, a, (types or {}).get(name, qtype))
        deq = decode(raw, t).reshape(a.shape)
        if name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            mla[name] = deq
            layer = name.split(".")[1]
            k_b, v_b = mla.get(f"blk.{layer}.attn_k_b.weight"), mla.get(f"blk.{layer}.attn_v_b.weight")
            if k_b is not None and v_b is not None:  # back to kv_b [nh (nope + v), kv_lora]
                kv = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
                twin[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = torch.from_numpy(np.ascontiguousarray(kv))
            continue
        if name.startswith("blk."):
            layer, rest = name.split(".", 2)[1:]
            if int(layer) >= cfg["num_hidden_layers"]:  # GLM's MTP blocks: no transformers counterpart
                continue
            pre = f"model.layers.{layer}."
            if family in ("gpt_oss", "llama4_text") and "_exps." in rest:
                fused.setdefault(pre, {})[rest] = deq
                continue
            if family == "qwen3_next" and rest in ("attn_qkv.weight", "attn_gate.weight"):
                qkvz.setdefault(pre, {})[rest] = deq
                continue
            deq = qwen3next_back(rest, deq, family)
            if family in _GRANITE and ("_exps." in rest or rest in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")):
                granite.setdefault(pre, {})[rest] = deq
                continue
            if rest.endswith("_exps.weight"):
                block, g, u, d = EXPERTS[family]
                piece = {"ffn_gate_exps.weight": g, "ffn_up_exps.weight": u, "ffn_down_exps.weight": d}[rest]
                for e in range(deq.shape[0]):
                    twin[f"{pre}{block}.experts.{e}.{piece}.weight"] = torch.from_numpy(deq[e].copy())
                continue
            if family in _PERMUTED and rest in ("attn_q.weight", "attn_k.weight"):
                n = cfg["num_attention_heads"] if rest == "attn_q.weight" else cfg["num_key_value_heads"]
                deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
            hf = next(k for k, v in {**_LAYER, **_FAMILY_LAYER.get(family, {})}.items() if v == rest and pre + k in sd)
            twin[pre + hf] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            twin[back[name]] = torch.from_numpy(np.ascontiguousarray(qwen3next_back(name, deq, family)))
    for pre, p in qkvz.items():
        merged = merge_qkvz(p["attn_qkv.weight"], p["attn_gate.weight"], cfg)
        twin[pre + "linear_attn.in_proj_qkvz.weight"] = torch.from_numpy(merged)
    for pre, p in fused.items() if family == "llama4_text" else ():  # [gate | up] columns [E, H, 2I], down [E, I, H]
        gu = np.concatenate([p["ffn_gate_exps.weight"], p["ffn_up_exps.weight"]], axis=1).swapaxes(1, 2)
        for k, v in (("gate_up_proj", gu), ("down_proj", p["ffn_down_exps.weight"].swapaxes(1, 2))):
            twin[f"{pre}feed_forward.experts.{k}"] = torch.from_numpy(np.ascontiguousarray(v))
    for pre, p in fused.items() if family == "gpt_oss" else ():  # gate/up interleaved into [E, H, 2I], down [E, I, H]
        up = p["ffn_up_exps.weight"]
        gu = np.stack([p["ffn_gate_exps.weight"], up], axis=2).reshape(up.shape[0], -1, up.shape[2])
        gub = np.stack([p["ffn_gate_exps.bias"], p["ffn_up_exps.bias"]], axis=2).reshape(gu.shape[0], -1)
        for k, v in (("gate_up_proj", gu.swapaxes(1, 2)), ("gate_up_proj_bias", gub),
                     ("down_proj", p["ffn_down_exps.weight"].swapaxes(1, 2)),
                     ("down_proj_bias", p["ffn_down_exps.bias"])):
            twin[f"{pre}mlp.experts.{k}"] = torch.from_numpy(np.ascontiguousarray(v))
    for pre, p in granite.items():  # gate rows first: input_linear [E, 2I, H] and the shared MLP's [2S, H]
        fuse = {"block_sparse_moe.input_linear.weight": (["ffn_gate_exps.weight", "ffn_up_exps.weight"], 1),
                "block_sparse_moe.output_linear.weight": (["ffn_down_exps.weight"], 0),
                "shared_mlp.input_linear.weight": (["ffn_gate_shexp.weight", "ffn_up_shexp.weight"], 0)}  # fmt: skip
        for k, (names, axis) in fuse.items():
            if names[0] in p:
                twin[pre + k] = torch.from_numpy(np.ascontiguousarray(np.concatenate([p[n] for n in names], axis)))
    assert set(twin) == set(sd), set(sd) ^ set(twin)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in twin.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


# seam families (no entry in moetier.models.tiny.TINY): tiny_config sizes plus what the published models set
SEAM_TINY: dict[str, dict[str, Any]] = {
    # Llama-4's layout as llama.cpp holds it: MoE every other layer, RoPE-less full attention every fourth, chunks of
    # 8192 and temperature floor 8192 (its constants, transformers' defaults)
    "llama4_text": dict(num_hidden_layers=4, interleave_moe_layer_step=2, moe_layers=None, no_rope_layers=None,
                        layer_types=None, attention_chunk_size=8192, floor_scale=8192),
    "glm4_moe": dict(attention_bias=True, use_qk_norm=True, head_dim=16, routed_scaling_factor=2.5),  # GLM-4.5
    "dots1": dict(num_key_value_heads=4, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    # ERNIE-4.5-21B-A3B's shape: 2 shared experts, one leading dense layer, intermediate_size // kv heads = shared size
    "ernie4_5_moe": dict(intermediate_size=64, moe_num_shared_experts=2, num_hidden_layers=3),
    # Hunyuan-A13B's per-layer lists (the converter reads them; transformers sizes experts by intermediate_size)
    "hunyuan_v1_moe": dict(moe_intermediate_size=[48, 48], moe_topk=[2, 2], num_shared_expert=[1, 1]),
    # Granite 3.x MoE: every multiplier away from 1 (attention's from 1/sqrt(head dim)), as the published configs set
    **{f: dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
               logits_scaling=6.0, **({"shared_intermediate_size": 24} if f == "granitemoeshared" else {}))
       for f in _GRANITE},
    # Ling-mini-2.0's shape: half-rotary heads, one leading dense layer, a group-limited sigmoid router, an MTP layer
    "sarvam_moe": dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 600000.0,
                                                     "partial_rotary_factor": 0.5}, num_hidden_layers=3,
                       num_nextn_predict_layers=1, routed_scaling_factor=2.5),
    # Qwen3-Next-80B-A3B's layout (MoE on every layer, full attention every fourth), with value heads wider than key
    # heads (16, 8) and two value heads per key head, so in_proj_qkvz's regrouping is seen
    "qwen3_next": dict(mlp_only_layers=[], num_hidden_layers=4, layer_types=None, linear_value_head_dim=16),
}  # fmt: skip


def tiny_checkpoint(family: str, out: Path, **overrides: Any) -> Path:
    """`moetier.models.tiny.build_tiny_checkpoint` where it knows the family, else a random checkpoint of
    `tiny_config(family)` (and SEAM_TINY) with random router score biases, as build_tiny_checkpoint gives them."""
    from transformers import AutoModelForCausalLM

    from moetier.models.tiny import TINY, build_tiny_checkpoint, tiny_config

    if family in TINY:
        return build_tiny_checkpoint(family, out, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **{**SEAM_TINY.get(family, {}), **overrides}),
                                             dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:  # (ERNIE's is a parameter)
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.5, 0.5)
    model.save_pretrained(out)
    return out
