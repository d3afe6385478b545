"""Speed of the planning machinery itself: one 64-expert layer call through a scheduler, and a prefetch choice.

Issue 5 target: `plan()` (a scheduler's `schedule`) of a 64-expert layer in at most 200 microseconds.
Costs are realistic: priced by the cost model for Qwen2-57B-A14B (64 routed experts, top-8, one shared
expert) on the paper's machine (the shipped profile a6000-5220r). Cases:
- decode: top-8 of 64 experts, 1 token each, plus the shared expert;
- prefill: all 64 experts active with 1..300 tokens each (uniform), plus the shared expert;
each with a random 25% or 50% of the routed experts cached. Work lists are built up front; only
`schedule(work)` is timed (wall clock and thread CPU time around each call, medians over --runs calls,
cycling over --instances random instances). Also timed: choose_prefetch over 3 predicted decode layers and
3 predicted prefill layers (64 experts each) with the same scheduler, a link budget of three
routed-expert moves and at most 8 experts.

    python benchmarks/plan_speed.py [--scheduler hybrimoe] [--runs 3000] [--instances 50]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from moetier.policies.costmodel import CostModel, load_profile
from moetier.policies.prefetch import choose_prefetch
from moetier.policies.schedule_base import ExpertWork
from moetier.policies.schedulers import make_scheduler
from moetier.specs import load_spec
from moetier.types import ExpertKey


def instances(
    cm: CostModel, rng: random.Random, n: int, mode: str, ratio: float, layer: int = 0
) -> list[list[ExpertWork]]:
    out = []
    for _ in range(n):
        if mode == "decode":
            counts = {e: 1 for e in rng.sample(range(64), 8)}
            shared = 1
        else:
            counts = {e: rng.randint(1, 300) for e in range(64)}
            shared = sum(counts.values()) // 8
        cached = {ExpertKey(layer, e) for e in rng.sample(range(64), int(64 * ratio))}
        out.append(cm.work(layer, counts, cached, shared_tokens=shared))
    return out


def median_us(fn: Callable[..., object], args: list[tuple[Any, ...]], runs: int) -> tuple[float, float]:
    """Median microseconds of fn(*args[i % len(args)]) over `runs` calls: wall clock, and this thread's CPU
    time (the machine is shared: preemption inflates wall times of millisecond calls, not CPU times)."""
    wall, cpu = [], []
    for i in range(runs):
        a = args[i % len(args)]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(*a)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - t0)
    return statistics.median(wall) / 1000.0, statistics.median(cpu) / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", default="hybrimoe")
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--instances", type=int, default=50)
    args = ap.parse_args()
    cm = CostModel(load_profile("a6000-5220r"), load_spec("qwen2-57b-a14b"))
    sched = make_scheduler(args.scheduler)
    rng = random.Random(0)
    result: dict[str, float] = {}
    print(f"{'case':<28} {'wall us':>10} {'cpu us':>10}")
    for mode in ("decode", "prefill"):
        for ratio in (0.25, 0.5):
            works = instances(cm, rng, args.instances, mode, ratio)
            us, cpu = median_us(sched.schedule, [(w,) for w in works], args.runs)
            name = f"schedule_{mode}_{int(ratio * 100)}"
            result[name], result[name + "_cpu"] = round(us, 1), round(cpu, 1)
            print(f"{name:<28} {us:>10.1f} {cpu:>10.1f}")
    for mode in ("decode", "prefill"):
        layers = {lay: instances(cm, rng, 1, mode, 0.25, layer=lay)[0] for lay in (1, 2, 3)}
        budget = 3 * max(w.move_s for w in layers[1] if w.key.expert >= 0)  # three routed moves
        us, cpu = median_us(choose_prefetch, [(layers, sched, budget, 8)], max(50, args.runs // 30))
        name = f"prefetch_{mode}_3x64"
        result[name], result[name + "_cpu"] = round(us, 1), round(cpu, 1)
        print(f"{name:<28} {us:>10.1f} {cpu:>10.1f}")
    print(json.dumps({"benchmark": "plan_speed", "scheduler": args.scheduler, "unit": "us", **result}))


if __name__ == "__main__":
    main()
