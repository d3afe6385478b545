"""Reference quantisers and float64 dequantisers of the quantised safetensors formats, for the tests.

Quantised tiny checkpoints: a tiny fp32 checkpoint converted to FP8 / MXFP4 / GPTQ / AWQ by the tests
themselves, from the formats' specifications, plus its dequantised twin (the same folder with every
quantised tensor replaced by its float32 dequantisation, written with float64 arithmetic).

The quantisers below are independent of moetier.formats: they encode by the spec (nibble order, zero-point
convention, block grid), and the twins decode with plain float64 loops over the spec, so a test comparing
moetier's load of the quantised folder with transformers' load of the twin checks moetier's decoding.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TINY_OVERRIDES: dict[str, dict[str, Any]] = {"gpt_oss": {"intermediate_size": 32}}  # MXFP4 needs 32 | I


def quantisable(name: str, t: torch.Tensor) -> bool:
    """A linear layer's weight (attention, experts, shared experts); not embeddings, norms, routers, lm_head."""
    return (
        name.endswith(".weight") and t.dim() == 2 and "norm" not in name and "embed" not in name
        and not name.startswith("lm_head") and not name.endswith(".gate.weight") and "router" not in name
    )  # fmt: skip


# -- FP8 e4m3, block-scaled ------------------------------------------------------------------------------------


def fp8_quantise(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (fp8 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]); W ~ fp8 * scale of its block."""
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    scale = torch.empty(gn, gk, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s = max(blk.abs().max().item(), 1e-12) / 448.0
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_reference(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """float64 dequantisation of one FP8 weight, block by block."""
    out = q.to(torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= float(scale[i, j])
    return out


# -- MXFP4 ------------------------------------------------------------------------------------------------------


def mxfp4_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical [E, K, R] (GPT-OSS bf16 orientation) -> (blocks u8 [E, R, K/32, 16], scales u8 [E, R, K/32])."""
    rows = w.transpose(1, 2).double()  # [E, R, K]
    e, r, k = rows.shape
    grp = rows.reshape(e, r, k // 32, 32)
    amax = grp.abs().amax(-1).clamp_min(1e-30)  # [E, R, G]
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # 2**exp * 6 >= amax
    scaled = grp / torch.exp2(exp).unsqueeze(-1)  # [E, R, G, 32] in [-6, 6]
    lut = torch.tensor(E2M1, dtype=torch.float64)
    idx = (scaled.unsqueeze(-1) - lut).abs().argmin(-1)  # nearest code (ties: the first, +0 before -0)
    idx = idx.to(torch.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)  # element 2j in the low nibble, 2j+1 in the high
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 dequantisation by the spec: [E, R, G, 16] + [E, R, G] -> logical [E, 32G, R]."""
    e, r, g, _ = blocks.shape
    out = torch.empty(e, r, g * 32, dtype=torch.float64)
    for ei in range(e):
        for ri in range(r):
            for gi in range(g):
                s = 2.0 ** (int(scales[ei, ri, gi]) - 127)
                for j in range(16):
                    byte = int(blocks[ei, ri, gi, j])
                    out[ei, ri, gi * 32 + 2 * j] = E2M1[byte & 0xF] * s
                    out[ei, ri, gi * 32 + 2 * j + 1] = E2M1[byte >> 4] * s
    return out.transpose(1, 2)


# -- GPTQ / AWQ int4 --------------------------------------------------------------------------------------------


def _int4_groups(
    w: torch.Tensor, group: int, sym: bool, z_min: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q int [K, N] in 0..15, zeros int [G, N] >= z_min, scales fp16 [G, N]) with W ~ (q - z) * s."""
    wt = w.t().double()  # [K, N]
    k, n = wt.shape
    g = wt.reshape(k // group, group, n)
    if sym:
        s = (g.abs().amax(1) / 7.5).clamp_min(1e-8)
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(1), g.amax(1)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp(z_min, 15)
    s = s.half().double()
    q = torch.round(g / s.unsqueeze(1) + z.unsqueeze(1)).clamp(0, 15).reshape(k, n)
    return q.long(), z.long(), s.half()


def _pack(vals: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [..., 8m] -> int32 [..., m]: nibble i of word c holds vals[..., 8c + order[i]]."""
    v = vals.reshape(*vals.shape[:-1], -1, 8).long()
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        word |= v[..., j] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def gptq_quantise(w: torch.Tensor, group: int, sym: bool, v1: bool, act_order: bool) -> dict[str, torch.Tensor]:
    q, z, s = _int4_groups(w, group, sym, z_min=1 if v1 else 0)  # [K, N], [G, N], [G, N]; v1 stores z - 1 >= 0
    k = q.shape[0]
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:  # a permuted group assignment (as desc_act produces): rows regrouped, weights re-quantised
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
        g_idx = g_idx[perm]
        wt = w.t().double()
        q = torch.round(wt / s.double()[g_idx] + z[g_idx]).clamp(0, 15).long()
    qweight = _pack(q.t()).t().contiguous()  # [K/8, N]: word r holds rows 8r..8r+7
    return {"qweight": qweight, "qzeros": _pack(z - 1 if v1 else z), "scales": s, "g_idx": g_idx}


def gptq_reference(parts: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """float64 by the spec, one weight at a time: W[n, k] = (q - z) * s for the group g_idx[k]."""
    qweight, qzeros, scales, g_idx = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]
    kw, n = qweight.shape
    out = torch.empty(n, kw * 8, dtype=torch.float64)
    for k in range(kw * 8):
        g = int(g_idx[k])
        for c in range(n):
            q = (int(qweight[k // 8, c]) >> (4 * (k % 8))) & 0xF
            z = ((int(qzeros[g, c // 8]) >> (4 * (c % 8))) & 0xF) + (1 if v1 else 0)
            out[c, k] = (q - z) * float(scales[g, c])
    return out


def awq_quantise(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    q, z, s = _int4_groups(w, group, sym=False)
    return {"qweight": _pack(q, AWQ_ORDER), "qzeros": _pack(z, AWQ_ORDER), "scales": s}


def awq_reference(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, nw = qweight.shape
    group = k // scales.shape[0]
    out = torch.empty(nw * 8, k, dtype=torch.float64)
    for r in range(k):
        for c in range(nw * 8):
            nib = AWQ_ORDER.index(c % 8)
            q = (int(qweight[r, c // 8]) >> (4 * nib)) & 0xF
            z = (int(qzeros[r // group, c // 8]) >> (4 * nib)) & 0xF
            out[c, r] = (q - z) * float(scales[r // group, c])
    return out


def ct_quantise(w: torch.Tensor, group: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized int4: W [N, K] -> weight_packed [N, K/8], weight_scale [N, G] (bf16),
    weight_shape [2], and for asymmetric weights weight_zero_point [N/8, G]; ints stored offset by +8."""
    n, k = w.shape
    g = w.double().reshape(n, k // group, group)
    if sym:
        s = (g.abs().amax(-1) / 7.5).clamp_min(1e-8)
        z = torch.zeros_like(s)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = (torch.round(-lo / s) - 8).clamp(-8, 7)
    s = s.to(torch.bfloat16).double()
    q = torch.round(g / s.unsqueeze(-1) + z.unsqueeze(-1)).clamp(-8, 7).reshape(n, k)
    out = {"weight_packed": _pack(q.long() + 8), "weight_scale": s.to(torch.bfloat16),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}  # fmt: skip
    if not sym:
        out["weight_zero_point"] = _pack(z.long().t() + 8).t().contiguous()  # packed along N
    return out


def ct_reference(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    packed, scale, zp = parts["weight_packed"], parts["weight_scale"], parts.get("weight_zero_point")
    n, kw = packed.shape
    k, groups = kw * 8, scale.shape[1]
    out = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for c in range(k):
            q = ((int(packed[r, c // 8]) >> (4 * (c % 8))) & 0xF) - 8
            g = c // (k // groups)
            z = 0 if zp is None else ((int(zp[r // 8, g]) >> (4 * (r % 8))) & 0xF) - 8
            out[r, c] = (q - z) * float(scale[r, g])
    return out


# -- whole checkpoints ------------------------------------------------------------------------------------------


def convert(src: Path, quant: Path, twin: Path, method: str, **opts: Any) -> None:
    """Write `quant` (quantised safetensors + quantization_config) and `twin` (its float32 dequantisation)."""
    sd = load_file(src / "model.safetensors")
    qsd: dict[str, torch.Tensor] = {}
    tsd: dict[str, torch.Tensor] = {}
    cfg = json.loads((src / "config.json").read_text())
    for name, t in sd.items():
        if method == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantise(t)
            qsd[name + "_blocks"], qsd[name + "_scales"] = blocks, scales
            tsd[name] = mxfp4_reference(blocks, scales).float()
        elif method == "fp8" and quantisable(name, t):
            bn, bk = opts["block"]
            q, s = fp8_quantise(t, bn, bk)
            qsd[name], qsd[name + "_scale_inv"] = q, s
            tsd[name] = fp8_reference(q, s, bn, bk).float()
        elif method in ("gptq", "awq") and quantisable(name, t):
            base = name.removesuffix(".weight")
            if method == "gptq":
                parts = gptq_quantise(t, opts["group"], opts["sym"], opts["v1"], opts["act_order"])
                if not opts["act_order"] and opts.get("drop_g_idx"):
                    parts.pop("g_idx")
                ref = gptq_reference(parts | {"g_idx": torch.arange(t.shape[1]) // opts["group"]}, opts["v1"]) if (
                    "g_idx" not in parts) else gptq_reference(parts, opts["v1"])  # fmt: skip
            else:
                parts = awq_quantise(t, opts["group"])
                ref = awq_reference(parts)
            qsd |= {f"{base}.{k}": v for k, v in parts.items()}
            tsd[name] = ref.float()
        elif method == "compressed-tensors" and quantisable(name, t):
            parts = ct_quantise(t, opts["group"], opts["sym"])
            qsd |= {f"{name.removesuffix('.weight')}.{k}": v for k, v in parts.items()}
            tsd[name] = ct_reference(parts).float()
        else:
            qsd[name], tsd[name] = t, t
    qcfg: dict[str, Any] = {"quant_method": method}
    if method == "fp8":
        qcfg |= {"activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(opts["block"]),
                 "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    elif method == "mxfp4":
        qcfg |= {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                            "model.embed_tokens", "lm_head"]}  # fmt: skip
    elif method == "gptq":
        qcfg |= {"bits": 4, "group_size": opts["group"], "sym": opts["sym"], "desc_act": opts["act_order"],
                 "checkpoint_format": "gptq" if opts["v1"] else "gptq_v2"}  # fmt: skip
    elif method == "awq":
        qcfg |= {"bits": 4, "group_size": opts["group"], "zero_point": True, "version": "gemm"}
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": opts["sym"], "strategy": "group",
                   "group_size": opts["group"]}  # fmt: skip
        qcfg |= {
            "format": "pack-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        }
    for out, tensors, extra in ((quant, qsd, {"quantization_config": qcfg}), (twin, tsd, {})):
        out.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, out / f.name)
        (out / "config.json").write_text(json.dumps(cfg | extra, indent=1))
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})


# method variant -> (method, options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp8": ("fp8", {"block": (8, 8)}),
    "fp8_128": ("fp8", {"block": (128, 128)}),
    "fp8_ragged": ("fp8", {"block": (16, 16)}),
    "mxfp4": ("mxfp4", {}),
    "gptq_v1_sym": ("gptq", {"group": 8, "sym": True, "v1": True, "act_order": False}),
    "gptq_v1_asym_noidx": ("gptq", {"group": 16, "sym": False, "v1": True, "act_order": False, "drop_g_idx": True}),
    "gptq_v2_actorder": ("gptq", {"group": 8, "sym": False, "v1": False, "act_order": True}),
    "awq": ("awq", {"group": 8}),
    "ct_sym": ("compressed-tensors", {"group": 8, "sym": True}),
    "ct_asym": ("compressed-tensors", {"group": 16, "sym": False}),
}
