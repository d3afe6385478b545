"""Does the simulator predict the real engine? Decode time per token, engine vs simulator (issue 5, item 6).

For the bundled model and the Qwen3-MoE-shaped benchmark model: the engine runs on this CPU with a
host expert budget of 25% of the expert bytes and the checkpoint (disk) as the slow tier, LRU,
greedy decode, recording its routing trace. The simulator then replays that very trace with this
machine's measured profile (this-machine, written by `moetier profile`) on the CPU-only
machine model (fast domain = CPU from host memory, link = disk), the gpu-lru scheduler (every miss is
read, then computed) and an LRU cache of the same number of slots. Prefill is excluded: the metric is
the mean time between decoded tokens.

    python benchmarks/sim_validate.py [--tokens 64] [--repeats 3] [--profile this-machine]

Prints a table, then one JSON line. Target: |sim / engine - 1| <= 0.25 for both models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `benchmarks._models` from any cwd

import moetier  # noqa: E402
from benchmarks._models import qwen3_bench_model  # noqa: E402
from moetier.config import Budgets, EngineConfig, RuntimeConfig  # noqa: E402
from moetier.models.open import describe  # noqa: E402
from moetier.policies.costmodel import load_profile  # noqa: E402
from moetier.sim import SimConfig, simulate  # noqa: E402
from moetier.specs import load_spec  # noqa: E402
from moetier.traces import iter_calls, load  # noqa: E402

BUNDLED = ROOT / "models" / "tiny-shakespeare-moe"


def engine_run(path: Path, tokens: int, trace: Path) -> dict[str, Any]:
    """One fresh engine at a 25% host budget: decode ms/token, hit rate, host slots; records `trace`."""
    budget = describe(path).total_expert_bytes // 4  # the checkpoint's header, without loading the model
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=RuntimeConfig(device="cpu", dtype="bf16"))
    with moetier.load(path, cfg) as engine:
        prompt = list(range(5, 5 + 32))  # token ids: the benchmark model ships no tokenizer
        engine.record_trace(trace, with_scores=True)
        t0 = time.perf_counter()
        res = engine.generate(prompt, max_new_tokens=tokens, stop_at_eos=False)
        wall = time.perf_counter() - t0
        slots = engine.store.capacity
        experts = engine.info.num_experts * len(engine.info.moe_layers)
        stats = res.stats
    return {
        "tbt_ms": 1e3 / res.decode_tok_s, "ttft_ms": res.ttft_s * 1e3, "wall_s": wall,
        "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"]),
        "slots": slots, "experts": experts, "budget": budget,
    }  # fmt: skip


def sim_run(path: Path, trace: Path, slots: int, experts: int, profile: str) -> dict[str, Any]:
    calls = iter_calls(load(trace))
    ratio = slots / experts
    cfg = SimConfig(scheduler="gpu-lru", cache_policy="lru", cache_ratio=ratio)
    r = simulate(load_spec(str(path)), load_profile(profile), calls, cfg)
    return {"tbt_ms": r.tbt_s * 1e3, "ttft_ms": r.ttft_s * 1e3, "hit_rate": r.decode_hit_rate,
            "moe_layer_ms": r.moe_layer_s * 1e3, "ratio": ratio}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default="this-machine")
    args = ap.parse_args()
    models = {"bundled": BUNDLED, "qwen3moe-bench": qwen3_bench_model(ROOT / ".bench")}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models.items():
            runs = [engine_run(path, args.tokens, Path(tmp) / f"{name}-{i}.parquet") for i in range(args.repeats)]
            best = min(range(len(runs)), key=lambda i: runs[i]["tbt_ms"])
            eng = dict(runs[best], tbt_ms_median=statistics.median(r["tbt_ms"] for r in runs))
            sim = sim_run(path, Path(tmp) / f"{name}-{best}.parquet", eng["slots"], eng["experts"], args.profile)
            rows[name] = {"engine": eng, "sim": sim, "sim_over_engine": sim["tbt_ms"] / eng["tbt_ms_median"]}
    print(f"{'model':<16}{'engine ms/tok':>15}{'sim ms/tok':>12}{'sim/engine':>12}{'hit eng':>9}{'hit sim':>9}")
    for name, r in rows.items():
        e, s = r["engine"], r["sim"]
        print(f"{name:<16}{e['tbt_ms_median']:>15.2f}{s['tbt_ms']:>12.2f}{r['sim_over_engine']:>12.2f}"
              f"{e['hit_rate']:>9.3f}{s['hit_rate']:>9.3f}")  # fmt: skip
    ok = all(abs(r["sim_over_engine"] - 1) <= 0.25 for r in rows.values())
    print(json.dumps({"benchmark": "sim_validate", "profile": args.profile, "tokens": args.tokens,
                      "within_25pct": ok, "models": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
