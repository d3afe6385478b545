"""Quality of the native decode path: KL divergence and top-1 agreement against the fp32 reference.

`moetier eval --kl-ref full` scores text in windows (prefill), which runs the per-expert torch path for
calls of more than 8 tokens; the native MoE kernel runs on decode steps. This script therefore feeds the
bundled model's held-out text one token at a time (decode steps, the native path's regime) through each
candidate and the fp32 reference (torch, every expert resident) and prints, per candidate: mean KL (nats
per token) to the reference's next-token distribution, top-1 agreement with the reference and with
torch's own bf16 path, and perplexity. Prints a table, then one JSON line.

    python benchmarks/native_quality.py [--tokens 2000] [--quant-dir DIR]

Expert precisions int8 / int4 need quantized tiers of the bundled model (`moetier quantize
models/tiny-shakespeare-moe --precisions int8,int4 --out DIR`, then `--quant-dir DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

import moetier
from moetier.errors import MoetierError

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
HELDOUT = ROOT / "data" / "shakespeare_heldout.txt"
# name -> (dtype, native kernels, expert precision, dense precision)
CANDIDATES = {
    "torch-bf16": ("bf16", False, "full", "full"),
    "native-bf16": ("bf16", True, "full", "full"),
    "native-dense-int8": ("bf16", True, "full", "int8"),
    "native-dense-int4": ("bf16", True, "full", "int4"),
    "torch-int8": ("bf16", False, "int8", "full"),
    "native-int8": ("bf16", True, "int8", "full"),
    "native-int8-dense-int8": ("bf16", True, "int8", "int8"),
    "torch-int4": ("bf16", False, "int4", "full"),
    "native-int4": ("bf16", True, "int4", "full"),
    "native-int4-dense-int4": ("bf16", True, "int4", "int4"),
}


def engine(dtype: str, native: bool, precision: str, dense: str, quant_dir: str | None) -> moetier.Engine:
    rt = moetier.RuntimeConfig(dtype=dtype, native_kernels=native, dense_precision=dense)  # type: ignore[arg-type]
    prec = moetier.PrecisionConfig(mode=precision, quant_dir=quant_dir)
    return moetier.load(MODEL, moetier.EngineConfig(runtime=rt, precision=prec))


@torch.inference_mode()
def decode_logits(e: moetier.Engine, ids: list[int], window: int) -> torch.Tensor:
    """Logits [T, V] fp32 of ids fed one token at a time, the cache restarted every `window` tokens."""
    out = []
    for start in range(0, len(ids), window):
        e.decoder.reset()
        out += [e.step(torch.tensor([[t]]))[0].float() for t in ids[start : start + window]]
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--window", type=int, default=256, help="the model's training window")
    ap.add_argument("--quant-dir", default=None)
    args = ap.parse_args()
    with engine("fp32", False, "full", "full", None) as ref_engine:
        ids = ref_engine.encode(HELDOUT.read_text())[: args.tokens + 1]
        ref = decode_logits(ref_engine, ids[:-1], args.window).log_softmax(-1)  # [T, V]
    targets = torch.tensor(ids[1:])
    rows: dict[str, dict[str, float | str]] = {}
    base_top1: torch.Tensor | None = None
    for name, (dtype, native, precision, dense) in CANDIDATES.items():
        try:
            with engine(dtype, native, precision, dense, args.quant_dir) as e:
                logits = decode_logits(e, ids[:-1], args.window)
                kernels = e.stats()["kernels"]
        except MoetierError as exc:
            rows[name] = {"error": str(exc).splitlines()[0]}
            continue
        logp = logits.log_softmax(-1)
        kl = (ref.exp() * (ref - logp)).sum(-1)  # [T]
        top1 = logits.argmax(-1)
        if name == "torch-bf16":
            base_top1 = top1
        rows[name] = {
            "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
            "top1_vs_fp32": float((top1 == ref.argmax(-1)).float().mean()),
            "top1_vs_torch_bf16": float((top1 == base_top1).float().mean()) if base_top1 is not None else float("nan"),
            "ppl": float(F.cross_entropy(logits, targets).exp()), "kernels": kernels,
        }  # fmt: skip
    ref_ppl = float(F.nll_loss(ref, targets).exp())
    print(f"{len(targets)} held-out tokens, decode steps, window {args.window}; fp32 reference ppl {ref_ppl:.3f}")
    print(f"{'candidate':<26}{'mean KL':>10}{'p99 KL':>10}{'top-1 fp32':>12}{'top-1 bf16':>12}{'ppl':>9}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<26}error: {r['error']}")
            continue
        print(f"{name:<26}{r['kl_mean']:>10.5f}{r['kl_p99']:>10.4f}{100 * float(r['top1_vs_fp32']):>11.2f}%"
              f"{100 * float(r['top1_vs_torch_bf16']):>11.2f}%{r['ppl']:>9.3f}")  # fmt: skip
    print(json.dumps({"benchmark": "native_quality", "tokens": len(targets), "ref_ppl": ref_ppl, "rows": rows}))


if __name__ == "__main__":
    main()
