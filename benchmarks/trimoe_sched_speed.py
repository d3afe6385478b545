"""Speed of TriMoE's bottleneck-aware greedy makespan scheduler: one DeepSeek-V2 layer call at batch 512.

Issue 6 target: one layer's schedule for 160 experts at batch 512 in at most 1 ms on this machine.
Instance: DeepSeek-V2 (160 routed experts, top-6, expert 3 x 5120 x 1536 bf16 = 47.2 MB): 512 tokens give
3072 token-expert pairs, skewed as in TriMoE 3.1: 5% hot experts take 22% of the pairs, 25% warm experts 70%,
70% cold experts 8% (every expert gets at least one pair, the rest drawn by class share). The hot experts and
a random 4% more are resident in HBM; cold experts are localised (random home DIMM of 16), warm and hot
striped, with --stale (10%) of each flipped (a stale layout). Costs from TriMoE Table 1 (the shipped profile h100-8470):
- f_calc_gpu: max(W / HBM bw, 2 * 3 * H * I * L / (peak * eff(L))) + overhead, eff from the H100 LUT;
- f_calc_cpu: 2 * 3 * H * I * L / (AMX peak * eff(L)) + overhead (its DRAM read is T_DRAM, eq. 3);
- f_calc_ndp: FLOPs / 256 GFLOPS; T_Internal: W / 153.6 GB/s; T_PCIe: 10 us + W / 64 GB/s;
- T_DRAM: dram_read_s(W, layout, 307.2 GB/s, 16).
Only `schedule_trimoe(experts, 16)` is timed (wall clock and thread CPU time per call, medians over --runs
calls cycling over --instances instances); also reported: greedy vs refined makespan, refinement moves,
and the domain counts by class. A second timed case, "refining", makes every expert striped and non-resident
(no NDP, GPU vs CPU balancing), where refinement makes about a dozen moves per call.

    python benchmarks/trimoe_sched_speed.py [--runs 2000] [--instances 50] [--stale 0.1]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, from any cwd
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "src"))  # moetier without an install

from moetier.policies.costmodel import load_profile
from moetier.policies.schedule_tri_base import TriExpert, dram_read_s
from moetier.policies.schedule_trimoe import schedule_trimoe
from moetier.types import Domain, ExpertKey, Layout

E, TOP_K, BATCH, N_DIMMS = 160, 6, 512, 16
HIDDEN, INTER, DTYPE_BYTES = 5120, 1536, 2
W = 3 * HIDDEN * INTER * DTYPE_BYTES
NDP_FLOPS, NDP_BW, HOST_BW = 256e9, 153.6e9, 307.2e9
CLASSES = (("hot", 0.05, 0.22), ("warm", 0.25, 0.70), ("cold", 0.70, 0.08))  # (name, share of experts, of pairs)


def loads(rng: random.Random) -> tuple[list[int], list[str]]:
    """Token load per expert (sum E * ... = BATCH * TOP_K, each >= 1) and each expert's class."""
    order = list(range(E))
    rng.shuffle(order)
    cls = [""] * E
    weight = [0.0] * E
    start = 0
    for name, share_e, share_t in CLASSES:
        n = round(E * share_e)
        for e in order[start : start + n]:
            cls[e] = name
            weight[e] = share_t / n * rng.uniform(0.5, 1.5)
        start += n
    tokens = [1] * E
    for e in rng.choices(range(E), weights=weight, k=BATCH * TOP_K - E):
        tokens[e] += 1
    return tokens, cls


def instance(rng: random.Random, stale: float) -> tuple[list[TriExpert], list[str]]:
    prof = load_profile("h100-8470")
    gpu, cpu, pcie = prof.gpu, prof.cpu, prof.pcie
    assert gpu is not None and pcie is not None
    tokens, cls = loads(rng)
    out = []
    for e in range(E):
        L = tokens[e]
        flops = 2 * 3 * HIDDEN * INTER * L
        resident = cls[e] == "hot" or rng.random() < 0.04
        local = (cls[e] == "cold") != (rng.random() < stale)
        layout = Layout.LOCALISED if local else Layout.STRIPED
        out.append(
            TriExpert(
                key=ExpertKey(1, e),
                tokens=L,
                resident=resident,
                layout=layout,
                dimm=rng.randrange(N_DIMMS) if local else -1,
                gpu_calc_s=max(W / gpu.mem_bw, flops / (gpu.peak_flops * gpu.eff(L))) + gpu.overhead_s,
                cpu_calc_s=flops / (cpu.peak_flops * cpu.eff(L)) + cpu.overhead_s,
                ndp_calc_s=flops / NDP_FLOPS,
                pcie_s=pcie.latency_s + W / pcie.bandwidth,
                dram_s=dram_read_s(W, layout, HOST_BW, N_DIMMS),
                internal_s=W / NDP_BW,
                busy_s=(W / N_DIMMS if layout == Layout.STRIPED else W) / NDP_BW,  # sim/ndp.py "array" reading
            )
        )
    return out, cls


def median_us(calls: list[list[TriExpert]], runs: int) -> tuple[float, float]:
    """Median microseconds of schedule_trimoe over `runs` calls cycling over `calls`: wall clock and this
    thread's CPU time (the machine is shared: preemption inflates wall times, not CPU times)."""
    wall, cpu_t = [], []
    for i in range(runs):
        experts = calls[i % len(calls)]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        schedule_trimoe(experts, N_DIMMS)
        cpu_t.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - t0)
    return statistics.median(wall) / 1000.0, statistics.median(cpu_t) / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--instances", type=int, default=50)
    ap.add_argument("--stale", type=float, default=0.10, help="fraction of experts with the other layout")
    args = ap.parse_args()
    rng = random.Random(0)
    cases = [instance(rng, args.stale) for _ in range(args.instances)]
    us, cus = median_us([x for x, _ in cases], args.runs)
    striped = dram_read_s(W, Layout.STRIPED, HOST_BW, N_DIMMS)
    refining = [
        [replace(e, layout=Layout.STRIPED, dimm=-1, resident=False, dram_s=striped) for e in x] for x, _ in cases
    ]
    r_us, r_cus = median_us(refining, args.runs)
    r_moves = statistics.median(schedule_trimoe(x, N_DIMMS).moves for x in refining)
    res = [schedule_trimoe(x, N_DIMMS) for x, _ in cases]
    greedy_ms = statistics.median(r.greedy.makespan * 1e3 for r in res)
    refined_ms = statistics.median(r.makespan * 1e3 for r in res)
    gain = statistics.median(r.greedy.makespan / r.makespan for r in res)
    moves = statistics.median(r.moves for r in res)
    counts = {f"{c}_{d.value}": 0 for c, _, _ in CLASSES for d in Domain}
    for (x, cls), r in zip(cases, res, strict=True):
        for e, c in zip(x, cls, strict=True):
            counts[f"{c}_{r.plan.domains[e.key].value}"] += 1
    print(f"{'quantity':<34} {'value':>10}")
    rows = [
        ("schedule wall (median us)", us),
        ("schedule thread CPU (median us)", cus),
        ("greedy makespan (median ms)", greedy_ms),
        ("refined makespan (median ms)", refined_ms),
        ("greedy / refined (median)", gain),
        ("refinement moves (median)", moves),
        ("refining case wall (median us)", r_us),
        ("refining case thread CPU (median us)", r_cus),
        ("refining case moves (median)", r_moves),
    ]
    rows += [(f"experts {k} (mean per call)", v / len(cases)) for k, v in counts.items()]
    for name, v in rows:
        print(f"{name:<34} {v:>10.3f}")
    print(
        json.dumps(
            {
                "benchmark": "trimoe_sched_speed",
                "experts": E,
                "batch": BATCH,
                "n_dimms": N_DIMMS,
                "schedule_us": round(us, 1),
                "schedule_cpu_us": round(cus, 1),
                "target_us": 1000,
                "greedy_makespan_ms": round(greedy_ms, 4),
                "refined_makespan_ms": round(refined_ms, 4),
                "refine_gain": round(gain, 4),
                "moves": moves,
                "stale": args.stale,
                "refining_us": round(r_us, 1),
                "refining_cpu_us": round(r_cus, 1),
                "refining_moves": r_moves,
            }
        )
    )


if __name__ == "__main__":
    main()
