"""Real routing on the traced model's shape (issue 29, item 5): the engine follows a recorded routing trace
(RoutingConfig.follow_trace, `--follow-trace`) on a random checkpoint with the traced model's routing shape, and
its expert cache is measured under that routing beside the random router's own.

BENCHMARK MODE, clearly: the text output of a followed trace is meaningless (random weights); the expert reads,
hits, evictions and budget decisions are the real engine's, under a real model's routing. The checkpoint is a
random bf16 Qwen3-MoE with the trace's MoE layers (a dense first layer where the traced model has one, as
DeepSeek-V2-Lite), experts and top-k; its widths are the traced model's hidden and expert sizes divided by
--scale (1 = the real sizes: DeepSeek-V2-Lite's experts take 29 GB, Mixtral-8x7B's 90 GB), built under --cache.

The traces (../shared/data/traces, see its README: no licence) are READ at run time, never copied; nothing derived
from their rows is written into the repository. When the folder is absent the script says so and exits 0.
Per trace and cache policy, --steps decode steps of one token each (batch 1; a seeded random token stream) under a
host expert budget of --ratio of the experts: hit rate, misses and disk bytes per token, following the trace and
with the random checkpoint's own router.
Prints a table, then one JSON line.

    python benchmarks/trace_follow.py [--steps 128] [--ratio 0.25] [--scale 8] [--policies lru] [--only mixtral]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import moetier
from moetier import traces
from moetier.config import Budgets, CacheConfig, EngineConfig, RoutingConfig

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "data" / "traces"


def checkpoint(meta: dict[str, Any], scale: int, cache: Path) -> Path:
    """A random bf16 Qwen3-MoE checkpoint of the trace's routing shape (cached under `cache`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = int(meta.get("num_layers") or len(meta["moe_layers"]))
    moe = [int(x) for x in meta.get("moe_layers") or range(layers)]
    hidden = max(64, int(meta["hidden_size"]) // scale // 64 * 64)
    inter = max(32, int(meta["moe_intermediate_size"]) // scale // 32 * 32)
    name = f"{meta['model'].replace('/', '--')}-s{scale}"
    out = cache / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_experts=int(meta["num_experts"]),
        num_experts_per_tok=int(meta["top_k"]), moe_intermediate_size=inter, intermediate_size=4 * hidden,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256), head_dim=64,
        vocab_size=512, max_position_embeddings=8192, norm_topk_prob=True, tie_word_embeddings=False,
        mlp_only_layers=[i for i in range(layers) if i not in moe], bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def run(model: Path, trace: Path | None, policy: str, budget: int, steps: int) -> dict[str, Any]:
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), cache=CacheConfig(policy=policy),
                       routing=RoutingConfig(follow_trace=str(trace) if trace is not None else None))  # fmt: skip
    tokens = torch.randint(3, 512, (steps,), generator=torch.Generator().manual_seed(0)).tolist()  # seeded input
    with moetier.load(model, cfg) as e:
        e.decoder.reset()
        with torch.inference_mode():
            for t in tokens:  # one decode step each (batch 1)
                e.step(torch.tensor([[t]]))
        s = e.stats()
    return {"hit_rate": s["hit_rate"], "misses": s["misses"], "disk_bytes_per_token": s["disk_bytes"] / steps,
            "routing_stats": s.get("routing", {})}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.25, help="host expert budget as a fraction of all experts")
    ap.add_argument("--scale", type=int, default=8, help="divide the traced model's widths by this")
    ap.add_argument("--policies", default="lru,lfu,mrs")
    ap.add_argument("--routing", default="trace,router", help="trace: follow the trace; router: the model's own")
    ap.add_argument("--only", default="", help="run the traces whose folder name contains this")
    ap.add_argument("--cache", default=str(ROOT / ".bench" / "trace-shapes"))
    args = ap.parse_args()
    if not TRACES.is_dir():
        print(f"{TRACES} is absent: nothing to follow")
        return
    rows = []
    for folder in sorted(p for p in TRACES.iterdir() if (p / "trace.parquet").is_file() and args.only in p.name):
        path = folder / "trace.parquet"
        meta = traces.load(path).metadata
        model = checkpoint(meta, args.scale, Path(args.cache))
        with moetier.load(model, EngineConfig()) as e:
            slot = int(e.info.expert_bytes)
            total = slot * e.info.num_experts * len(e.info.moe_layers)
        budget = int(total * args.ratio)
        for policy in args.policies.split(","):
            for follow in [m == "trace" for m in args.routing.split(",")]:
                r = run(model, path if follow else None, policy, budget, args.steps)
                rows.append({"trace": folder.name, "policy": policy, "routing": "trace" if follow else "random router",
                             "budget_bytes": budget, "expert_bytes": slot, **r})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'trace':36} {'policy':6} {'routing':14} {'hit rate':>8} {'misses/token':>12} {'disk MiB/token':>14}")
    for r in rows:
        print(f"{r['trace']:36} {r['policy']:6} {r['routing']:14} {r['hit_rate']:8.3f} "
              f"{r['misses'] / args.steps:12.2f} {r['disk_bytes_per_token'] / 2**20:14.3f}")
    print(json.dumps({"steps": args.steps, "ratio": args.ratio, "scale": args.scale, "rows": rows}))


if __name__ == "__main__":
    main()
