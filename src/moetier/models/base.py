"""Builds a family's transformers model without its experts and loads the rest.

1. the model is constructed with parameters on the meta device (buffers such as
   rotary frequencies are computed for real), so nothing is allocated for experts;
2. every MoE block (a decoder-layer child with an `experts` submodule) is found;
   the caller swaps it for a TieredMoE that keeps its router and shared experts;
3. every remaining parameter and persistent buffer is read from the checkpoint,
   cast to the compute dtype, and assigned. A missing tensor, a mis-shaped one, or
   a checkpoint tensor nobody consumed raises CheckpointError naming it.

Invariant: every weight assigned here is the process's own memory, read with pread
(formats/safetensors.py read_tensor), also when the compute dtype is the checkpoint's
own (no cast): nothing stays memory-mapped from the checkpoint, so a file truncated or
replaced under a running engine can never fault it with SIGBUS (tests/models/test_base_mmap.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from moetier.errors import CheckpointError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.location import TensorLocation
from moetier.formats.safetensors import read_tensor
from moetier.models.families import Family
from moetier.store import hostmem


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Create nn.Parameters on the meta device; buffers stay real (they are small and computed)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass
class MoESite:
    layer: int  # decoder layer index
    path: str  # module path of the block in the model, e.g. "model.layers.3.mlp"
    ckpt_prefix: str  # its prefix in checkpoint tensor names, e.g. "model.layers.3.block_sparse_moe."
    block: nn.Module  # the original (meta) block


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    try:
        with meta_parameters():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        arch = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise CheckpointError(f"config.json: transformers cannot build {arch} from it: {exc!r}") from exc
    return model.eval()


def find_moe_sites(model: nn.Module, family: Family) -> list[MoESite]:
    sites = []
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    for i, layer in enumerate(layers):
        block = getattr(layer, family.block_attr, None)
        if block is not None and hasattr(block, "experts"):
            path = f"model.layers.{i}.{family.block_attr}"
            sites.append(MoESite(i, path, f"model.layers.{i}.{family.ckpt_block}.", block))
    if not sites:
        raise CheckpointError(f"no MoE block found under model.layers.*.{family.block_attr} for family {family.name}")
    return sites


def checkpoint_name(name: str, sites: list[MoESite], family: Family) -> str:
    """Model state-dict name -> checkpoint tensor name (the seam: by transformers' renamings, models/seam.py)."""
    if family.seam:
        return family.ckpt_names.get(name, name)
    for site in sites:
        if name.startswith(site.path + "."):
            name = site.ckpt_prefix + name[len(site.path) + 1 :]
            break
    for model_part, ckpt_part in family.extra_renames:
        name = name.replace(model_part, ckpt_part)
    return name


def locate(index: CheckpointIndex, name: str, ckpt: str, current: torch.Tensor, tied: bool) -> TensorLocation | None:
    """Where model tensor `name` (checkpoint name `ckpt`) is stored, checked against the model's shape; None for a
    tied lm_head the checkpoint leaves out. CheckpointError naming the tensor when it is missing or mis-shaped."""
    if ckpt not in index:
        if tied and name == "lm_head.weight":
            return None
        raise CheckpointError(f"{index.folder}: tensor {ckpt!r} (for {name}) is missing from the checkpoint")
    loc = index[ckpt]
    if tuple(loc.shape) != tuple(current.shape):
        raise CheckpointError(
            f"{loc.file}: tensor {ckpt!r} has shape {list(loc.shape)}, expected {list(current.shape)} from config.json"
        )
    return loc


def load_non_experts(
    model: nn.Module,
    index: CheckpointIndex,
    sites: list[MoESite],
    family: Family,
    dtype: torch.dtype,
    tied: bool,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Assign every parameter / persistent buffer from the checkpoint. Returns the names consumed."""
    consumed: set[str] = set()
    wanted = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if not skip(n)]
    keep_fp32 = _fp32_names(model, dtype)
    by_file: dict[str, list[tuple[str, str, Any]]] = {}
    for name, current in wanted:
        ckpt = checkpoint_name(name, sites, family)
        loc = locate(index, name, ckpt, current, tied)
        if loc is None:
            continue
        by_file.setdefault(str(loc.file), []).append((name, ckpt, current))
    for file, items in by_file.items():
        for name, ckpt, current in items:
            tensor = read_tensor(index[ckpt])  # pread into owned memory, never a map; decoded here, once
            if tensor.is_floating_point() != current.is_floating_point():
                raise CheckpointError(
                    f"{file}: tensor {ckpt!r} is stored as {tensor.dtype}, but the model expects "
                    f"{'a floating-point' if current.is_floating_point() else 'an integer'} tensor"
                )
            if tensor.is_floating_point():  # converted into a buffer on huge pages where large (store/hostmem.py)
                tensor = hostmem.to(tensor, torch.float32 if any(k in name for k in keep_fp32) else dtype)
            assign(model, name, tensor)
            consumed.add(ckpt)
    if tied:
        m: Any = model  # a transformers PreTrainedModel
        m.get_output_embeddings().weight = m.get_input_embeddings().weight
    return consumed


def _fp32_names(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """Name fragments transformers keeps in fp32 (e.g. DeepSeek-V3's e_score_correction_bias)."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return names


def ignored_unexpected(model: nn.Module) -> list[re.Pattern[str]]:
    """Checkpoint tensors transformers deliberately skips (e.g. DeepSeek-V3's multi-token-prediction layer)."""
    return [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]


def assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Set parameter (frozen) or buffer `name` of `model` to `tensor`."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


def check_all_consumed(index: CheckpointIndex, consumed: set[str], ignored: list[re.Pattern[str]]) -> None:
    extra = [n for n in index.names() if n not in consumed and not any(p.search(n) for p in ignored)]
    if extra:
        where = index[extra[0]].file
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise CheckpointError(
            f"{where}: the checkpoint has {len(extra)} tensor(s) that config.json does not account for: {shown}"
        )
