"""Opening a checkpoint folder, below the store and the runtime: config.json and the family row, the
tensor index (headers validated), the compute dtype, the meta skeleton and its MoE sites, and the
expert reader that validates every expert tensor against the config. No pool is allocated and no
weight is read, so `describe` works for models whose experts do not fit in memory.

The runtime (runtime/wire.py) builds on `open_checkpoint`; `moetier quantize` (formats/quantize.py)
and `moetier info` use it alone.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.activations import ACT2FN

from moetier.errors import CheckpointError, ConfigError, UnknownArchitectureError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.codecs import CODECS
from moetier.formats.gguf import is_gguf
from moetier.formats.layout import ExpertLayout
from moetier.formats.qtier import QuantTier
from moetier.formats.quantized import check_method
from moetier.formats.safetensors import STORED_DTYPES, TORCH_DTYPES, ExpertReader
from moetier.kernels.experts import ExpertFn, GptOssGLU, SwiGLU
from moetier.models import seam as seam_mod
from moetier.models.base import (
    MoESite,
    build_skeleton,
    check_all_consumed,
    checkpoint_name,
    find_moe_sites,
    ignored_unexpected,
    locate,
)
from moetier.models.families import REFUSED, Family, find_row
from moetier.models.gguf_config import open_gguf

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str
    architecture: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int
    checkpoint_dtype: str
    expert_bytes: int  # one routed expert as stored in the checkpoint
    total_expert_bytes: int
    non_expert_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_config(path: str | os.PathLike[str]) -> tuple[PretrainedConfig, Family | None]:
    """config.json and the family's row (None: a family without a row, run through the seam, models/seam.py).
    A GGUF model (a .gguf file or a folder of one) gets both from its metadata (models/gguf_config.py). A
    composite (vision + text) checkpoint gives its text model's config (`text_config`): moetier runs the text
    model, whose tensors `_index` finds under the composite's language-model prefix."""
    if is_gguf(path):
        gguf = open_gguf(path)
        return gguf.config, gguf.family
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    family = find_row(raw.get("model_type"), raw.get("architectures"))
    if family is None and raw.get("model_type") in REFUSED:
        raise UnknownArchitectureError(
            f"{cfg_file}: model_type {raw['model_type']!r} ({raw.get('architectures') or []}) is not supported: "
            f"{REFUSED[raw['model_type']]}"
        )
    if raw.get("quantization_config"):
        check_method(raw["quantization_config"], str(cfg_file))  # supported methods: formats/quantized.py
    archs, model_type = raw.get("architectures") or [], raw.get("model_type")
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError) as exc:
        raise UnknownArchitectureError(
            f"{cfg_file}: unsupported architecture {archs} (model_type {model_type!r}): transformers cannot read "
            f"this config ({exc}); moetier runs the families of models/families.py and every transformers MoE "
            "family whose experts module has transformers' experts seam"
        ) from exc
    try:
        text = config.get_text_config()
    except ValueError:  # several text configs (an encoder and a decoder): not a vision + text composite
        text = config
    if text is not config and getattr(config, "vision_config", None) is not None:  # Qwen3.5-MoE, Qwen3-VL-MoE ...
        if getattr(config, "quantization_config", None) is not None:
            text.quantization_config = config.quantization_config
        text.architectures = list(archs)  # what `moetier info` shows: the checkpoint's own class
        config, model_type = text, str(text.model_type)
        family = find_row(model_type, None)
    if family is None and not seam_mod.has_seam(config):
        raise UnknownArchitectureError(
            f"{cfg_file}: unsupported architecture {archs} (model_type {model_type!r}): no family row in "
            "models/families.py and no experts module behind transformers' experts seam (a dense model, or an "
            "MoE family whose experts transformers does not expose); see docs/engine.md for the refused families"
        )
    return config, family


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(
    name: str, config: PretrainedConfig, device: torch.device, stored_experts: str | None = None
) -> torch.dtype:
    """auto: config.json's dtype, else the dtype the experts are stored in (e.g. "BF16"; bf16 for quantized
    experts), else fp32."""
    if name != "auto":
        return DTYPES[name]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if stored is None and stored_experts in TORCH_DTYPES:
        stored = TORCH_DTYPES[stored_experts]
    elif stored is None and stored_experts is not None and (stored_experts in CODECS or "fp8" in stored_experts):
        stored = torch.bfloat16  # quantized experts (FP8, MXFP4, GPTQ, GGUF blocks): compute in bf16
    dtype = (
        stored
        if isinstance(stored, torch.dtype)
        else DTYPES.get(
            str(stored).replace("bfloat16", "bf16").replace("float32", "fp32").replace("float16", "fp16"), torch.float32
        )
    )
    if dtype == torch.float16 and device.type == "cpu":
        dtype = torch.bfloat16  # fp16 matmul is very slow on CPUs; bf16 keeps the range
    return dtype


def expert_fn_for(family: Family, config: PretrainedConfig) -> ExpertFn:
    if family.expert_kind == "gptoss":
        return GptOssGLU(alpha=float(config.swiglu_alpha), limit=float(config.swiglu_limit))
    act = getattr(config, "hidden_act", None)
    if act not in ACT2FN:
        raise CheckpointError(f"config.json: hidden_act {act!r} is not an activation transformers knows")
    return SwiGLU(act=ACT2FN[act])


def expert_dtype(index: CheckpointIndex) -> str | None:
    return next((loc.dtype for name, loc in index.tensors.items() if ".experts." in name), None)


def _check_top_k(k: int, num_experts: int) -> None:
    if not 1 <= k <= num_experts:
        raise CheckpointError(f"config.json: num_experts_per_tok is {k}, must be between 1 and {num_experts} experts")


@dataclass
class Opened:
    """Steps 1-3 of opening a checkpoint: everything but pools and weights."""

    config: PretrainedConfig
    family: Family
    index: CheckpointIndex
    dtype: torch.dtype
    model: nn.Module
    sites: list[MoESite]  # row families: the MoE blocks; the seam: the experts modules
    num_experts: int
    hidden: int
    inter: int
    reader: ExpertReader
    expert_fn: ExpertFn
    top_k: int


def _index(path: str | os.PathLike[str], config: PretrainedConfig) -> CheckpointIndex:
    if is_gguf(path):
        return open_gguf(path).index
    index = CheckpointIndex(path, quantization=getattr(config, "quantization_config", None))
    prefixes = {p: to for p, to in LANGUAGE_MODEL.items() if any(n.startswith(p) for n in index.tensors)}
    if prefixes:
        text_model_view(index, prefixes)
    return index


# a composite checkpoint's text model, as transformers saves it (Qwen3.5-MoE: model.language_model.*; Aria,
# MiniMax-M3-VL: language_model.model.* and language_model.lm_head) -> the causal LM's own names
LANGUAGE_MODEL = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}  # fmt: skip
# the other towers of a composite, which moetier does not run (it runs the text model)
_OTHER_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.vision_model.",
                 "vision_model.", "model.multi_modal_projector.", "multi_modal_projector.", "model.audio_tower.",
                 "patch_merge_mlp.")  # fmt: skip


def text_model_view(index: CheckpointIndex, prefixes: dict[str, str]) -> None:
    """A composite checkpoint's index as its text model's: `model.language_model.X` found as `model.X` (`prefixes`:
    LANGUAGE_MODEL's that occur; each location keeps its stored name, which reads and messages use), the vision /
    audio towers and projectors set aside (logged, `index.set_aside`); any other tensor stays, so the usual checks
    refuse what nothing consumes."""
    renamed: dict[str, Any] = {}
    aside: list[str] = []
    for name, loc in index.tensors.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            renamed[prefixes[prefix] + name[len(prefix) :]] = loc
        elif name.startswith(_OTHER_TOWERS):
            aside.append(name)
        else:
            renamed[name] = loc
    index.tensors = renamed
    index.set_aside = aside
    if aside:
        log.info("%s: a composite checkpoint; moetier runs its text model and leaves %d tensors of its other "
                 "towers (%s...) unread", index.folder, len(aside), aside[0])  # fmt: skip


def open_index(path: str | os.PathLike[str]) -> CheckpointIndex:
    """The tensor index of any model moetier opens (a safetensors folder, quantized or not, or a GGUF model), headers
    validated, no weight read: what source fingerprints (quantized tiers, sparsity tables) hash."""
    return _index(path, read_config(path)[0])


def open_checkpoint(
    path: str | os.PathLike[str], dtype_name: str, device: torch.device, down_rows: bool = False, seam: bool = False
) -> Opened:
    """Open a checkpoint without pools or weights. A family without a row in models/families.py, or any family
    when `seam`, runs transformers' own MoE blocks with moetier's experts (models/seam.py)."""
    # 1. config and family; 2. the tensor index (headers validated) and the compute dtype
    config, row = read_config(path)
    index = _index(path, config)
    dtype = resolve_dtype(dtype_name, config, device, expert_dtype(index))
    # 3. the skeleton (parameters on meta), its MoE blocks (or experts modules), and the expert reader,
    #    which validates every expert tensor against the config
    model = build_skeleton(config, dtype)
    if row is None or seam:
        family, sites, shape, fn, top_k = _open_seam(model, config, index, row)
        num_experts, hidden, inter = shape.num_experts, shape.hidden, shape.inter
    else:
        family = row
        sites = find_moe_sites(model, family)
        experts: Any = sites[0].block.experts
        num_experts = int(experts.num_experts)
        hidden, inter = int(config.hidden_size), int(getattr(config, family.intermediate_attr))
        fn, top_k = expert_fn_for(family, config), int(getattr(config, "num_experts_per_tok", 0) or 0)
    _check_top_k(top_k, num_experts)
    prefixes = {s.layer: s.ckpt_prefix for s in sites}
    layout = ExpertLayout(hidden, inter, has_bias="down_bias" in family.sources, down_rows=down_rows)
    reader = ExpertReader(index, family.sources, layout, prefixes, num_experts, dtype)
    opened = Opened(config, family, index, dtype, model, sites, num_experts, hidden, inter, reader, fn, top_k)
    # 4. every other tensor, from the headers: what loading them would refuse is refused now, by every caller
    #    (the engine, `moetier info`, `moetier quantize`) with the same message
    try:
        check_non_experts(opened)
    except BaseException:
        reader.close()
        raise
    return opened


def _kept_by_block(name: str, sites: list[MoESite], family: Family) -> bool:
    """Whether state-dict `name` survives the swap of the MoE blocks (runtime/loader.py): a row family's TieredMoE
    keeps the block's router and shared experts; the seam's TieredExperts replaces the experts module whole."""
    for site in sites:
        if name.startswith(site.path + "."):
            if family.seam:
                return False
            head = name[len(site.path) + 1 :].split(".", 1)[0]
            return head in {a for a in (family.router_attr, family.shared_attr, family.shared_gate_attr) if a}
    return True


def check_non_experts(o: Opened) -> None:
    """Refuse, from the safetensors headers alone (no weight read), every non-expert tensor loading would refuse:
    one missing (a tied lm_head excepted), one whose shape is not the model's, one stored as an integer where the
    model wants a float (or the reverse) or in a dtype moetier cannot read, and any checkpoint tensor that neither
    the experts nor the model consume. The messages are those of models/base.load_non_experts and
    check_all_consumed, which run the same checks again while loading (runtime/loader.py)."""
    # 1. the names the loaded model keeps (its MoE blocks swapped) and the tensors transformers converts
    model, index, family = o.model, o.index, o.family
    tied = bool(getattr(o.config, "tie_word_embeddings", False))
    converted = seam_mod.converted_names(family.conversions)
    wanted = [(n, t) for n, t in model.state_dict(keep_vars=True).items()
              if n not in converted and _kept_by_block(n, o.sites, family)]  # fmt: skip
    # 2. each: present, the model's shape, the model's kind of dtype
    consumed: set[str] = set()
    for name, current in wanted:
        ckpt = checkpoint_name(name, o.sites, family)
        loc = locate(index, name, ckpt, current, tied)
        if loc is None:
            continue
        stored = torch.float32 if loc.encoded else STORED_DTYPES.get(loc.dtype)  # an encoded tensor decodes to fp32
        if stored is None:
            raise CheckpointError(f"{loc.file}: tensor {loc.name!r} has dtype {loc.dtype}, which moetier cannot read")
        if stored.is_floating_point != current.is_floating_point():
            raise CheckpointError(
                f"{loc.file}: tensor {ckpt!r} is stored as {stored}, but the model expects "
                f"{'a floating-point' if current.is_floating_point() else 'an integer'} tensor"
            )
        consumed.add(ckpt)
    # 3. nothing left over
    consumed |= {k for c in family.conversions.values() for keys in c.keys.values() for k in keys}
    check_all_consumed(index, consumed | o.reader.consumed, ignored_unexpected(model))


def _open_seam(
    model: nn.Module, config: PretrainedConfig, index: CheckpointIndex, row: Family | None
) -> tuple[Family, list[MoESite], seam_mod.ExpertShape, ExpertFn, int]:
    """The seam's family, sites, expert shape, expert function and experts per token (models/seam.py)."""
    model_type = str(config.model_type)
    seam_mod.warn_unverified(config, row is not None)
    found = seam_mod.seam_sites(model)
    if not found:
        raise UnknownArchitectureError(
            f"config.json: {model_type} has no MoE experts module moetier can run (transformers' "
            "use_experts_implementation seam); moetier runs Mixture-of-Experts models only"
        )
    shape = seam_mod.expert_shape(found, model_type)
    layout = seam_mod.checkpoint_layout(model, index, found, shape, model_type)
    family = seam_mod.seam_family(config, layout, row)
    sites = [MoESite(s.layer, s.path, layout.prefixes[s.layer], s.module) for s in found]
    return family, sites, shape, seam_mod.expert_fn(found, shape), seam_mod.top_k_of(config, found, model)


def describe(path: str | os.PathLike[str]) -> ModelInfo:
    """What `moetier info` shows, without allocating a pool or reading a weight (so it works for
    models whose experts do not fit in memory). Validates the checkpoint as the engine's wiring
    (runtime/wire.py) does."""
    o = open_checkpoint(path, "auto", torch.device("cpu"))
    try:
        return model_info(path, o)
    finally:
        o.reader.close()


def model_info(path: str | os.PathLike[str], o: Opened) -> ModelInfo:
    """What `moetier info` and `Engine.info` show of an opened checkpoint (no weight read)."""
    reader, index, config = o.reader, o.index, o.config
    expert_bytes = sum(r.nbytes for r in next(iter(reader.plans.values())))
    total_expert = sum(r.nbytes for plan in reader.plans.values() for r in plan)
    all_bytes = sum(loc.nbytes for loc in index.tensors.values())
    first = next(iter(reader.plans.values()))[0].loc.dtype
    return ModelInfo(
        path=str(path), family=o.family.name, architecture=(config.architectures or ["?"])[0],
        num_layers=int(config.num_hidden_layers), moe_layers=tuple(s.layer for s in o.sites),
        num_experts=o.num_experts, top_k=o.top_k, hidden_size=o.hidden,
        expert_intermediate=o.inter, checkpoint_dtype=first, expert_bytes=expert_bytes,
        total_expert_bytes=total_expert, non_expert_bytes=all_bytes - total_expert,
    )  # fmt: skip


def open_quant_tier(
    model_dir: str | os.PathLike[str], precision: str, group_size: int | None = None,
    root: str | os.PathLike[str] | None = None, *, down_rows: bool = False, verify: bool = True,
) -> QuantTier:  # fmt: skip
    """QuantTier.open for a caller that has not opened the checkpoint: opens it (meta skeleton, no weight read)
    for the reader the tier is validated against."""
    o = open_checkpoint(model_dir, "auto", torch.device("cpu"), down_rows=down_rows)
    o.reader.close()
    return QuantTier.open(model_dir, precision, group_size, root, reader=o.reader, verify=verify)
