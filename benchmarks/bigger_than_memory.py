"""Models bigger than memory: moetier under `--memory` against llama.cpp memory-mapping the same model, each engine
alone in a cgroup (v1) memory group with the same limit (issue 29).

What it does (everything under `--cache-dir`, default `.bench/`, git-ignored; each step skipped when its output
exists):
0. **Model**: the random Qwen3-MoE benchmark checkpoint of `benchmarks/_models.py` with `--layers` decoder layers
   (default 40: 3.75 GiB of bf16 experts, 4.0 GiB in all), and its llama.cpp GGUF files (bf16 and `--gguf-types`,
   default Q4_K_M) made by `vs_llamacpp.py`'s steps (llama.cpp built from the llama-cpp-python sdist).
1. **Limits**: for each share of `--shares` (default 0.5,0.25), limit = share x the model's bytes (its bf16
   safetensors) + `--overhead` (default 512 MiB: the process itself; torch alone is about 400 MiB of it).
2. **Runs**, interleaved: `--rounds` rounds (default 2; `--warmup` adds a first round that is not counted: every run
   starts cold anyway, in a fresh process with the page cache dropped), each running every candidate once at every
   limit. Before each run the page cache is dropped; each run is a fresh
   process placed in a fresh memory cgroup (`/sys/fs/cgroup/memory/moetier-btm-*`, `memory.limit_in_bytes` =
   the limit; page cache counted), removed afterwards. Read from the group after the run: `memory.max_usage_in_bytes`
   (peak, page cache included), `memory.failcnt` (times the limit was hit: reclaim), and the OOM kills
   (`memory.oom_control`). Disk bytes read come from `/proc/vmstat` `pgpgin` around the run (the machine must be
   otherwise idle), the prefill and decode speeds from the engines themselves:
   - `llamacpp-<type>`: `llama-bench -m FILE -p P -n N -t T -r 1 --no-warmup -o json` (memory-mapped, as its
     users run it; P = `--prompt-tokens`, N = `--tokens`): prefill and decode tok/s from its two tests;
   - `moetier-<variant>`: this script run as a child (`child` subcommand), which loads the checkpoint with
     `Budgets(memory_bytes=limit)` (the engine fits itself: no hand-set expert budget) and the variant's settings,
     generates N tokens after a P-token prompt of random ids, and prints prefill (P / time to first token) and
     decode tok/s, the engine's disk bytes, host hit rate and memory plan. A variant (`--only moetier-VARIANT`) is
     `PRECISION[+prefetch][+preload][+dint8|+dint4][+wide][+POLICY]`: PRECISION `bf16`, `int8` or `int4` (the tier
     of `moetier quantize`, made when missing) or `dynamic` (bf16 hot / int4 cold); `+prefetch` turns on the gate
     predictor's prefetch; `+preload` fills the expert tier at load (`--preload`, load time not counted, as
     llama.cpp's); `+dint8` / `+dint4` quantise the dense weights (`--dense-precision`); `+wide` runs the native
     step's wide mode (`--residual fp32`, llama.cpp's numerics); `+POLICY` names the cache policy (default
     LRU), e.g. `moetier-int4+dint4`, `moetier-bf16+prefetch+mrs`. PRECISION `gguf-TYPE` runs moetier on llama.cpp's
     own file of that type (precision and residual auto: computed as stored, on the wide step), e.g.
     `moetier-gguf-Q8_0+preload`.
3. **Table**: medians per candidate and limit: decode and prefill tok/s, the ratio to llama.cpp bf16 at the same
   limit, GB read from disk over the whole run (load included), moetier's own expert reads per prompt or generated
   token, host hit rate, cgroup peak (page cache included: reclaim holds it at the limit), moetier's own resident
   peak (VmHWM) and OOM kills. `--json FILE` keeps every run.

Needs root (cgroups, drop_caches) and cgroup v1's memory controller. Random weights route almost uniformly, the
worst case for any expert cache: these figures bound moetier's speed from below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO / "benchmarks"))

CGROUP = Path("/sys/fs/cgroup/memory")
PRECISIONS = ("bf16", "int8", "int4", "dynamic")


# ---------------------------------------------------------------- the child: one moetier run


def child(args: argparse.Namespace) -> None:
    """One moetier run in this process (already in its cgroup): JSON on stdout's last line."""
    import torch

    import moetier
    from moetier.config import Budgets, CacheConfig, EngineConfig, PrecisionConfig, PrefetchConfig, RuntimeConfig

    torch.set_num_threads(args.threads)
    base, *levers = args.variant.split("+")
    gguf = base.startswith("gguf-")  # llama.cpp's own file (--model is its path): experts computed as stored
    dense = next((lv.removeprefix("d") for lv in levers if lv in ("dint8", "dint4")), "full")
    preload = "preload" in levers
    residual = "fp32" if "wide" in levers else ("auto" if gguf else "bf16")
    levers = [lv for lv in levers if lv not in ("dint8", "dint4", "preload", "wide")]
    rt = RuntimeConfig(device="cpu", max_seq_len=args.max_seq_len, dense_precision=dense, preload=preload,
                       residual=residual)
    precision = PrecisionConfig(mode="auto") if gguf else {
                 "bf16": PrecisionConfig(mode="full"), "int8": PrecisionConfig(mode="int8"),
                 "int4": PrecisionConfig(mode="int4"),
                 "dynamic": PrecisionConfig(mode="dynamic", hi="full", lo="int4")}[base]  # fmt: skip
    prefetch = PrefetchConfig(enabled="prefetch" in levers)
    policies = [lv for lv in levers if lv != "prefetch"]
    cache = CacheConfig(policy=policies[0]) if policies else CacheConfig()
    cfg = EngineConfig(budgets=Budgets(memory_bytes=args.memory), precision=precision, prefetch=prefetch, cache=cache,
                       runtime=rt)  # fmt: skip
    t0 = time.perf_counter()
    with moetier.load(args.model, cfg) as engine:
        load_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(1)
        vocab = int(engine.loaded.config.vocab_size)
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        res = engine.generate(prompt, max_new_tokens=args.tokens, stop_at_eos=False)
        s = engine.stats()
    out = {"prefill": args.prompt_tokens / res.ttft_s, "decode": res.decode_tok_s, "load_s": load_s,
           "disk_bytes": s["disk_bytes"], "hit_rate": s["hit_rate"], "hits": s["hits"], "misses": s["misses"],
           "memory": s.get("memory"), "kernels": s.get("kernels")}  # fmt: skip
    print(json.dumps(out, default=str))


# ---------------------------------------------------------------- the parent: cgroups, runs, table


def pgpgin() -> int:
    """KiB read from block devices since boot (/proc/vmstat pgpgin)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pgpgin "):
            return int(line.split()[1]) * 1024
    return 0


def in_cgroup(cmd: list[str], limit: int, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str],
                                                                                    dict[str, int]]:  # fmt: skip
    """Run `cmd` in a fresh memory cgroup limited to `limit` bytes; (its result, the group's counters)."""
    group = CGROUP / f"moetier-btm-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        wrapper = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *cmd]
        proc = subprocess.run(wrapper, capture_output=True, text=True, env=env)
        oom = 0
        for line in (group / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                oom = int(line.split()[1])
        counters = {"peak": int((group / "memory.max_usage_in_bytes").read_text()),
                    "failcnt": int((group / "memory.failcnt").read_text()), "oom_kills": oom}  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            (group / "memory.force_empty").write_text("0")
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return proc, counters


def run_one(name: str, limit: int, a: argparse.Namespace, model: Path, ggufs: dict[str, Path],
            llama_bench: Path) -> dict[str, Any]:  # fmt: skip
    """One candidate at one limit, cold: page cache dropped, a fresh cgroup."""
    from vs_llamacpp import drop_page_cache

    why = drop_page_cache()
    if why:
        raise RuntimeError(why)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    before = pgpgin()
    t0 = time.perf_counter()
    if name.startswith("llamacpp-"):
        gtype = name.removeprefix("llamacpp-")
        cmd = [str(llama_bench), "-m", str(ggufs[gtype]), "-p", str(a.prompt_tokens), "-n", str(a.tokens), "-t",
               str(a.threads), "-r", "1", "--no-warmup", "-o", "json"]  # fmt: skip
        proc, cg = in_cgroup(cmd, limit, env)
        if proc.returncode != 0:
            return {"error": f"llama-bench exit {proc.returncode}: {proc.stderr.strip()[-300:]}", **cg}
        tests = json.loads(proc.stdout)
        pre = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
        dec = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
        out: dict[str, Any] = {"prefill": pre["avg_ts"], "decode": dec["avg_ts"]}
    else:
        variant = name.removeprefix("moetier-")
        src = ggufs[variant.split("+")[0].removeprefix("gguf-")] if variant.startswith("gguf-") else model
        cmd = [sys.executable, __file__, "child", "--model", str(src), "--memory", str(limit), "--variant", variant,
               "--prompt-tokens", str(a.prompt_tokens), "--tokens", str(a.tokens), "--threads", str(a.threads),
               "--max-seq-len", str(a.max_seq_len)]  # fmt: skip
        proc, cg = in_cgroup(cmd, limit, env)
        if proc.returncode != 0:
            return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}", **cg}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(cg)
    out["wall_s"] = time.perf_counter() - t0
    out["read_bytes"] = pgpgin() - before
    return out


def ensure_tier(model: Path, precision: str) -> None:
    """The int8 or int4 tier `moetier quantize` writes, made when missing."""
    from vs_llamacpp import ensure_tiers

    ensure_tiers(model, [precision], None, "search")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--model", required=True)
    c.add_argument("--memory", type=int, required=True)
    c.add_argument("--variant", required=True,
                   help=f"PRECISION[+prefetch][+preload][+dint8|+dint4][+wide][+POLICY]; {'/'.join(PRECISIONS)}")
    c.add_argument("--prompt-tokens", type=int, default=32)
    c.add_argument("--tokens", type=int, default=16)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--shares", default="0.5,0.25")
    ap.add_argument("--overhead", type=int, default=512 * 2**20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", action="store_true", help="a first round not counted (every run is cold anyway)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--gguf-types", default="Q4_K_M")
    ap.add_argument("--only", default="llamacpp-bf16,llamacpp-Q4_K_M,moetier-bf16,moetier-bf16+prefetch")
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cmd == "child":
        child(a)
        return
    if os.geteuid() != 0 or not (CGROUP / "memory.limit_in_bytes").exists():
        sys.exit("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    from _models import qwen3_bench_model
    from vs_llamacpp import cpu_isa, get_llamacpp, make_ggufs

    cache = Path(a.cache_dir)
    # 0. model, GGUF files, tiers
    model = qwen3_bench_model(cache, layers=a.layers)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    types = sorted({n.removeprefix("llamacpp-") for n in names if n.startswith("llamacpp-")}
                   | {n.removeprefix("moetier-gguf-").split("+")[0] for n in names if n.startswith("moetier-gguf-")})
    lc = get_llamacpp(cache, "0.3.36", a.skip_build)
    ggufs, _ = make_ggufs(cache, lc, model, [t for t in [*a.gguf_types.split(","), *types] if t])
    if any(n.startswith(("moetier-int4", "moetier-dynamic")) for n in names):
        ensure_tier(model, "int4")
    if any(n.startswith("moetier-int8") for n in names):
        ensure_tier(model, "int8")
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    limits = {float(sh): int(float(sh) * model_bytes) + a.overhead for sh in a.shares.split(",")}
    machine = cpu_isa()
    print(f"model {model.name}: {model_bytes / 2**30:.2f} GiB; limits "
          + ", ".join(f"{sh:.0%}: {lim / 2**30:.2f} GiB" for sh, lim in limits.items())
          + f"; {machine['cpu']} {' '.join(machine['flags'])}", flush=True)  # fmt: skip
    for t, p in ggufs.items():
        print(f"  {t}: {p.stat().st_size / 2**30:.2f} GiB", flush=True)
    # 2. interleaved rounds (the first a warm-up when more than one)
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    rounds = a.rounds + (1 if a.warmup else 0)
    for r in range(rounds):
        for sh, lim in limits.items():
            for name in names:
                got = run_one(name, lim, a, model, ggufs, lc.tool("llama-bench"))
                got["round"] = r
                print(f"round {r} {sh:.0%} {name}: " + json.dumps({k: v for k, v in got.items()
                      if k in ("decode", "prefill", "read_bytes", "peak", "oom_kills", "hit_rate", "error")}),
                      flush=True)  # fmt: skip
                if r > 0 or not a.warmup:
                    runs.setdefault((name, sh), []).append(got)
    # 3. the table
    print("\n| limit | candidate | decode tok/s | x llama.cpp bf16 | prefill tok/s | GB read (whole run) | "
          "engine MB read / token | host hit rate | cgroup peak MiB | moetier RSS peak MiB | OOM kills |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sh, lim in limits.items():
        base = None
        for name in names:
            ok = [g for g in runs.get((name, sh), []) if "error" not in g]
            if not ok:
                errs = [g.get("error") for g in runs.get((name, sh), [])]
                print(f"| {sh:.0%} ({lim / 2**30:.2f} GiB) | {name} | failed: {errs[:1]} | | | | | | | | |")
                continue
            med = {k: statistics.median(g[k] for g in ok) for k in ("decode", "prefill", "read_bytes", "peak")}
            oom = sum(g["oom_kills"] for g in ok)
            if name == "llamacpp-bf16":
                base = med["decode"]
            engine_mb = (f"{statistics.median(g['disk_bytes'] for g in ok) / (a.prompt_tokens + a.tokens) / 1e6:.0f}"
                         if "disk_bytes" in ok[0] else "")  # fmt: skip
            hit = f"{statistics.median(g['hit_rate'] for g in ok):.3f}" if "hit_rate" in ok[0] else ""
            x = f"{med['decode'] / base:.2f}" if base else ""
            rss = [g["memory"]["peak_rss_bytes"] for g in ok if isinstance(g.get("memory"), dict)]
            rss_mib = f"{max(rss) / 2**20:.0f}" if rss else ""
            print(f"| {sh:.0%} ({lim / 2**30:.2f} GiB) | {name} | {med['decode']:.2f} | {x} | {med['prefill']:.1f} | "
                  f"{med['read_bytes'] / 1e9:.2f} | {engine_mb} | {hit} | {med['peak'] / 2**20:.0f} | {rss_mib} | "
                  f"{oom} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "model": str(model), "model_bytes": model_bytes,
                                      "limits": {str(k): v for k, v in limits.items()},
                                      "runs": {f"{n}@{sh}": v for (n, sh), v in runs.items()}}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
