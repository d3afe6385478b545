"""Seam or row: decode speed of a family that has a row (lean decoder + native executor) against the same
model through transformers' experts seam (transformers' modules + moetier's experts, `RuntimeConfig.seam`).

On the Qwen3-MoE-shaped random bf16 benchmark model (hidden 1024, 8 layers, 64 experts, top-8), all experts
resident, both engines in one process, interleaved rounds: greedy decode of `--tokens` tokens after a
32-token prompt; medians. Also the max abs logit difference of the two in bf16 (both are exact in fp32:
tests/models/test_seam.py). Prints a table, then one JSON line.

    python benchmarks/seam_vs_rows.py [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch

import moetier
from benchmarks._models import qwen3_bench_model
from moetier import EngineConfig, RuntimeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = qwen3_bench_model()
    engines = {name: moetier.load(path, EngineConfig(runtime=RuntimeConfig(dtype="bf16", seam=name == "seam")))
               for name in ("row", "seam")}  # fmt: skip
    prompt = list(range(100, 132))
    for e in engines.values():  # warm-up: kernels built, pools filled
        e.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            speeds[name].append(e.generate(prompt, max_new_tokens=args.tokens, stop_at_eos=False).decode_tok_s)
    ids = torch.tensor([prompt])
    diff = (engines["row"].logits(ids).float() - engines["seam"].logits(ids).float()).abs().max().item()
    kernels = engines["row"].stats().get("kernels", "?")
    med = {name: statistics.median(v) for name, v in speeds.items()}
    print(f"{'path':6} {'decoder':12} {'executor':9} {'decode tok/s (median)':>22}  rounds")
    for name, e in engines.items():
        print(f"{name:6} {type(e.decoder).__name__:12} {e.executor:9} {med[name]:22.1f}  "
              f"{[round(x, 1) for x in speeds[name]]}")  # fmt: skip
    ratio = med["seam"] / med["row"]
    print(f"seam / row: {ratio:.2f}x; max abs logit difference (bf16): {diff:.4f}; kernels: {kernels}")
    print(json.dumps({"benchmark": "seam_vs_rows", "tokens": args.tokens, "rounds": args.rounds,
                      "threads": args.threads, "kernels": kernels, "tok_s": med, "runs": speeds,
                      "ratio_seam_row": med["seam"] / med["row"], "bf16_max_logit_diff": diff}))  # fmt: skip
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
