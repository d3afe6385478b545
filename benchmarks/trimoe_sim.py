"""TriMoE study on the three-domain simulator (sim/tri.py): MoE-layer decode speedup of every system over
the Klotski-style baseline (paper Fig. 6), end-to-end throughput (Fig. 7), per-domain utilisation (Table 3),
the ablation GPU-NDP -> +CPU -> +refinement -> +relayout (Fig. 8), predictor accuracy and migration overhead,
on synthetic TriMoE-3.1 traces of DeepSeek-V2, Qwen3-235B-A22B and GLM-4.5-Air.

Usage: python benchmarks/trimoe_sim.py [--batches 512] [--steps 8] [--models ...]; prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from moetier.policies.schedulers import TRI_SCHEDULERS
from moetier.sim.tri import TriSimConfig, simulate_tri
from moetier.specs import load_spec
from moetier.studies.sweep_tri import synthetic_calls

MODELS = ("deepseek-v2", "qwen3-235b-a22b", "glm-4.5-air")
BASELINES = ("klotski", "ktransformers-plus", "monde", "trimoe")
ABLATION = (  # (label, scheduler, refinement, relayout)
    ("gpu-ndp", "gpu-ndp", False, False),
    ("+cpu", "trimoe", False, False),
    ("+refinement", "trimoe", True, False),
    ("+relayout", "trimoe", True, True),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[512])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows, ablation = [], []
    for model in a.models:
        spec = load_spec(model)
        for batch in a.batches:
            base = TriSimConfig(batch_size=batch, steps=a.steps, seed=a.seed)
            calls = synthetic_calls(spec, base)
            res = {}
            for name in BASELINES:
                t0 = time.perf_counter()
                res[name] = simulate_tri(spec, calls, replace(base, scheduler=name))
                res[name].extra["wall_s"] = time.perf_counter() - t0
            k = res["klotski"]
            for name, r in res.items():
                rows.append({
                    "model": model, "batch": batch, "system": name, "moe_ms_per_step": 1e3 * r.moe_s / r.steps,
                    "moe_speedup": k.moe_s / r.moe_s, "e2e_speedup": r.throughput_tok_s / k.throughput_tok_s,
                    "tok_s": r.throughput_tok_s, "busy": dict(r.busy), "flop_util": dict(r.flop_util),
                    "experts": dict(r.experts), "predictor_acc": r.predictor["accuracy"],
                    "migration": dict(r.migration), "moves": r.moves, "wall_s": r.extra["wall_s"],
                })  # fmt: skip
            if batch == 512 or len(a.batches) == 1:
                prev = None
                for label, sched, ref, rel in ABLATION:
                    cfg = replace(base, scheduler=sched, refinement=ref, relayout=rel)
                    r = res["trimoe"] if (sched, ref, rel) == ("trimoe", True, True) else simulate_tri(spec, calls, cfg)
                    ablation.append({"model": model, "batch": batch, "step": label,
                                     "moe_ms_per_step": 1e3 * r.moe_s / r.steps,
                                     "gain": 1.0 if prev is None else prev / r.moe_s})  # fmt: skip
                    prev = r.moe_s
    print(f"{'model':16} {'batch':>5} {'system':19} {'MoE ms/step':>11} {'MoE x':>6} {'e2e x':>6} {'tok/s':>7} "
          f"{'busy g/c/n/dimm':>20} {'flop util g/c/n':>16} {'pred':>5} {'wall':>5}")  # fmt: skip
    for r in rows:
        b, f = r["busy"], r["flop_util"]
        print(f"{r['model']:16} {r['batch']:5} {r['system']:19} {r['moe_ms_per_step']:11.1f} {r['moe_speedup']:6.2f} "
              f"{r['e2e_speedup']:6.2f} {r['tok_s']:7.0f} {b['gpu']:.2f}/{b['cpu']:.2f}/{b['ndp']:.2f}/{b['dimm']:.2f} "
              f"  {f['gpu']:.3f}/{f['cpu']:.3f}/{f['ndp']:.3f} {r['predictor_acc']:5.2f} "
              f"{r['wall_s']:5.1f}")  # fmt: skip
    print("\nmigration (trimoe): prefetch / relayout / migrate counts, PCIe s, DIMM-Link s, link time / run time")
    for r in rows:
        if r["system"] == "trimoe":
            m = r["migration"]
            print(f"{r['model']:16} {r['batch']:5} {m['prefetch']:5.0f} {m['relayout']:6.0f} {m['migrate']:5.0f} "
                  f"{m['pcie_s']:.4f} {m['dimm_link_s']:.4f} {m['link_frac']:.4f}")  # fmt: skip
    print("\nablation (MoE ms/step, gain over the previous step)")
    for r in ablation:
        print(f"{r['model']:16} {r['batch']:5} {r['step']:13} {r['moe_ms_per_step']:9.1f} {r['gain']:6.2f}")
    print(json.dumps({"bench": "trimoe_sim", "steps": a.steps, "systems": list(TRI_SCHEDULERS), "rows": rows,
                      "ablation": ablation}))  # fmt: skip


if __name__ == "__main__":
    main()
