"""Engine caching and prefetch on this CPU: hit rate and decode tok/s with LRU, MRS and MRS + prefetch.

The Qwen3-MoE-shaped random bf16 benchmark model (benchmarks/_models.py), host expert budget 25%
of the expert bytes, disk (the safetensors file) as the slow tier. Each candidate is a fresh
engine (empty expert cache) on the same seeded prompt; candidates are interleaved over the
repeats so each sees the same machine state. Greedy decode of --tokens new tokens; the decode
hit rate counts only the accesses after the prefill.

Disk: after the first touch the kernel's page cache serves re-reads of evicted experts, and that
is what the engine sees by default (reported as `disk: page cache`). `--cold` drops the
checkpoint's pages (posix_fadvise DONTNEED) before each run and after every decoded token, so
that an expert re-read in a later token comes from the device (reads within one token may still
hit the cache); the drop itself runs inside the timed decode loop for every candidate alike.

    python benchmarks/hybrid_engine.py [--tokens 128] [--repeats 3] [--depth 1] [--cold]

Prints a table, then one JSON line.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch

import moetier
from benchmarks._models import qwen3_bench_model
from moetier.config import (
    Budgets,
    CacheConfig,
    EngineConfig,
    PrefetchConfig,
    RuntimeConfig,
    SamplingConfig,
    SchedulerConfig,
)
from moetier.errors import ConfigError
from moetier.policies.costmodel import save_profile
from moetier.runtime.pricing import BUILTIN_CPU, load_profile


def drop_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the checkpoint files' clean pages (best effort)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def snapshot_profile(name: str | None) -> tuple[str, str]:
    """Load the cost model's profile once (the default: profiles/this-machine.json, else the built-in
    CPU one; an unreadable default falls back to the built-in) and pin it in a temporary file, so
    every run prices with the same numbers; returns (its name, the file)."""
    try:
        prof = load_profile(name)
    except ConfigError as exc:
        if name:
            raise
        print(f"warning: default profile unreadable ({exc}); using {BUILTIN_CPU.name}", file=sys.stderr)
        prof = BUILTIN_CPU
    fd, tmp = tempfile.mkstemp(suffix=".json", prefix="moetier-profile-")
    os.close(fd)
    save_profile(prof, tmp)
    return prof.name, tmp


def run(path: Path, prompt: list[int], tokens: int, budget: int, policy: str, prefetch: PrefetchConfig,
        profile: str | None, cold: bool, sampling: SamplingConfig) -> dict[str, Any]:  # fmt: skip
    cfg = EngineConfig(
        budgets=Budgets(host_expert_bytes=budget), cache=CacheConfig(policy), prefetch=prefetch,
        scheduler=SchedulerConfig(profile=profile), runtime=RuntimeConfig(device="cpu", dtype="bf16"),
    )  # fmt: skip
    if cold:
        drop_page_cache(path)
    with moetier.load(path, cfg) as engine:
        after_prefill: dict[str, int] = {}

        def on_token(tok: int, text: str) -> None:
            if not after_prefill:
                after_prefill.update(hits=engine.store.compute.hits, misses=engine.store.compute.misses)
            if cold:
                drop_page_cache(path)

        t0 = time.perf_counter()
        res = engine.generate(prompt, tokens, sampling, on_token=on_token, stop_at_eos=False)
        wall = time.perf_counter() - t0
        engine.store.drain(30)
        st = engine.stats()
    hits, misses = st["hits"] - after_prefill["hits"], st["misses"] - after_prefill["misses"]
    out = {
        "decode_tok_s": res.decode_tok_s, "ttft_s": res.ttft_s, "wall_s": wall, "token_ids": res.token_ids,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0, "hit_rate_all": st["hit_rate"],
        "disk_mib": st["disk_bytes"] / 2**20,
    }  # fmt: skip
    if "prefetch" in st:
        pf = st["prefetch"]
        out["prefetch"] = {k: pf[k] for k in ("predicted", "accuracy", "issued", "used", "wasted", "failed",
                                              "waits", "wait_s")}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=1, help="prefetch depth of the MRS + prefetch candidate")
    ap.add_argument("--max-experts", type=int, default=4, help="prefetches per layer call")
    ap.add_argument("--profile", default=None, help="hardware profile (default: profiles/this-machine.json)")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint's page cache before runs and per token")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature (seeded, the same for every candidate); greedy text of the random "
                    "benchmark model loops, which makes any cache look perfect")
    ap.add_argument("--model", default="bench", help="'bench' (Qwen3-MoE shape, random) or a checkpoint folder")
    ap.add_argument("--cache-dir", default=str(Path(__file__).resolve().parent.parent / ".bench"))
    args = ap.parse_args()
    # 1. the model, the 25% budget, the prompt
    path = qwen3_bench_model(args.cache_dir) if args.model == "bench" else Path(args.model)
    sampling = SamplingConfig(temperature=args.temperature, seed=0)
    probe = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="bf16")))
    expert_bytes = probe.store.slot_bytes * len(probe.store.keys)
    staging = probe.store.staging_bytes
    probe.close()
    budget = expert_bytes // 4 + staging
    profile = snapshot_profile(args.profile)
    prompt = torch.randint(3, 256, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    off = PrefetchConfig()
    on = PrefetchConfig(enabled=True, depth=args.depth, max_experts=args.max_experts)
    candidates = {"lru": ("lru", off), "mrs": ("mrs", off), f"mrs+prefetch(d={args.depth})": ("mrs", on)}
    # 2. interleaved repeats
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, (policy, pf) in candidates.items():
            runs[name].append(run(path, prompt, args.tokens, budget, policy, pf, profile[1], args.cold, sampling))
    # 3. report: medians over repeats
    print(f"model {path.name}: {expert_bytes / 2**20:.0f} MiB of experts, host budget {budget / 2**20:.0f} MiB "
          f"(25%), disk: {'cold (fadvise DONTNEED per token)' if args.cold else 'page cache'}, "
          f"{torch.get_num_threads()} threads, {args.tokens} new tokens x {args.repeats} repeats")  # fmt: skip
    print(f"{'candidate':<22}{'decode hit %':>13}{'decode tok/s':>14}{'disk MiB':>10}   tok/s runs   prefetch")
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "decode_tok_s", "disk_mib", "ttft_s")}
        pf = rs[-1].get("prefetch")
        tok_runs = ", ".join(f"{r['decode_tok_s']:.2f}" for r in rs)
        pf_txt = (f"acc {pf['accuracy']:.0%}, used {pf['used']}/{pf['issued']}, waits {pf['waits']}"
                  if pf else "")  # fmt: skip
        print(f"{name:<22}{med['hit_rate'] * 100:>13.1f}{med['decode_tok_s']:>14.2f}{med['disk_mib']:>10.0f}   "
              f"{tok_runs}   {pf_txt}")  # fmt: skip
        summary[name] = med | {"runs_tok_s": [r["decode_tok_s"] for r in rs], "hit_rates": [r["hit_rate"] for r in rs],
                               "prefetch": pf}  # fmt: skip
    same = all(r["token_ids"] == runs["lru"][0]["token_ids"] for rs in runs.values() for r in rs)
    print(f"identical tokens across candidates: {same}")
    print(json.dumps({
        "benchmark": "hybrid_engine", "model": path.name, "tokens": args.tokens, "repeats": args.repeats,
        "budget_bytes": budget, "expert_bytes": expert_bytes, "cold": args.cold, "threads": torch.get_num_threads(),
        "profile": profile[0], "identical_tokens": same, "temperature": args.temperature, "results": summary,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
