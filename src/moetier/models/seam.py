"""Families through transformers' experts seam: the family's own modules, moetier's experts.

transformers 5.x decorates the experts module of most MoE families with
`use_experts_implementation`: the module's forward receives the tokens with the family's own
routing already done (`hidden_states [T, H]`, `top_k_index [T, k]`, `top_k_weights [T, k]`) and
returns the weighted sum of the experts' outputs [T, H]. Everything around it (router scoring,
group-limited top-k, expert bias, shared experts and their gates, dense layers, hybrid
linear-attention layers) stays transformers' code. So for a family without a row in
models/families.py, moetier swaps each decorated experts module for its own (runtime/moe_block.py
`TieredExperts`) and owns only where the experts live and how they are computed.

This module finds those experts modules in a meta skeleton, reads their shapes and flags, and
derives from transformers' own checkpoint conversion rules (conversion_mapping.py, applied with
`rename_source_key` exactly as transformers' loader applies them) where each expert's gate, up and
down weights are stored in the checkpoint:
- a converter that merges a per-expert module list (`experts.*.gate_proj.weight` +
  `experts.*.up_proj.weight` -> `experts.gate_up_proj`) -> per-expert tensors, `{e}` in the name;
- no converter (or a plain renaming) -> the fused tensor as the model holds it ([E, 2I, H], or
  [E, H, 2I] when the module is transposed; gate/up concatenated or interleaved per the module);
- a `Transpose` converter -> the fused tensor, transposed once more.
Any other conversion of an expert tensor is refused, naming it. Non-expert tensors get their model
name from the same renamings (`Family.ckpt_names`, model name -> checkpoint name).

Invariants: every MoE layer of a model has the same expert count and shapes (one pool layout);
the expert function is the family module's own `_apply_gate` on a [gate | up] product re-laid out
the way the module expects, so an expert's output is the reference module's (fp32: exact up to
matmul summation order).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.integrations.moe import _default_apply_gate
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from moetier.errors import CheckpointError, UnknownArchitectureError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.layout import ExpertSource
from moetier.formats.safetensors import read_tensor
from moetier.kernels.experts import SwiGLU
from moetier.kernels.qformat import linear
from moetier.models.base import assign, ignored_unexpected
from moetier.models.families import Family

log = logging.getLogger(__name__)
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")
_TOP_K_ATTRS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_experts_per_token", "experts_per_token",
                "top_k_experts")


@dataclass(frozen=True)
class SeamSite:
    layer: int  # decoder layer index
    path: str  # module path of the experts module, e.g. "model.layers.3.mlp.experts"
    module: nn.Module  # the original (meta) experts module


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int
    hidden: int
    inter: int
    has_bias: bool
    transposed: bool  # gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W convention)
    concatenated: bool  # gate_up rows [gate; up]; else interleaved [g0, u0, g1, u1, ...]


@dataclass(frozen=True)
class ModuleGLU:
    """The family experts module's own gating on moetier's slot views: act(gate) * up, or whatever the
    module's `_apply_gate` does (clamps, alpha-sigmoid, limits), between the two projections."""

    apply_gate: Callable[[torch.Tensor], torch.Tensor]  # [N, 2I] in the module's gate/up order -> [N, I]
    concatenated: bool

    def __call__(self, x: torch.Tensor, v: Any) -> torch.Tensor:
        h = linear(x, v.w13, v.b13)  # [N, 2I], gate rows first (canonical layout)
        if not self.concatenated:  # the module expects g0, u0, g1, u1, ...
            h = torch.stack(h.chunk(2, dim=-1), dim=-1).flatten(-2)  # [N, 2I]
        return linear(self.apply_gate(h), v.w2, v.b2)  # [N, H]


@dataclass(frozen=True)
class PlainExperts:
    """An experts module transformers does not decorate whose forward is nonetheless the seam's
    (hidden_states, top_k_index, top_k_weights) -> the weighted sum of the chosen experts' outputs, its experts
    gated the default way (act(gate) * up): each piece's parameter, stored [E * rows, cols] (the experts stacked
    along the rows), with the reader op of one expert's rows (models/families.py), and its activation."""

    params: Mapping[str, tuple[str, str]]  # parameter path in the module -> (piece, op)
    act: str  # attribute path of the module's activation


# class name -> its weights. DBRX: w1 / v1 / w2 [E * I, H], gate = x @ w1.T, up = x @ v1.T, (act(gate) * up) @ w2
PLAIN_EXPERTS: dict[str, PlainExperts] = {
    "DbrxExperts": PlainExperts({"mlp.w1": ("gate", "copy"), "mlp.v1": ("up", "copy"), "mlp.w2": ("down", "T")},
                                act="mlp.activation_fn"),
}  # fmt: skip


def _plain(module: nn.Module) -> PlainExperts | None:
    return PLAIN_EXPERTS.get(type(module).__name__)


def _expert_params(module: nn.Module) -> tuple[str, ...]:
    """The parameter paths of an experts module that hold expert weights."""
    plain = _plain(module)
    return tuple(plain.params) if plain is not None else tuple(_PARAM_PIECES)


# Seam families with an exactness test (tests/models/test_seam.py); others load with a logged warning
VERIFIED = frozenset({
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_v32",
    "deepseek_v4", "dots1", "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "inkling2_loop_text", "inkling2_text", "jamba",
    "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "mellum", "mimo_v2_flash", "minimax", "minimax_m2",
    "minimax_m3_vl_text", "phimoe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text", "sarvam_moe", "solar_open",
    "zaya",
})  # fmt: skip


def has_seam(config: PretrainedConfig) -> bool:
    """Whether the causal-LM class transformers builds for `config` lives in a modeling module with an experts
    class decorated by `use_experts_implementation` (the decorator gives the class `_apply_gate`)."""
    mapping = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = mapping.get(str(getattr(config, "model_type", "")))
    if name is None:
        return False
    cls = getattr(transformers, name, None)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    if module is None:
        return False
    return any(isinstance(obj, type) and issubclass(obj, nn.Module) and
               (hasattr(obj, "_apply_gate") or obj.__name__ in PLAIN_EXPERTS) for obj in vars(module).values())


def warn_unverified(config: PretrainedConfig, has_row: bool) -> None:
    """Log a warning for a seam family without an exactness test (a family with a row sent through the seam by
    `RuntimeConfig.seam` is tested both ways)."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in VERIFIED and not has_row:
        log.warning("%s runs through transformers' experts seam without an exactness test in moetier "
                    "(tests/models/test_seam.py); compare with transformers before trusting it", model_type)


def seam_sites(model: nn.Module) -> list[SeamSite]:
    """Every experts module transformers' `use_experts_implementation` decorated, by decoder layer."""
    sites = []
    for path, module in model.named_modules():
        decorated = hasattr(module, "has_gate") and hasattr(module, "is_transposed")
        if not path.endswith(".experts") or not (decorated or _plain(module)):
            continue
        m = _LAYER.search(path)
        if m is None:
            raise CheckpointError(f"experts module {path} is not inside a decoder layer (model.layers.N)")
        sites.append(SeamSite(int(m.group(1)), path, module))
    return sites


def expert_shape(sites: list[SeamSite], model_type: str) -> ExpertShape:
    """The one expert shape of every MoE layer; refuses what the pool layout cannot hold."""
    shapes = set()
    for s in sites:
        m: Any = s.module
        plain = _plain(m)
        if plain is not None:
            shapes.add(_plain_shape(s, plain, model_type))
            continue
        if not m.has_gate:
            raise UnknownArchitectureError(
                f"{model_type}: its experts are ungated (up -> activation -> down, no gate projection); moetier's "
                "expert slots hold gated experts (gate, up, down: formats/layout.py)"
            )
        if getattr(m, "has_post_expert_norm", False):
            raise UnknownArchitectureError(f"{model_type}: a norm after each expert is not supported yet")
        params = dict(m.named_parameters(recurse=False))
        if "gate_up_proj" not in params or "down_proj" not in params:
            raise UnknownArchitectureError(
                f"{model_type}: experts module {s.path} holds {sorted(params)}, not gate_up_proj + down_proj"
            )
        gu, dn = params["gate_up_proj"].shape, params["down_proj"].shape  # [E, 2I, H] / [E, H, I] (or transposed)
        t = bool(m.is_transposed)
        e, two_i, h = (gu[0], gu[2], gu[1]) if t else tuple(gu)
        if tuple(dn) != ((e, two_i // 2, h) if t else (e, h, two_i // 2)):
            raise UnknownArchitectureError(f"{model_type}: {s.path}.down_proj {list(dn)} does not match gate_up_proj")
        bias = "gate_up_proj_bias" in params
        shapes.add(ExpertShape(int(e), int(h), int(two_i) // 2, bias, t, bool(m.is_concatenated)))
    if len(shapes) != 1:
        raise UnknownArchitectureError(
            f"{model_type}: MoE layers differ in expert count or shape: {sorted(map(str, shapes))}"
        )
    return shapes.pop()


def _plain_shape(site: SeamSite, plain: PlainExperts, model_type: str) -> ExpertShape:
    """A PlainExperts module's shape: every parameter [E * I, H] (down too: its transpose is stacked)."""
    e = int(cast(Any, site.module).num_experts)
    shapes = {tuple(site.module.get_parameter(name).shape) for name in plain.params}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[0] % e:
        raise UnknownArchitectureError(
            f"{model_type}: experts module {site.path} holds {sorted(shapes)}, not {len(plain.params)} tensors of "
            f"[{e} experts * intermediate, hidden]"
        )
    rows, hidden = next(iter(shapes))
    return ExpertShape(e, int(hidden), int(rows) // e, has_bias=False, transposed=False, concatenated=True)


def top_k_of(config: PretrainedConfig, sites: list[SeamSite], model: nn.Module) -> int:
    """Experts per token: the config's attribute (families name it differently), else the router's `top_k`."""
    for attr in _TOP_K_ATTRS:
        k = getattr(config, attr, None)
        if isinstance(k, int) and k > 0:
            return k
    block = model.get_submodule(sites[0].path.rsplit(".", 1)[0])
    for sub in block.modules():
        k = getattr(sub, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    raise CheckpointError(f"config.json: no experts-per-token setting found (looked for {', '.join(_TOP_K_ATTRS)})")


# --------------------------------------------------------------------------- checkpoint names


def _fused_ops(piece: str, shape: ExpertShape, flip: bool) -> str:
    """The reader op of `piece` read from the fused tensor as the model holds it (`flip`: stored transposed)."""
    t = shape.transposed != flip
    if piece == "down":
        return "T" if t else "copy"
    if piece == "down_bias":
        return "copy"
    first = piece.startswith("gate")
    if piece.endswith("_bias"):
        return ("top" if first else "bottom") if shape.concatenated else ("even" if first else "odd")
    if shape.concatenated:
        return ("T_top" if first else "T_bottom") if t else ("top" if first else "bottom")
    return ("T_even" if first else "T_odd") if t else ("even" if first else "odd")


_PARAM_PIECES = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",), "gate_up_proj_bias": ("gate_bias", "up_bias"),
                 "down_proj_bias": ("down_bias",)}  # fmt: skip


def _template(key: str, pattern: str) -> str:
    """A per-expert checkpoint key and the converter pattern that matched it -> the name with `{e}`."""
    rx = pattern.replace("*", r"(\d+)")  # transformers' patterns are regexes whose `*` globs the expert index
    m = re.search(rx, key)
    if m is None or m.lastindex != 1:
        raise CheckpointError(f"checkpoint tensor {key!r}: cannot find the expert index of pattern {pattern!r}")
    return key[: m.start(1)] + "{e}" + key[m.end(1) :]


@dataclass
class Conversion:
    """Non-expert tensors transformers converts at load (e.g. q/k/v conv weights concatenated, a fused qkv
    split): its converter, the checkpoint keys per source pattern, and every model name it produces."""

    converter: WeightConverter
    keys: dict[str, list[str]]  # source pattern -> checkpoint keys, in checkpoint order
    targets: dict[str, str]  # target pattern -> model name


@dataclass
class SeamLayout:
    prefixes: dict[int, str]  # MoE layer -> common checkpoint prefix of its expert tensors
    sources: dict[str, ExpertSource]  # piece -> source, relative to the prefix (the same for every layer)
    ckpt_names: dict[str, str]  # non-expert model name -> checkpoint name
    conversions: dict[str, Conversion]  # non-expert model name (first target) -> what transformers converts into it


def checkpoint_layout(model: nn.Module, index: CheckpointIndex, sites: list[SeamSite], shape: ExpertShape,
                      model_type: str) -> SeamLayout:  # fmt: skip
    """Where each expert piece and each non-expert tensor lives in the checkpoint, by transformers' rules (and, for
    a GGUF index, the converters of the names only it uses: formats/gguf.GGUFIndex.converters)."""
    transforms = get_model_conversion_mapping(cast(PreTrainedModel, model))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)] + list(getattr(index, "converters", ()))
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict(model.state_dict(keep_vars=True))
    owner = {f"{s.path}.{p}": s for s in sites for p in _expert_params(s.module)}
    found: dict[int, dict[str, tuple[str, str]]] = {s.layer: {} for s in sites}  # layer -> piece -> (name, op)
    ckpt_names: dict[str, str] = {}
    conversions: dict[str, Conversion] = {}
    ignored = ignored_unexpected(model)  # what transformers skips at load (e.g. Qwen3-Next's `mtp.*`): not read here
    for key in index.names():
        if any(p.search(key) for p in ignored):
            continue
        target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None), meta)
        site = owner.get(target)
        if site is None:
            conv = by_pattern.get(pattern) if pattern is not None else None
            if conv is not None and pattern is not None and conv.operations:
                _add_conversion(conversions, conv, pattern, key, target, index)
            else:
                ckpt_names[target] = key
            continue
        param = target[len(site.path) + 1 :]
        plain = _plain(site.module)
        if plain is not None and pattern is None:  # a PlainExperts module's parameter, as the model holds it
            piece, op = plain.params[param]
            found[site.layer][piece] = (key, op)
            continue
        pieces = _PARAM_PIECES.get(param, ())
        if pattern is None:  # the fused tensor as the model holds it
            for piece in pieces:
                found[site.layer][piece] = (key, _fused_ops(piece, shape, flip=False))
            continue
        conv = by_pattern[pattern]
        ops = [type(o).__name__ for o in conv.operations]
        if ops[:1] == ["Inkling2LoopDequantizeExperts"] and pattern == conv.source_patterns[0]:
            ops = ops[1:]  # the weight alone (no scale tensor in the checkpoint): transformers passes it through
        if ops in ([], ["Transpose"]):
            for piece in pieces:
                found[site.layer][piece] = (key, _fused_ops(piece, shape, flip=bool(ops)))
        elif ops == ["Interleave"] and _deinterleaves(conv.operations[-1], param, shape):
            for piece in pieces:  # stored interleaved (g0, u0, g1, u1, ...), held concatenated
                found[site.layer][piece] = (key, _fused_ops(piece, dataclasses.replace(shape, concatenated=False),
                                                            flip=False))  # fmt: skip
        elif ops in (["MergeModulelist", "Concatenate"], ["MergeModulelist"]) and "*" in pattern:
            piece = pieces[conv.source_patterns.index(pattern)] if len(pieces) > 1 else pieces[0]
            found[site.layer].setdefault(piece, (_template(key, pattern), "copy"))
        else:
            raise UnknownArchitectureError(
                f"{model_type}: transformers converts expert tensor {key!r} with {ops}; moetier does not read that "
                "layout yet"
            )
    return _common_layout(found, ckpt_names, conversions, shape, model_type)


def _deinterleaves(op: Any, param: str, shape: ExpertShape) -> bool:
    """Whether transformers' `Interleave` op de-interleaves the gate/up dimension of `param` into the concatenated
    [gate; up] the module holds (Inkling 2 stores w13 interleaved)."""
    gate_up_dim = 2 if shape.transposed and param == "gate_up_proj" else 1
    return param.startswith("gate_up") and shape.concatenated and not op.inverse and op.dim == gate_up_dim


# what a non-expert conversion may do: all exact, no arithmetic (concatenations, splits, Inkling 2's unembedding
# cut to its unpadded vocabulary, Inkling 2 Loop's message queries regrouped)
_CONVERSION_OPS = ("Concatenate", "Split", "Inkling2UnpadVocab", "Inkling2LoopMergeMessageQueries")


def _add_conversion(conversions: dict[str, Conversion], conv: WeightConverter, pattern: str, key: str, target: str,
                    index: CheckpointIndex) -> None:  # fmt: skip
    ops = [type(o).__name__ for o in conv.operations]
    if any(op not in _CONVERSION_OPS for op in ops):
        raise UnknownArchitectureError(
            f"{index[key].file}: tensor {key!r} is converted by transformers with {ops} into {target!r}; moetier "
            f"converts non-expert tensors with {', '.join(_CONVERSION_OPS)} only"
        )
    first = conv.target_patterns[0]
    entry = conversions.setdefault(target, Conversion(conv, {}, {t: target.replace(first, t) for t in
                                                                 conv.target_patterns}))  # fmt: skip
    entry.keys.setdefault(pattern, []).append(key)


def converted_names(conversions: Mapping[str, Conversion]) -> set[str]:
    """Every model name that a conversion produces (load_non_experts skips them; `load_converted` loads them)."""
    return {name for c in conversions.values() for name in c.targets.values()}


def load_converted(model: nn.Module, index: CheckpointIndex, conversions: Mapping[str, Conversion],
                   dtype: torch.dtype) -> set[str]:  # fmt: skip
    """Read each conversion's checkpoint tensors, run transformers' own ops on them (in order), assign the
    results cast to `dtype`. Returns the checkpoint keys consumed."""
    consumed: set[str] = set()
    config = getattr(model, "config", None)
    for first, c in conversions.items():
        data: dict[str, Any] = {p: [read_tensor(index[k]) for k in keys] for p, keys in c.keys.items()}
        for op in c.converter.operations:
            data = op.convert(data, c.converter.source_patterns, c.converter.target_patterns, full_layer_name=first,
                              model=model, config=config)  # fmt: skip
        for pattern, tensor in data.items():
            name = c.targets.get(pattern)
            current = _state_entry(model, name) if name is not None else None
            if name is None or current is None or tuple(tensor.shape) != tuple(current.shape):
                raise CheckpointError(
                    f"transformers' {[type(o).__name__ for o in c.converter.operations]} of {sorted(c.keys)} gave "
                    f"{pattern!r} {list(tensor.shape)}, which does not match the model's {name!r}"
                )
            assign(model, name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
        consumed |= {k for keys in c.keys.values() for k in keys}
    return consumed


def _state_entry(model: nn.Module, name: str) -> torch.Tensor | None:
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    return owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)


def _common_layout(found: dict[int, dict[str, tuple[str, str]]], ckpt_names: dict[str, str],
                   conversions: dict[str, Conversion], shape: ExpertShape, model_type: str) -> SeamLayout:  # fmt: skip
    """Per-layer full names -> one prefix per layer and sources shared by every layer."""
    want = ("gate", "up", "down") + (("gate_bias", "up_bias", "down_bias") if shape.has_bias else ())
    prefixes: dict[int, str] = {}
    sources: dict[str, ExpertSource] | None = None
    for layer, pieces in sorted(found.items()):
        missing = [p for p in want if p not in pieces]
        if missing:
            raise CheckpointError(f"layer {layer}: no checkpoint tensor holds the experts' {', '.join(missing)}")
        names = [pieces[p][0] for p in want]
        base, cut = names[0], 0
        while True:  # the longest dotted prefix every name shares, not reaching into `{e}`
            nxt = base.find(".", cut)
            if nxt < 0 or "{e}" in base[cut:nxt] or not all(n.startswith(base[: nxt + 1]) for n in names):
                break
            cut = nxt + 1
        prefixes[layer] = base[:cut]
        rel = {p: ExpertSource(pieces[p][0][cut:], pieces[p][1]) for p in want}
        if sources is None:
            sources = rel
        elif rel != sources:
            raise UnknownArchitectureError(
                f"{model_type}: expert tensors are named differently in layer {layer} than in earlier layers"
            )
    assert sources is not None
    return SeamLayout(prefixes, sources, ckpt_names, conversions)


def seam_family(config: PretrainedConfig, layout: SeamLayout, row: Family | None) -> Family:
    """The Family of a model run through the seam: the derived sources, no block swap, no lean decoder."""
    model_type = str(config.model_type)
    arch = (getattr(config, "architectures", None) or [model_type])[0]
    base = row or Family(name=model_type, model_types=(model_type,), architectures=(arch,),
                         sources=layout.sources, intermediate_attr="")  # fmt: skip
    return dataclasses.replace(base, sources=layout.sources, expert_kind="module", lean_attention=None, seam=True,
                               ckpt_names=layout.ckpt_names, conversions=layout.conversions)  # fmt: skip


def expert_fn(sites: list[SeamSite], shape: ExpertShape) -> ModuleGLU | SwiGLU:
    """SwiGLU (which the native executor runs) where the module gates the default way (act(gate) * up on a
    concatenated product, no biases); else the module's own `_apply_gate` (ModuleGLU)."""
    module: Any = sites[0].module
    plain = _plain(module)
    if plain is not None:
        return SwiGLU(act=operator.attrgetter(plain.act)(module))
    if type(module)._apply_gate is _default_apply_gate and shape.concatenated and not shape.has_bias:
        return SwiGLU(act=module.act_fn)
    return ModuleGLU(apply_gate=module._apply_gate, concatenated=shape.concatenated)
