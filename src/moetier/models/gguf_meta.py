"""GGUF metadata as typed reads, and the row type of one GGUF architecture (models/gguf_archs.py holds the rows).

`Meta` reads a model's `<arch>.*` keys with errors that name the file and key, and the tensor shapes that carry
sizes; `GGUFArch` says how one `general.architecture` becomes a transformers config (its config function and
names); the rope helpers turn llama.cpp's rope keys (and its `rope_freqs.weight` factors) back into transformers'
rope_parameters. Shared by the architecture rows and by models/gguf_config.py, which wires them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers.core_model_loading import WeightConverter

from moetier.errors import CheckpointError
from moetier.formats.gguf import GGUFTensor, location
from moetier.formats.layout import ExpertSource
from moetier.formats.location import read_bytes

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF `general.architecture` becomes a transformers config."""

    gguf_arch: str
    model_type: str
    architecture: str
    config: Callable[[Meta], dict[str, Any]]  # arch-specific config fields from the metadata
    unpermute_qk: bool = False  # llama.cpp's converter permuted q/k rows (interleaved RoPE)
    norm_topk_default: bool = False  # llama.cpp's behaviour when `<arch>.expert_weights_norm` is absent
    names: Mapping[str, str] = field(default_factory=dict)  # arch-only per-layer names, added to _LAYER_NAMES
    scale_attr: str | None = None  # config field of `<arch>.expert_weights_scale` (None: only 1.0 is accepted)
    # (model_type, architecture) chosen from the metadata, where one GGUF arch stands for several transformers
    # families (deepseek2: DeepSeek-V2's softmax router or V3's sigmoid one); None: the row's own
    variant: Callable[[Meta], tuple[str, str]] | None = None
    # seam families (no row in models/families.py): (checkpoint block, gate, up, down) of the per-expert tensor
    # names the transformers checkpoint uses, e.g. ("mlp", "gate_proj", "up_proj", "down_proj")
    experts: tuple[str, str, str, str] | None = None
    yarn_mscale: bool = False  # `rope.scaling.yarn_log_multiplier` is DeepSeek's 0.1 * mscale_all_dim
    # a row family whose checkpoint fuses experts (GPT-OSS's gate_up_proj [E, H, 2I]) while llama.cpp writes each piece
    # apart: the family's expert sources for GGUF input, per expert (`{e}`), each piece as llama.cpp stores it
    sources: Mapping[str, ExpertSource] | None = None
    # a seam family whose checkpoint fuses what llama.cpp stores apart (Granite's experts and shared MLP): transformers
    # WeightConverters of the names only the GGUF index uses (formats/gguf.GGUFIndex.converters, models/seam.py)
    converters: Callable[[], tuple[WeightConverter, ...]] | None = None
    # tensors the converter wrote transformed (GGUF name, per-layer part or global): codec (formats/codecs_gguf.py)
    # that gives the transformers value back from the stored one once that is decoded, e.g. Qwen3-Next's norms
    # written plus 1 ("minus_one")
    decode: Mapping[str, str] = field(default_factory=dict)
    # per-layer GGUF names of vectors transformers holds as [1, n] (ERNIE's score bias; llama-quantize writes [n])
    row_vectors: frozenset[str] = frozenset()


class Meta:
    """The `<arch>.*` metadata of a GGUF model, with typed getters whose errors name the file."""

    def __init__(self, path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> None:
        self.path, self.arch, self.metadata, self.tensors = path, arch, metadata, tensors

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise CheckpointError(f"{self.path}: {self.arch}.{key} differs per layer ({value}); not supported")
            value = value[0]
        return value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: GGUF tensor {name!r} is missing")
        return t.shape

    def moe_blocks(self) -> list[int]:
        return sorted(
            int(m.group(1)) for n in self.tensors if (m := BLOCK.match(n)) and m.group(2) == "ffn_gate_inp.weight"
        )

    def layers_and_nextn(self) -> tuple[int, int]:
        """(decoder layers, MTP blocks): llama.cpp counts `nextn_predict_layers` multi-token-prediction blocks in
        block_count and writes them last; transformers does not run them (hf_locations skips them)."""
        blocks = int(self.need("block_count"))
        nextn = int(self.get("nextn_predict_layers", 0))
        if not 0 <= nextn < blocks:
            raise CheckpointError(f"{self.path}: {self.arch}.nextn_predict_layers {nextn} leaves no layer of {blocks} "
                                  "blocks")  # fmt: skip
        return blocks - nextn, nextn

    def head_dim(self) -> int:
        """The attention head size (`attention.key_length`, else hidden / heads), which value_length must equal."""
        hidden, heads = int(self.need("embedding_length")), int(self.need("attention.head_count"))
        head_dim = int(self.get("attention.key_length", hidden // heads))
        if int(self.get("attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path}: {self.arch}.attention.value_length differs from key_length {head_dim}")
        return head_dim

    def expert_inter(self) -> int:
        """The routed expert's intermediate size: the metadata's, checked against the first expert tensor."""
        blocks = self.moe_blocks()
        if not blocks:
            raise CheckpointError(f"{self.path}: no blk.N.ffn_gate_inp.weight: this GGUF model has no MoE layer")
        name = f"blk.{blocks[0]}.ffn_gate_exps.weight"
        stored = self.shape(name)[1]
        value = self.get("expert_feed_forward_length", stored)
        if int(value) != stored:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {stored} rows per expert, metadata "
                f"{self.arch}.expert_feed_forward_length says {value}"
            )
        return stored


def rope_parameters(m: Meta, yarn_mscale: bool = False) -> dict[str, Any]:
    """transformers' rope_parameters from llama.cpp's rope keys: default, linear, or YaRN (what its converter writes
    from a checkpoint's rope_scaling: factor, original context, attention factor, beta fast / slow). Keys with no
    transformers counterpart (an extrapolation factor other than 1, DeepSeek's log multiplier, LongRoPE's factor
    tensors, a generic attention factor) are refused naming the key. `yarn_mscale`: the log multiplier is
    DeepSeek's (0.1 * mscale_all_dim, written by llama.cpp's deepseek2 converter), given back as transformers'
    mscale and mscale_all_dim (equal: the converter keeps only one, and DeepSeek's published configs set both alike)."""
    theta = float(m.get("rope.freq_base", 10000.0))
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind not in ("linear", "yarn"):
        raise CheckpointError(f"{m.path}: {m.arch}.rope.scaling.type {kind!r} is not supported for GGUF input "
                              "(default, linear and yarn are)")  # fmt: skip
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    for key, neutral in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_ext_factor", 1.0),
                         ("rope.scaling.yarn_log_multiplier", 0.0)):  # fmt: skip
        if yarn_mscale and kind == "yarn" and key == "rope.scaling.yarn_log_multiplier":
            continue
        v = m.get(key)
        if v is not None and float(v) != neutral:
            raise CheckpointError(f"{m.path}: {m.arch}.{key} = {v} has no transformers counterpart; not supported")
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": theta, "factor": float(m.need("rope.scaling.factor"))}
    if kind == "yarn":
        out["original_max_position_embeddings"] = int(m.need("rope.scaling.original_context_length"))
        for key, name in (("rope.scaling.yarn_attn_factor", "attention_factor"),
                          ("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            v = m.get(key)  # fmt: skip
            if v is not None:
                out[name] = float(v)
        if yarn_mscale and log_mul is not None:
            out["mscale"] = out["mscale_all_dim"] = float(log_mul) / 0.1
    return out


def llama3_rope(m: Meta, t: GGUFTensor, theta: float, dim: int) -> dict[str, Any]:
    """transformers' `llama3` rope_parameters back from the per-frequency factors llama.cpp's converter writes for
    it (`rope_freqs.weight`, [dim / 2] F32; the one tensor read here): the factor is their largest; frequencies at
    factor 1 and at the factor bound the thresholds; in between, 1 / r = (1 - s) / factor + s with s linear in 1 /
    wavelength, which fixes where both thresholds lie (the original context then only scales low_freq_factor and
    high_freq_factor along, so 8192, Llama's, is taken). With no frequency in between (Llama-4 Scout's equal
    factors) the thresholds meet between the two groups. The recovered parameters must give back every factor to
    1e-5, or the file is refused."""
    if t.type_name != "F32" or t.shape != (dim // 2,):
        raise CheckpointError(f"{t.file}: tensor 'rope_freqs.weight' is {t.type_name} {list(t.shape)}, expected F32 "
                              f"[{dim // 2}] for head dimension {dim}")  # fmt: skip
    r = np.frombuffer(read_bytes(location(t, "rope_freqs", t.shape)), dtype=np.float32).astype(np.float64)
    wl = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)  # wavelength of each frequency
    factor = float(r.max())
    if factor <= 1.0 + 1e-6:
        return {"rope_type": "default", "rope_theta": theta}
    one, top = np.abs(r - 1) <= 1e-6 * factor, np.abs(r - factor) <= 1e-6 * factor
    mid = ~(one | top)
    orig = 8192.0
    if mid.sum() >= 2:  # s = a / wl + b, least squares over the frequencies in between
        smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wl[mid], smooth, 1)
        low, high = -b * orig / a, (1 - b) * orig / a  # s = 0 at wl = orig / low, s = 1 at wl = orig / high
    elif mid.sum() == 0 and one.any() and top.any() and wl[one].max() < wl[top].min():
        orig = float(round(math.sqrt(wl[one].max() * wl[top].min())))  # (an integer, as transformers wants)
        low = high = 1.0
    else:
        raise CheckpointError(f"{t.file}: tensor 'rope_freqs.weight' does not determine a Llama-3 RoPE scaling "
                              f"({int(mid.sum())} frequency between the two bounds)")  # fmt: skip
    out = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": float(low),
           "high_freq_factor": float(high), "original_max_position_embeddings": int(orig)}  # fmt: skip
    back = np.where(wl < orig / high, 1.0, np.where(wl > orig / low, factor, 0.0))
    if mid.any():
        s_ = (orig / wl[mid] - low) / (high - low)
        back[mid] = 1 / ((1 - s_) / factor + s_)
    if not np.allclose(back, r, rtol=1e-5, atol=0):
        raise CheckpointError(f"{t.file}: tensor 'rope_freqs.weight' does not follow Llama-3 RoPE scaling (worst "
                              f"factor off by {float(np.abs(back - r).max()):.3g})")  # fmt: skip
    return out


def partial_rope(m: Meta, head_dim: int) -> dict[str, Any]:
    """rope_parameters with the rotary part of the head (`rope.dimension_count`) as transformers' partial factor."""
    rope_dim = int(m.get("rope.dimension_count", head_dim))
    rope = rope_parameters(m)
    rope["partial_rotary_factor"] = rope_dim / head_dim
    if not 0 < rope_dim <= head_dim or rope_dim % 2 or int(head_dim * rope["partial_rotary_factor"]) != rope_dim:
        raise CheckpointError(f"{m.path}: {m.arch}.rope.dimension_count {rope_dim} is not a rotary part of the "
                              f"{head_dim}-wide head transformers can express")  # fmt: skip
    return rope
