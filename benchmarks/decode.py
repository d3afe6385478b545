"""Decode speed: transformers vs moetier (all experts resident) vs moetier (25% host budget).

transformers runs twice: as it ships, and with oneDNN off process-wide (the benchmark flips the flag
around its own run; moetier never does). With oneDNN off every 1-2 row bf16 product takes ATen's
native GEMV, the kernel moetier picks per call for its own projections (kernels/matmul.py), so the
table shows what that choice alone buys. On CPUs where oneDNN never takes bf16 products (no AVX-512
BW/VL/DQ, AVX-NE-CONVERT or AMX, e.g. AVX2-only ones) both transformers runs use the same kernels.

On the Qwen3-MoE-shaped random bf16 benchmark model (hidden 1024, 8 layers, 64 experts,
top-8, moe_intermediate 256, 16/4 heads of 64, vocab 32000), all in one process:
greedy decode of 64 tokens after a 16-token prompt. Prints a table, then one JSON line.

    python benchmarks/decode.py [--tokens 64] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import moetier
from benchmarks._models import qwen3_bench_model


class _Clock(BaseStreamer):
    """Timestamps each put(): the first is the prompt, the next ones are new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(path: str, prompt: list[int], n: int, device: str, onednn: bool = True) -> float:
    """transformers' own generate; onednn=False also gives it the native GEMV moetier picks per call."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    clock = _Clock()
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=onednn):
        model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=clock, pad_token_id=0)
    new = clock.times[1:]  # first new token ... last
    del model
    return (len(new) - 1) / (new[-1] - new[0])


def moetier_decode(path: str, prompt: list[int], n: int, device: str, budget: int | None) -> tuple[float, dict]:
    cfg = moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget),
        runtime=moetier.RuntimeConfig(device=device, dtype="bf16"),  # type: ignore[arg-type]
    )
    with moetier.load(path, cfg) as engine:
        res = engine.generate(prompt, max_new_tokens=n, stop_at_eos=False)
        assert len(res.token_ids) == n, res.token_ids
        return res.decode_tok_s, res.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dir", default=".bench")
    args = ap.parse_args()
    # 1. the model, and its expert bytes for the 25% budget
    path = str(qwen3_bench_model(args.cache_dir))
    info_engine = moetier.load(path, moetier.EngineConfig(runtime=moetier.RuntimeConfig(dtype="bf16")))
    expert_bytes = info_engine.store.slot_bytes * len(info_engine.store.keys)  # every expert, one slot each
    info_engine.close()
    quarter = expert_bytes // 4
    prompt = torch.randint(3, 32000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    # 2. interleaved repeats: each candidate sees the same machine state
    runs: dict[str, list[float]] = {
        "transformers": [], "transformers_onednn_off": [], "moetier_resident": [], "moetier_25pct": []
    }  # fmt: skip
    stats25: dict = {}
    for _ in range(args.repeats):
        runs["transformers"].append(hf_decode(path, prompt, args.tokens, args.device))
        runs["transformers_onednn_off"].append(hf_decode(path, prompt, args.tokens, args.device, onednn=False))
        runs["moetier_resident"].append(moetier_decode(path, prompt, args.tokens, args.device, None)[0])
        tok_s, stats25 = moetier_decode(path, prompt, args.tokens, args.device, quarter)
        runs["moetier_25pct"].append(tok_s)
    med = {k: statistics.median(v) for k, v in runs.items()}
    # 3. report
    base = med["transformers"]
    print(f"{'candidate':<26}{'decode tok/s':>14}{'x transformers':>16}   runs")
    for k, v in med.items():
        print(f"{k:<26}{v:>14.1f}{v / base:>16.2f}   {', '.join(f'{x:.1f}' for x in runs[k])}")
    print(f"25% budget: {quarter} B host expert pool, hits {stats25['hits']}, misses {stats25['misses']}, "
          f"disk {stats25['disk_bytes'] / 2**20:.0f} MiB")
    print(json.dumps({
        "benchmark": "decode", "device": args.device, "threads": torch.get_num_threads(), "tokens": args.tokens,
        "tok_s": med, "ratio_resident": med["moetier_resident"] / base, "ratio_25pct": med["moetier_25pct"] / base,
        "runs": runs, "budget_25pct_bytes": quarter, "hits_25pct": stats25["hits"],
        "misses_25pct": stats25["misses"], "disk_bytes_25pct": stats25["disk_bytes"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
