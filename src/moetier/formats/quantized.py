"""Rewrites a checkpoint index per config.json's `quantization_config` into logical encoded tensors.

A quantised checkpoint stores one logical tensor as several stored ones (formats/encoded.py). Each
method here names the stored tensors that make up one logical tensor, validates them (dtype, shape,
scale grid against the configured block or group size) and replaces them in the index by one
encoded `TensorLocation` under the logical name transformers' bf16 model uses:

    fp8                 X.weight F8_E4M3 [..., N, K] + X.weight_scale_inv       -> X.weight [..., N, K]
    mxfp4               X_blocks U8 [..., R, G, 16] + X_scales U8 [..., R, G]  -> X [..., 32G, R]
    gptq (4 bit)        X.qweight + X.qzeros + X.scales (+ X.g_idx)             -> X.weight [N, K]
    awq (4 bit, gemm)   X.qweight + X.qzeros + X.scales                         -> X.weight [N, K]
    compressed-tensors  X.weight_packed + X.weight_scale (+ X.weight_zero_point) + X.weight_shape
                        (pack-quantized int4)                                   -> X.weight [N, K]

Tensors the method leaves unquantised (norms, routers, `modules_to_not_convert`) stay as they
are. Invariants: every stored tensor of a quantised group is consumed by exactly one encoded
tensor (a scale without its weight is an error, not a leftover); every error is a CheckpointError
naming the file and the tensor; an unknown method or an unsupported bit width is refused with the
list of what is supported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moetier.errors import CheckpointError
from moetier.formats.codecs_quant import FP8_BLOCK_SIZES, fp8_codec_name
from moetier.formats.location import TensorLocation

SUPPORTED = {
    "fp8": "block-scaled FP8 e4m3 (weight_block_size)",
    "mxfp4": "MXFP4 (GPT-OSS experts)",
    "gptq": "GPTQ 4-bit (v1 or v2 zeros, with or without g_idx)",
    "awq": "AWQ 4-bit, gemm packing",
    "compressed-tensors": "compressed-tensors pack-quantized int4 (W4A16)",
}
_FLOAT_SCALES = ("F32", "BF16", "F16")

Tensors = dict[str, TensorLocation]


def supported_methods() -> str:
    return "; ".join(f"{m}: {what}" for m, what in SUPPORTED.items())


def check_method(qcfg: Any, where: str) -> str:
    """The method of a quantization_config, or CheckpointError naming it and what is supported."""
    if not isinstance(qcfg, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object, got {type(qcfg).__name__}")
    method = qcfg.get("quant_method")
    if method not in SUPPORTED:
        raise CheckpointError(
            f"{where}: quantization method {method!r} is not supported; moetier reads {supported_methods()}"
        )
    return str(method)


def apply_quantization(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    """`tensors` (name -> stored location) with each quantised group replaced by its encoded tensor."""
    method = check_method(qcfg, f"{where}/config.json")
    out = _RULES[method](dict(tensors), qcfg, where)
    return dict(sorted(out.items()))


def _err(loc: TensorLocation, what: str) -> CheckpointError:
    return CheckpointError(f"{loc.file}: tensor {loc.name!r} {what}")


def _encoded(name: str, codec: str, shape: tuple[int, ...], parts: list[TensorLocation]) -> TensorLocation:
    first = parts[0]
    return TensorLocation(name, first.file, first.offset, sum(p.nbytes for p in parts), codec, shape, tuple(parts))


def _take(tensors: Tensors, owner: TensorLocation, name: str, dtypes: tuple[str, ...], role: str) -> TensorLocation:
    """Pop the companion `name` of `owner`, checking it exists and has one of `dtypes`."""
    loc = tensors.pop(name, None)
    if loc is None:
        raise _err(owner, f"has no {role} tensor {name!r} in the checkpoint (missing scales or zeros)")
    if loc.dtype not in dtypes:
        raise _err(loc, f"({role} of {owner.name!r}) has dtype {loc.dtype}, expected one of {list(dtypes)}")
    return loc


def _ints(qcfg: Mapping[str, Any], key: str, where: Path) -> int:
    value = qcfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{where}/config.json: quantization_config.{key} is {value!r}, expected an integer")
    return value


def _orphans(tensors: Tensors, suffixes: tuple[str, ...], method: str) -> None:
    for name, loc in tensors.items():
        if name.endswith(suffixes):
            raise _err(loc, f"looks like {method} quantisation data but its quantised weight is missing or unquantised")


# -- FP8 e4m3, block-scaled (DeepSeek-V3, Qwen3-FP8) -------------------------------------------------------------


def _fp8(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    cfg = f"{where}/config.json"
    block = qcfg.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise CheckpointError(
            f"{cfg}: quantization_config.weight_block_size is {block!r}; moetier reads block-scaled FP8 and needs "
            "two block sides, e.g. [128, 128] (per-tensor FP8 is not supported)"
        )
    bn, bk = int(block[0]), int(block[1])
    if bn not in FP8_BLOCK_SIZES or bk not in FP8_BLOCK_SIZES:
        raise CheckpointError(f"{cfg}: FP8 block {bn}x{bk} is not supported; block sides must be in {FP8_BLOCK_SIZES}")
    scheme = qcfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"{cfg}: FP8 activation_scheme {scheme!r} is not supported; moetier reads 'dynamic'")
    codec = fp8_codec_name(bn, bk)
    for name in [n for n, loc in tensors.items() if loc.dtype in ("F8_E4M3", "F8_E5M2")]:
        w = tensors.pop(name)
        if w.dtype != "F8_E4M3":
            raise _err(w, f"is {w.dtype}; moetier reads FP8 e4m3 weights only")
        if len(w.shape) < 2:
            raise _err(w, f"has shape {list(w.shape)}; an FP8 weight must be at least 2-D [..., N, K]")
        s = _take(tensors, w, name + "_scale_inv", _FLOAT_SCALES, "scale")
        *lead, n, k = w.shape
        grid = (*lead, math.ceil(n / bn), math.ceil(k / bk))
        if s.shape != grid:
            raise _err(
                s, f"has shape {list(s.shape)}, but weight {name!r} {list(w.shape)} with block size {bn}x{bk} "
                f"(weight_block_size in config.json) needs a scale grid of {list(grid)}: wrong block size or "
                "mis-shaped scales",
            )  # fmt: skip
        tensors[name] = _encoded(name, codec, w.shape, [w, s])
    _orphans(tensors, ("_scale_inv",), "FP8")
    return tensors


# -- MXFP4 (GPT-OSS) -------------------------------------------------------------------------------------------


def _mxfp4(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    for name in [n for n in tensors if n.endswith("_blocks")]:
        b = tensors.pop(name)
        base = name.removesuffix("_blocks")
        if b.dtype != "U8" or len(b.shape) < 3 or b.shape[-1] != 16:
            raise _err(b, f"is {b.dtype} {list(b.shape)}; MXFP4 blocks must be U8 [..., rows, groups, 16]")
        s = _take(tensors, b, base + "_scales", ("U8",), "E8M0 scale")
        if s.shape != b.shape[:-1]:
            raise _err(s, f"has shape {list(s.shape)}, expected {list(b.shape[:-1])} (one scale per block of {name!r})")
        *lead, rows, groups, _ = b.shape
        tensors[base] = _encoded(base, "mxfp4", (*lead, groups * 32, rows), [b, s])
    _orphans(tensors, ("_scales",), "MXFP4")
    return tensors


# -- GPTQ / AWQ int4 -------------------------------------------------------------------------------------------


def _bits4(qcfg: Mapping[str, Any], where: Path, key: str = "bits") -> None:
    bits = qcfg.get(key, 4)
    if bits != 4:
        method = qcfg.get("quant_method")
        raise CheckpointError(
            f"{where}/config.json: {method} with {key}={bits!r} is not supported; moetier reads 4-bit"
        )


def _group_count(qcfg: Mapping[str, Any], k: int) -> int | None:
    gs = qcfg.get("group_size", qcfg.get("q_group_size"))
    if not isinstance(gs, int) or isinstance(gs, bool):
        return None
    return 1 if gs <= 0 else math.ceil(k / gs)


def _gptq(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    _bits4(qcfg, where)
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"{where}/config.json: GPTQ checkpoint_format {fmt!r} is not supported; moetier reads 'gptq' and 'gptq_v2'"
        )
    v2 = "_v2" if fmt == "gptq_v2" else ""
    for name in [n for n in tensors if n.endswith(".qweight")]:
        qw = tensors.pop(name)
        base = name.removesuffix(".qweight")
        if qw.dtype != "I32" or len(qw.shape) != 2:
            raise _err(qw, f"is {qw.dtype} {list(qw.shape)}; GPTQ qweight must be I32 [K/8, N]")
        k, n = qw.shape[0] * 8, qw.shape[1]
        qz = _take(tensors, qw, base + ".qzeros", ("I32",), "zeros")
        sc = _take(tensors, qw, base + ".scales", _FLOAT_SCALES, "scales")
        groups = sc.shape[0] if len(sc.shape) == 2 else -1
        if sc.shape != (groups, n) or groups < 1:
            raise _err(sc, f"has shape {list(sc.shape)}, expected [groups, {n}] (N from {name!r})")
        if n % 8 or qz.shape != (groups, n // 8):
            raise _err(qz, f"has shape {list(qz.shape)}, expected {[groups, n // 8]} (packed zeros of {name!r})")
        want = _group_count(qcfg, k)
        g_idx = tensors.pop(base + ".g_idx", None)
        if g_idx is not None:
            if g_idx.dtype != "I32" or g_idx.shape != (k,):
                raise _err(g_idx, f"is {g_idx.dtype} {list(g_idx.shape)}, expected I32 [{k}] (K of {name!r})")
            parts, codec = [qw, qz, sc, g_idx], f"gptq4{v2}"
        else:
            if k % groups:
                raise _err(sc, f"has {groups} groups, which do not divide K={k} of {name!r} (and there is no g_idx)")
            parts, codec = [qw, qz, sc], f"gptq4{v2}_noidx"
        if want is not None and want != groups and not (qcfg.get("desc_act") and g_idx is not None):
            raise _err(sc, f"has {groups} groups, but group_size {qcfg.get('group_size')} in config.json gives {want}")
        tensors[base + ".weight"] = _encoded(base + ".weight", codec, (n, k), parts)
    _orphans(tensors, (".qzeros", ".scales", ".g_idx"), "GPTQ")
    return tensors


def _awq(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    _bits4(qcfg, where, "bits" if "bits" in qcfg else "w_bit")
    version = str(qcfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{where}/config.json: AWQ version {version!r} is not supported; moetier reads 'gemm'")
    if qcfg.get("zero_point", True) is not True:
        raise CheckpointError(f"{where}/config.json: AWQ without zero points is not supported")
    for name in [n for n in tensors if n.endswith(".qweight")]:
        qw = tensors.pop(name)
        base = name.removesuffix(".qweight")
        if qw.dtype != "I32" or len(qw.shape) != 2:
            raise _err(qw, f"is {qw.dtype} {list(qw.shape)}; AWQ qweight must be I32 [K, N/8]")
        k, n = qw.shape[0], qw.shape[1] * 8
        qz = _take(tensors, qw, base + ".qzeros", ("I32",), "zeros")
        sc = _take(tensors, qw, base + ".scales", _FLOAT_SCALES, "scales")
        groups = sc.shape[0] if len(sc.shape) == 2 else -1
        if sc.shape != (groups, n) or groups < 1 or k % groups:
            raise _err(sc, f"has shape {list(sc.shape)}, expected [groups dividing {k}, {n}] (from {name!r})")
        if qz.shape != (groups, n // 8):
            raise _err(qz, f"has shape {list(qz.shape)}, expected {[groups, n // 8]} (packed zeros of {name!r})")
        want = _group_count(qcfg, k)
        if want is not None and want != groups:
            raise _err(sc, f"has {groups} groups, but the group size in config.json gives {want}")
        tensors[base + ".weight"] = _encoded(base + ".weight", "awq4", (n, k), [qw, qz, sc])
    _orphans(tensors, (".qzeros", ".scales"), "AWQ")
    return tensors


# -- compressed-tensors pack-quantized int4 --------------------------------------------------------------------


def _compressed(tensors: Tensors, qcfg: Mapping[str, Any], where: Path) -> Tensors:
    cfg = f"{where}/config.json"
    fmt = qcfg.get("format")
    groups_cfg = qcfg.get("config_groups") or {}
    if fmt != "pack-quantized" or not isinstance(groups_cfg, Mapping):
        raise CheckpointError(f"{cfg}: compressed-tensors format {fmt!r} is not supported; moetier reads "
                              "'pack-quantized' int4 weights (W4A16)")  # fmt: skip
    for gname, group in groups_cfg.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
            raise CheckpointError(f"{cfg}: compressed-tensors group {gname!r} has weights {weights!r}; moetier "
                                  "reads 4-bit int weights")  # fmt: skip
        if (group or {}).get("input_activations"):
            raise CheckpointError(f"{cfg}: compressed-tensors group {gname!r} quantises activations; moetier reads "
                                  "weight-only (W4A16) checkpoints")  # fmt: skip
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        wp = tensors.pop(name)
        base = name.removesuffix(".weight_packed")
        if wp.dtype != "I32" or len(wp.shape) != 2:
            raise _err(wp, f"is {wp.dtype} {list(wp.shape)}; pack-quantized weights must be I32 [N, K/8]")
        n, k = wp.shape[0], wp.shape[1] * 8
        sc = _take(tensors, wp, base + ".weight_scale", _FLOAT_SCALES, "scale")
        groups = sc.shape[1] if len(sc.shape) == 2 else -1
        if sc.shape != (n, groups) or groups < 1 or k % groups:
            raise _err(sc, f"has shape {list(sc.shape)}, expected [{n}, groups dividing {k}] (from {name!r})")
        shape_loc = _take(tensors, wp, base + ".weight_shape", ("I64", "I32"), "shape")
        if shape_loc.shape != (2,):
            raise _err(shape_loc, f"has shape {list(shape_loc.shape)}, expected [2]")
        parts, codec = [wp, sc], "ct_int4"
        zp = tensors.pop(base + ".weight_zero_point", None)
        if zp is not None:
            if zp.dtype != "I32" or zp.shape != (math.ceil(n / 8), groups) or n % 8:
                raise _err(zp, f"is {zp.dtype} {list(zp.shape)}, expected I32 [{math.ceil(n / 8)}, {groups}]")
            parts, codec = [wp, sc, zp], "ct_int4_zp"
        _check_shape_tensor(shape_loc, (n, k))
        tensors[base + ".weight"] = _encoded(base + ".weight", codec, (n, k), [*parts, shape_loc])
    _orphans(tensors, (".weight_scale", ".weight_zero_point", ".weight_shape"), "compressed-tensors")
    return tensors


def _check_shape_tensor(loc: TensorLocation, want: tuple[int, int]) -> None:
    """compressed-tensors records the logical shape as a tensor: it must agree with the packed one."""
    size = loc.nbytes // 2
    with open(loc.file, "rb") as f:
        f.seek(loc.offset)
        raw = f.read(loc.nbytes)
    if len(raw) != loc.nbytes:
        raise _err(loc, "is cut short: the file is truncated")
    got = tuple(int.from_bytes(raw[i * size : (i + 1) * size], "little", signed=True) for i in range(2))
    if got != want:
        raise _err(loc, f"says the weight is {list(got)}, but its packed form holds {list(want)}")


_RULES: dict[str, Callable[[Tensors, Mapping[str, Any], Path], Tensors]] = {
    "fp8": _fp8,
    "mxfp4": _mxfp4,
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed,
}
