"""Our quantized expert tiers against ggml's block formats at equal bytes (issue 28, item 3): quality and quantize
time, on the bundled model (or any checkpoint with per-expert tensors).

Candidates (routed experts only; attention, router, embeddings and head stay as the checkpoint has them):
- ours: `moetier quantize` tiers int8 (per row), int4 and int2 at several group sizes, HQQ fit (the default) and
  round-to-nearest (`--methods hqq,rtn`), written under `--quant-dir` (kept; timed when written);
- ggml: every expert matrix quantized by ggml's own quantiser (`kernels/ggml.py quantize`, llama-quantize's code
  path without an importance matrix) to Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, Q3_K, Q2_K, then decoded by gguf-py's numpy
  reference (bit-identical to ggml's) into an fp32 twin checkpoint. A matrix whose rows are not whole 256-value
  super-blocks takes llama-quantize's fallback type for that K-quant (Q6_K -> Q8_0, Q5_K -> Q5_1, Q4_K -> Q5_0,
  Q3_K / Q2_K -> IQ4_NL), as a GGUF file of the model would hold it; the table says where.
Every candidate runs in fp32 (the format's values, not a kernel's arithmetic), every expert resident, and is scored
against the checkpoint in fp32 (runtime/quality.py `reference_config`) over `--tokens` held-out tokens in windows of
`--window`: KL mean with its standard error, top-1 agreement, perplexity. Bytes: stored bits per expert weight
(scales, zeros, super-block metadata included) and an expert's bytes against bf16.

    python benchmarks/ggml_tiers.py [--model models/tiny-shakespeare-moe] [--tokens 8192] [--window 256]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

import moetier
from moetier import EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.formats.quantize import quantize_model
from moetier.kernels import ggml, native
from moetier.runtime.quality import collect, compare, reference_config

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "shakespeare_heldout.txt"
GGML_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_XS", "IQ4_NL", "Q3_K", "Q2_K")
FALLBACK = {"Q6_K": "Q8_0", "Q5_K": "Q5_1", "Q4_K": "Q5_0", "Q3_K": "IQ4_NL", "Q2_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}
OURS = (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("int2", 32), ("int2", 64), ("int2", 128))
_EXPERT = (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def is_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(_EXPERT)


def ggml_twin(model: Path, out: Path, qtype: str) -> dict[str, Any]:
    """An fp32 twin of `model` whose expert matrices hold what `qtype` (or its fallback) decodes to."""
    sd = load_file(model / "model.safetensors")
    twin, bits, weights, used, t0 = {}, 0, 0, set(), time.perf_counter()
    secs = 0.0
    for name, w in sd.items():
        if not is_expert(name):
            twin[name] = w
            continue
        k = w.shape[1]
        t = qtype if k % ggml.block_of(qtype) == 0 else FALLBACK.get(qtype, qtype)
        if k % ggml.block_of(t):
            raise SystemExit(f"{name}: rows of {k} fit neither {qtype} nor its fallback {t}")
        used.add(t)
        s0 = time.perf_counter()
        q = ggml.quantize(t, w.float())
        secs += time.perf_counter() - s0
        if q is None:
            raise SystemExit(f"ggml cannot quantise {t} here ({ggml.load_error()})")
        bits += q.numel() * 8
        weights += w.numel()
        deq = dequantize(q.numpy(), GGMLQuantizationType[t])  # [N, K] fp32, numpy reference
        twin[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32).reshape(w.shape))
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    save_file(twin, out / "model.safetensors", metadata={"format": "pt"})
    return {"bits_per_weight": bits / weights, "types": sorted(used), "quantize_s": round(secs, 2),
            "total_s": round(time.perf_counter() - t0, 2)}  # fmt: skip


def our_tier(model: Path, quant: Path, precision: str, group: int | None, method: str) -> dict[str, Any]:
    """Write (or reuse) our tier; its stored bits per expert weight from the tier's files."""
    t0 = time.perf_counter()
    groups = {precision: group} if group else None
    (path,) = quantize_model(model, [precision], out=quant, group_sizes=groups, method=method)
    secs = time.perf_counter() - t0
    data = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    sd = load_file(model / "model.safetensors")
    weights = sum(w.numel() for n, w in sd.items() if is_expert(n))
    return {"bits_per_weight": 8 * data / weights, "path": str(path), "quantize_s": round(secs, 2)}


def score(model: Path, cfg: EngineConfig, ids: list[int], window: int, ref: Any, name: str) -> dict[str, Any]:
    with moetier.load(model, cfg) as engine:
        engine.store.preload()
        q = compare(engine, ids, window, ref, name).summary
    return {**q.as_dict(), "ppl": q.ppl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-shakespeare-moe")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--methods", default="hqq,rtn")
    ap.add_argument("--types", default=",".join(GGML_TYPES))
    ap.add_argument("--work", type=Path, default=REPO / ".bench" / "ggml-tiers")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not ggml.available():
        raise SystemExit(f"ggml is not available: {ggml.load_error()}")
    rt = RuntimeConfig(device="cpu", dtype="fp32")
    with moetier.load(args.model, reference_config(EngineConfig(runtime=rt))) as ref_engine:
        ids = ref_engine.encode(TEXT.read_text())[: args.tokens + 1]
        ref = collect(ref_engine, ids, args.window, {"model": str(args.model), "text": str(TEXT)})
    model_cpu, flags = native.cpu_info()
    rows: dict[str, dict[str, Any]] = {}
    for method in [m for m in args.methods.split(",") if m]:
        quant = args.work / f"quant-{method}"
        for precision, group in OURS:
            name = f"moetier {precision}" + (f" g{group}" if group else "") + f" {method}"
            info = our_tier(args.model, quant, precision, group, method)
            pc = PrecisionConfig(mode=precision, quant_dir=str(quant),
                                 groups=((precision, group),) if group else ())  # fmt: skip
            rows[name] = {**info, **score(args.model, EngineConfig(precision=pc, runtime=rt), ids, args.window, ref,
                                          name)}  # fmt: skip
            print(f"{name}: {rows[name]['bits_per_weight']:.3f} bits, KL {rows[name]['kl_mean']:.5f}", flush=True)
    for qtype in [t for t in args.types.split(",") if t]:
        twin = args.work / f"twin-{qtype}"
        info = ggml_twin(args.model, twin, qtype)
        name = f"ggml {qtype}"
        rows[name] = {**info, **score(twin, EngineConfig(runtime=rt), ids, args.window, ref, name)}
        print(f"{name}: {rows[name]['bits_per_weight']:.3f} bits, KL {rows[name]['kl_mean']:.5f}", flush=True)
        shutil.rmtree(twin)
    print(f"cpu: {model_cpu}; flags: {' '.join(f for f in flags if f.startswith(('avx', 'amx')))}; "
          f"{len(ids) - 1} tokens of {TEXT.name}, windows of {args.window}; reference: the checkpoint in fp32")
    print(f"{'candidate':24} {'bits/w':>7} {'x bf16':>7} {'KL mean':>9} {'± se':>8} {'top-1':>7} {'ppl':>8} "
          f"{'quant s':>8}  types")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["bits_per_weight"]):
        print(f"{name:24} {r['bits_per_weight']:7.3f} {r['bits_per_weight'] / 16:7.3f} {r['kl_mean']:9.5f} "
              f"{r['kl_stderr']:8.5f} {r['top1_pct']:6.2f}% {r['ppl']:8.3f} {r['quantize_s']:8.2f}  "
              f"{','.join(r.get('types', []))}")  # fmt: skip
    print(json.dumps({"benchmark": "ggml_tiers", "model": str(args.model), "tokens": len(ids) - 1,
                      "window": args.window, "ref_ppl": math.exp(ref.nll_sum / ref.tokens), "rows": rows}))


if __name__ == "__main__":
    main()
