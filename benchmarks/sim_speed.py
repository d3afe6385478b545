"""Speed of the simulator itself: replay 1000 decode steps of DeepSeek-V2-Lite at batch 1.

Issue 5 target: at most 10 seconds on this machine, scheduler calls included. The trace is the
synthetic DeepSeek-V2-Lite preset (moetier.studies.synthetic.preset, seed 0) with a 32-token prompt;
the machine is the paper's (the shipped profile a6000-5220r), cache ratio 0.5. Timed: `simulate()`
alone (wall clock and process CPU time, best of --repeat; the CPU time is what
counts on a shared machine), per scheduler; trace generation and `iter_calls` are
timed separately. `--prefetch` adds the prefetching runs (choose_prefetch on every MoE layer).

    python benchmarks/sim_speed.py [--steps 1000] [--schedulers hybrimoe,...] [--prefetch] [--repeat 1]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from moetier.policies.costmodel import load_profile
from moetier.sim import SimConfig, simulate
from moetier.specs import load_spec
from moetier.studies.synthetic import generate, preset
from moetier.traces import iter_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--schedulers", default="hybrimoe,ktransformers,gpu-lru")
    ap.add_argument("--prefetch", action="store_true", help="also time runs with prefetching on")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cache-ratio", type=float, default=0.5)
    args = ap.parse_args()
    spec, profile = load_spec("deepseek-v2-lite"), load_profile("a6000-5220r")
    t0 = time.perf_counter()
    trace = generate(preset(spec), args.steps, prompt_len=32)
    t1 = time.perf_counter()
    calls = iter_calls(trace)
    t2 = time.perf_counter()
    result: dict[str, float] = {"trace_gen_s": round(t1 - t0, 3), "iter_calls_s": round(t2 - t1, 3)}
    print(f"trace generation {t1 - t0:.2f} s, iter_calls {t2 - t1:.2f} s ({len(calls)} layer calls)")
    print(f"{'scheduler':<16} {'prefetch':>8} {'wall s':>8} {'cpu s':>8} {'tbt ms':>8} {'hit rate':>8}")
    for name in args.schedulers.split(","):
        for pf in (False, True) if args.prefetch else (False,):
            cfg = SimConfig(scheduler=name, cache_ratio=args.cache_ratio, prefetch=pf, steps=args.steps)
            best, cpu = float("inf"), float("inf")
            for _ in range(args.repeat):
                s, c = time.perf_counter(), time.process_time()
                r = simulate(spec, profile, calls, cfg)
                best, cpu = min(best, time.perf_counter() - s), min(cpu, time.process_time() - c)
            key = f"{name}{'+prefetch' if pf else ''}"
            result[f"{key}_s"], result[f"{key}_cpu_s"] = round(best, 3), round(cpu, 3)
            print(f"{name:<16} {'on' if pf else 'off':>8} {best:>8.2f} {cpu:>8.2f} {r.tbt_s * 1e3:>8.2f} "
                  f"{r.hit_rate:>8.3f}")
    print(json.dumps({"benchmark": "sim_speed", "model": spec.name, "profile": profile.name, "steps": args.steps,
                      "batch": 1, "cache_ratio": args.cache_ratio, **result}))  # fmt: skip


if __name__ == "__main__":
    main()
