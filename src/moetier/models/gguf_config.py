"""GGUF models as checkpoints: metadata -> transformers config, GGUF tensor names -> transformers names.

`open_gguf(path)` reads the header of a .gguf file (or of every shard of a split model, or of
the one model in a folder; formats/gguf.py) and returns a `GGUFCheckpoint`:
- `.config`: a transformers PretrainedConfig built from the `<arch>.*` metadata by the arch's
  row in `ARCHS` (models/gguf_archs.py: qwen3moe -> qwen3_moe, deepseek2 -> deepseek_v2 / v3, llama with
  experts -> mixtral, ...; the row type and metadata reads in models/gguf_meta.py); `.family` its family row;
- `.index`: a CheckpointIndex (formats/gguf.GGUFIndex) whose names are those of the
  transformers checkpoint the GGUF came from, so the rest of moetier opens it like any folder:
  a fused expert tensor `blk.N.ffn_gate_exps.weight` [E, I, H] becomes E per-expert tensors
  named by the family row (e.g. `model.layers.N.mlp.experts.{e}.gate_proj.weight` [I, H]), each
  pointing at that expert's contiguous bytes; non-expert tensors keep their shape;
- `.tokenizer()`: transformers' own GGUF tokenizer conversion (offline; reads the metadata only).

Invariants: every GGUF tensor is mapped or the open fails naming it; every metadata size the
config uses is checked against the tensor that carries it (a mismatch is a CheckpointError
naming the file and the tensor). llama.cpp's converter permutes the rows of q and k for the
`llama` arch (interleaved RoPE); those tensors get the `+unpermute` codec (formats/codecs_gguf.py)
so they decode to transformers' rotate-half order. Weights are never read here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from moetier.errors import CheckpointError, UnknownArchitectureError
from moetier.formats.checkpoint import TensorLocation
from moetier.formats.gguf import GGUFIndex, GGUFTensor, location, read_gguf_model
from moetier.models.families import Family, find_family, find_row
from moetier.models.gguf_archs import ARCHS, NO_TRANSFORMERS_FAMILY, QWEN3NEXT_QKVZ
from moetier.models.gguf_meta import BLOCK, GGUFArch, Meta, llama3_rope, rope_parameters

# per-layer GGUF tensor -> transformers name under model.layers.N. ("{blk}": the family's checkpoint block)
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "{blk}.gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "{blk}.{shared}.gate_proj.weight", "ffn_up_shexp.weight": "{blk}.{shared}.up_proj.weight",
    "ffn_down_shexp.weight": "{blk}.{shared}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "{blk}.{shared_gate}.weight",
}  # fmt: skip
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
_EXPERT_PIECES = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
                  "ffn_gate_exps.bias": "gate_bias", "ffn_up_exps.bias": "up_bias", "ffn_down_exps.bias": "down_bias"}
# MLA (deepseek2): llama.cpp's converter splits kv_b_proj [nh (nope + v), kv_lora] into these two per-head tensors
_MLA_KV_B = ("attn_k_b.weight", "attn_v_b.weight")


def _common(m: Meta, arch: GGUFArch, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    hidden = int(m.need("embedding_length"))
    heads = int(m.need("attention.head_count"))
    vocab, embd_hidden = m.shape("token_embd.weight")
    if embd_hidden != hidden:
        raise CheckpointError(
            f"{m.path}: tensor 'token_embd.weight' has rows of {embd_hidden}, {m.arch}.embedding_length says {hidden}"
        )
    rope = rope_parameters(m, arch.yarn_mscale)
    if "rope_freqs.weight" in tensors:  # Llama-3-style scaling, written as per-frequency factors
        if rope["rope_type"] != "default":
            raise CheckpointError(f"{m.path}: both rope_freqs.weight and {m.arch}.rope.scaling.type "
                                  f"{rope['rope_type']!r}: not supported")  # fmt: skip
        head_dim = int(m.get("rope.dimension_count") or m.get("attention.key_length") or hidden // heads)
        rope = llama3_rope(m, tensors["rope_freqs.weight"], rope["rope_theta"], head_dim)
    md = m.metadata
    cfg: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=int(m.need("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(m.get("attention.head_count_kv", heads)),
        head_dim=int(m.get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(m.get("context_length", 4096)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        num_experts_per_tok=int(m.need("expert_used_count")),
        norm_topk_prob=bool(m.get("expert_weights_norm", arch.norm_topk_default)),
        hidden_act="silu", tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_int_or_none(md.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_int_or_none(md.get("tokenizer.ggml.eos_token_id")),
        pad_token_id=_int_or_none(md.get("tokenizer.ggml.padding_token_id")),
    )  # fmt: skip
    scale = m.get("expert_weights_scale")
    if arch.scale_attr is not None:
        cfg[arch.scale_attr] = float(scale if scale is not None else 1.0)
    elif scale is not None and float(scale) != 1.0:
        raise CheckpointError(f"{m.path}: {m.arch}.expert_weights_scale {scale} is not supported")
    return cfg


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def build_config(
    path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[PretrainedConfig, GGUFArch]:
    """GGUF metadata (+ the tensor shapes that carry sizes) -> (transformers config, arch row)."""
    arch_name = metadata.get("general.architecture")
    if not isinstance(arch_name, str):
        raise CheckpointError(f"{path}: GGUF metadata lacks general.architecture")
    arch = ARCHS.get(arch_name)
    if arch is None and arch_name in NO_TRANSFORMERS_FAMILY:
        raise UnknownArchitectureError(
            f"{path}: GGUF architecture {arch_name!r} ({NO_TRANSFORMERS_FAMILY[arch_name]}) has no transformers "
            "family (transformers has no such model type); moetier runs GGUF models as transformers families"
        )
    if arch is None:
        raise UnknownArchitectureError(
            f"{path}: GGUF architecture {arch_name!r} is not supported; moetier reads GGUF models of {', '.join(ARCHS)}"
        )
    m = Meta(path, arch_name, metadata, tensors)
    if int(m.get("expert_count", 0)) == 0:
        raise UnknownArchitectureError(
            f"{path}: GGUF model of arch {arch_name!r} has no experts ({arch_name}.expert_count)"
        )
    kwargs = {**_common(m, arch, tensors), **arch.config(m)}
    model_type, architecture = arch.variant(m) if arch.variant else (arch.model_type, arch.architecture)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [architecture]
    return config, arch


def hf_locations(
    path: Path, tensors: dict[str, GGUFTensor], config: PretrainedConfig, family: Family | None, arch: GGUFArch
) -> list[TensorLocation]:
    """Every GGUF tensor as TensorLocation(s) under transformers' checkpoint names (experts split per expert; MLA's
    k_b / v_b pair merged back into kv_b_proj). `family` None: a seam family, named by `arch.experts`."""
    n_experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)
                    or getattr(config, "n_routed_experts", 0) or 0)  # fmt: skip
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    if family is not None:
        block = family.ckpt_block
        fills = {"blk": block, "shared": family.shared_attr or "?", "shared_gate": family.shared_gate_attr or "?"}
        templates = {p: block + "." + src.tensor for p, src in family.sources.items()}
        has_shared = family.shared_attr is not None
    else:
        if arch.experts is None:
            raise UnknownArchitectureError(f"{path}: GGUF arch {arch.gguf_arch!r} names no expert tensors")
        block, g, u, d = arch.experts
        fills = {"blk": block, "shared": "?", "shared_gate": "?"}
        templates = {p: f"{block}.experts.{{e}}.{n}.weight" for p, n in (("gate", g), ("up", u), ("down", d))}
        has_shared = False
    names = {**_LAYER_NAMES, **arch.names}
    out: list[TensorLocation] = []
    mla: dict[int, dict[str, GGUFTensor]] = {}
    qkvz: dict[int, dict[str, GGUFTensor]] = {}
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":  # read into the config's rope_parameters (llama3_rope)
            continue
        if gname in _GLOBAL_NAMES:
            out.append(_decoded(t, _GLOBAL_NAMES[gname], t.shape, arch.decode.get(gname)))
            continue
        m = BLOCK.match(gname)
        if m is None:
            raise CheckpointError(
                f"{t.file}: GGUF tensor {gname!r} has no transformers counterpart in {config.model_type}"
            )
        layer, rest = int(m.group(1)), m.group(2)
        if 0 <= layer - int(config.num_hidden_layers) < int(getattr(config, "num_nextn_predict_layers", 0) or 0):
            continue  # a multi-token-prediction (nextn) block, written after the layers: transformers does not run it
        prefix = f"model.layers.{layer}."
        if rest in _EXPERT_PIECES:
            if len(t.shape) != (2 if rest.endswith(".bias") else 3) or t.shape[0] != n_experts:
                raise CheckpointError(
                    f"{t.file}: tensor {gname!r} has shape {list(t.shape)}, expected {n_experts} experts first "
                    f"({arch.gguf_arch}.expert_count)"
                )
            template = templates.get(_EXPERT_PIECES[rest], "")
            if "{e}" not in template:
                raise CheckpointError(f"{t.file}: GGUF tensor {gname!r} has no per-expert counterpart in "
                                      f"{config.model_type}")  # fmt: skip
            for e in range(n_experts):
                out.append(location(t, prefix + template.format(e=e), t.shape[1:], expert=e))
            continue
        if rest in _MLA_KV_B and "attn_kv_a_mqa.weight" in arch.names:
            mla.setdefault(layer, {})[rest] = t
            continue
        if rest in QWEN3NEXT_QKVZ and arch.gguf_arch == "qwen3next":
            qkvz.setdefault(layer, {})[rest] = t
            continue
        if rest not in names or ("{shared" in names[rest] and not has_shared):
            raise CheckpointError(
                f"{t.file}: GGUF tensor {gname!r} has no transformers counterpart in {config.model_type}"
            )
        name = prefix + names[rest].format(**fills)
        shape = t.shape
        if rest == "ffn_gate_inp_shexp.weight":
            shape = (1, t.shape[-1])  # transformers' shared_expert_gate is a Linear(H, 1)
        elif rest in arch.row_vectors:
            shape = (1, t.shape[-1])
        elif rest == "ssm_conv1d.weight" and len(t.shape) == 2:
            shape = (t.shape[0], 1, t.shape[1])  # transformers' depthwise Conv1d [C, 1, K]; the converter squeezed it
        unpermute = None
        if arch.unpermute_qk and rest in ("attn_q.weight", "attn_k.weight"):
            unpermute = heads if rest == "attn_q.weight" else kv_heads
        if rest in arch.decode:
            out.append(_decoded(t, name, shape, arch.decode[rest]))
            continue
        out.append(location(t, name, shape, unpermute_heads=unpermute))
    out += [_kv_b(layer, pair, config) for layer, pair in sorted(mla.items())]
    out += [_qkvz(layer, pair, config) for layer, pair in sorted(qkvz.items())]
    return out


def _decoded(t: GGUFTensor, name: str, shape: tuple[int, ...], codec: str | None) -> TensorLocation:
    """`t` as `name`; with `codec` (GGUFArch.decode), wrapped: the stored tensor read and decoded, then `codec`."""
    loc = location(t, name, shape)
    if codec is None:
        return loc
    part = dataclasses.replace(loc, name=name + ":stored")
    return TensorLocation(name, t.file, t.offset, t.nbytes, codec, shape, (part,))


def _qkvz(layer: int, pair: dict[str, GGUFTensor], config: PretrainedConfig) -> TensorLocation:
    """Qwen3-Next's in_proj_qkvz [nk (2 hk + 2 r hv), H] of one layer from llama.cpp's attn_qkv [2 nk hk + nv hv, H]
    and attn_gate [nv hv, H] (codec `qwen3next_qkvz`, formats/codecs_gguf.py: each part decoded, rows regrouped per
    key head; r = nv / nk value heads per key head)."""
    qkv_name, gate_name = QWEN3NEXT_QKVZ
    some = next(iter(pair.values()))
    if set(pair) != set(QWEN3NEXT_QKVZ):
        missing = qkv_name if qkv_name not in pair else gate_name
        raise CheckpointError(f"{some.file}: blk.{layer}.{missing} is missing (Qwen3-Next's attn_qkv and attn_gate "
                              "come as a pair)")  # fmt: skip
    qkv, gate = pair[qkv_name], pair[gate_name]
    nk, hk = int(config.linear_num_key_heads), int(config.linear_key_head_dim)
    nv, hv, hidden = int(config.linear_num_value_heads), int(config.linear_value_head_dim), int(config.hidden_size)
    for t, want in ((qkv, (2 * nk * hk + nv * hv, hidden)), (gate, (nv * hv, hidden))):
        if tuple(t.shape) != want:
            raise CheckpointError(f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, expected {list(want)} "
                                  "from the ssm sizes in the metadata")  # fmt: skip
    name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
    parts = (location(qkv, name + ":qkv", qkv.shape), location(gate, name + ":z", (nk, nv // nk * hv, hidden)))
    return TensorLocation(name, qkv.file, qkv.offset, qkv.nbytes + gate.nbytes, "qwen3next_qkvz",
                          (nk * (2 * hk + 2 * nv // nk * hv), hidden), parts)  # fmt: skip


def _kv_b(layer: int, pair: dict[str, GGUFTensor], config: PretrainedConfig) -> TensorLocation:
    """kv_b_proj [nh (nope + v), kv_lora] of one layer from llama.cpp's k_b [nh, kv_lora, nope] and v_b
    [nh, v, kv_lora] (codec `mla_kv_b`, formats/codecs_gguf.py: each part decoded, k_b transposed back)."""
    k_name, v_name = _MLA_KV_B
    some = next(iter(pair.values()))
    if set(pair) != set(_MLA_KV_B):
        missing = k_name if k_name not in pair else v_name
        raise CheckpointError(f"{some.file}: blk.{layer}.{missing} is missing (MLA's k_b and v_b come as a pair)")
    k_b, v_b = pair[k_name], pair[v_name]
    nh, kv_lora = int(config.num_attention_heads), int(config.kv_lora_rank)
    nope, v = int(config.qk_nope_head_dim), int(config.v_head_dim)
    for t, want in ((k_b, (nh, kv_lora, nope)), (v_b, (nh, v, kv_lora))):
        if tuple(t.shape) != want:
            raise CheckpointError(f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, expected {list(want)} "
                                  "from the MLA sizes in the metadata")  # fmt: skip
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    parts = (location(k_b, name + ":k_b", k_b.shape), location(v_b, name + ":v_b", v_b.shape))
    return TensorLocation(name, k_b.file, k_b.offset, k_b.nbytes + v_b.nbytes, "mla_kv_b", (nh * (nope + v), kv_lora),
                          parts)  # fmt: skip


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path  # the first (or only) GGUF file
    config: PretrainedConfig
    family: Family | None  # None: a family run through transformers' experts seam (models/seam.py)
    arch: GGUFArch
    index: GGUFIndex
    metadata: dict[str, Any]

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """transformers' tokenizer built from the GGUF metadata (tokenizer.ggml.*), offline. AutoTokenizer first (it
        picks the family's tokenizer class); where transformers cannot read the file's architecture for that
        (deepseek2, glm4moe... it parses the whole config first), its generic fast tokenizer from the same
        metadata."""
        folder, name = str(self.path.parent), self.path.name
        try:
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except (OSError, ValueError, KeyError, TypeError) as first:
            try:
                return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{self.path}: transformers cannot build a tokenizer from its metadata ({first}; {exc})"
                ) from exc


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read a GGUF model's header(s) into config, family and index; no weight is read. Cached per file state."""
    return _open_cached(*_cache_key(path))


def _cache_key(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    p = Path(path).resolve()
    st = p.stat() if p.exists() else None
    return str(p), st.st_size if st else -1, st.st_mtime_ns if st else -1


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime: int) -> GGUFCheckpoint:
    files, metadata, tensors = read_gguf_model(path)
    first = files[0].path
    config, arch = build_config(first, metadata, tensors)
    family = find_row(config.model_type, config.architectures)
    if family is None and arch.experts is None:
        family = find_family(config.model_type, config.architectures)  # raises, naming the architecture
    if family is not None and arch.sources is not None:
        family = dataclasses.replace(family, sources=dict(arch.sources))
    converters = arch.converters() if arch.converters is not None else ()
    index = GGUFIndex(first.parent, hf_locations(first, tensors, config, family, arch), converters)
    return GGUFCheckpoint(first, config, family, arch, index, metadata)
