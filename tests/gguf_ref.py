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
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
# (checkpoint block, gate, up, down) of each family's per-expert tensors
EXPERTS = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"), "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
}  # fmt: skip
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
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    out: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for piece, gname in ((g, "ffn_gate_exps"), (u, "ffn_up_exps"), (d, "ffn_down_exps")):
            names = [f"{pre}{block}.experts.{e}.{piece}.weight" for e in range(n_exp)]
            if names[0] in sd:  # (DeepSeek's leading layers are dense)
                out[f"blk.{i}.{gname}.weight"] = np.stack([sd.pop(n) for n in names])
        for k in [k for k in sd if k.startswith(pre)]:
            name = _LAYER[k[len(pre) :]]
            w = sd.pop(k)
            if family == "mixtral" and name == "attn_q.weight":
                w = permute_qk(w, cfg["num_attention_heads"])
            elif family == "mixtral" and name == "attn_k.weight":
                w = permute_qk(w, cfg["num_key_value_heads"])
            if name == "attn_kv_b.weight":  # llama.cpp's deepseek2 converter: k_b (transposed per head) and v_b
                out[f"blk.{i}.attn_k_b.weight"], out[f"blk.{i}.attn_v_b.weight"] = split_kv_b(w, cfg)
                continue
            out[f"blk.{i}.{name}"] = w
    for k, v in sd.items():
        out[_GLOBAL[k]] = v
    return out


def split_kv_b(w: np.ndarray, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b [nh (nope + v), kv_lora] -> (k_b [nh, kv_lora, nope], v_b [nh, v, kv_lora]), as llama.cpp's
    deepseek2 converter writes them."""
    nh, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv = w.reshape(nh, nope + v, w.shape[-1])
    return np.ascontiguousarray(kv[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(kv[:, nope:])


def arch_meta(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The arch-specific `<arch>.*` keys llama.cpp's converter writes for `family` (beyond write_gguf's common ones)."""
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
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    values: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.freq_base": float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": n_exp, "expert_used_count": cfg["num_experts_per_tok"],
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
        elif isinstance(v, str):
            w.add_string(full, v)
        else:
            w.add_uint32(full, int(v))
    if tokenizer:
        add_tokenizer(w)
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
    back = {v: k for k, v in _GLOBAL.items()}
    twin: dict[str, torch.Tensor] = {}
    mla: dict[str, np.ndarray] = {}
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
            pre = f"model.layers.{layer}."
            if rest.endswith("_exps.weight"):
                block, g, u, d = EXPERTS[family]
                piece = {"ffn_gate_exps.weight": g, "ffn_up_exps.weight": u, "ffn_down_exps.weight": d}[rest]
                for e in range(deq.shape[0]):
                    twin[f"{pre}{block}.experts.{e}.{piece}.weight"] = torch.from_numpy(deq[e].copy())
                continue
            if family == "mixtral" and rest in ("attn_q.weight", "attn_k.weight"):
                n = cfg["num_attention_heads"] if rest == "attn_q.weight" else cfg["num_key_value_heads"]
                deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
            hf = next(k for k, v in _LAYER.items() if v == rest and pre + k in sd)
            twin[pre + hf] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            twin[back[name]] = torch.from_numpy(np.ascontiguousarray(deq))
    assert set(twin) == set(sd), set(sd) ^ set(twin)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in twin.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out
