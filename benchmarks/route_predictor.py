"""How well does the trace-side history predictor (policies/route_history.py) predict the next MoE layers?

For each trace: every layer call is fed in order (online: the predictor learns only from calls already
fed) and, after each call, the experts of the next 1..3 MoE layers of the same step are predicted.
Reported: per-token precision per distance over the whole trace (from an empty history), and over its
second half (after learning on the first), beside two simple references at the target layer: "previous
token" (the same token position's experts at that layer one step earlier) and "most frequent so far"
(the layer's k most routed experts so far). Chance is k / E.

Traces: the synthetic presets of the three HybriMoE models (stats hybrimoe and trimoe; 512 decode
steps, seed 0, batch 1) and, when ../shared/data/traces/ exists (resolved from the repository root), the
real traces there (read in place, never copied; skipped cleanly when absent).

    python benchmarks/route_predictor.py [--steps 512] [--no-real]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from moetier.policies.route_history import RouteHistoryPredictor
from moetier.specs import load_spec
from moetier.studies.synthetic import generate, preset
from moetier.traces import Call, iter_calls, load

MODELS = ("mixtral-8x7b", "qwen2-57b-a14b", "deepseek-v2-lite")
REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
DEPTH = 3


def evaluate(calls: list[Call], E: int, k: int) -> dict[str, Any]:
    layers = sorted({c.layer for c in calls})
    pred = RouteHistoryPredictor(layers, E, k, DEPTH)
    steps = sorted({c.step for c in calls})
    half = steps[len(steps) // 2]
    prev: dict[int, np.ndarray] = {}
    freq = np.zeros((len(layers), E))
    ref = {"prev_token": [0, 0], "most_frequent": [0, 0]}
    first_half: dict[int, dict[str, float]] = {}
    for c in calls:
        if c.step == half and not first_half:
            first_half = pred.stats()
            pred.reset_stats()
        ids = np.asarray(c.ids, dtype=np.int64)
        p = layers.index(c.layer)
        if c.step >= half:  # references scored on the second half, like the predictor's second-half figure
            before = prev.get(p)
            if before is not None and before.shape == ids.shape:
                ref["prev_token"][0] += before.size
                ref["prev_token"][1] += int((before[:, :, None] == ids[:, None, :]).any(-1).sum())
            top = np.argsort(-freq[p], kind="stable")[:k]
            ref["most_frequent"][0] += ids.size
            ref["most_frequent"][1] += int(np.isin(ids, top).sum())
        pred.feed(c.layer, ids)
        for d in range(1, DEPTH + 1):
            if p + d < len(layers):
                pred.predict(c.layer, d)
        prev[p] = ids
        np.add.at(freq[p], ids.ravel(), 1.0)
    second = pred.stats()
    return {
        "whole": {d: round((first_half[d]["correct"] + second[d]["correct"])
                           / max(1, first_half[d]["predicted"] + second[d]["predicted"]), 3) for d in second},
        "second_half": {d: round(v["accuracy"], 3) for d, v in second.items()},
        "prev_token": round(ref["prev_token"][1] / max(1, ref["prev_token"][0]), 3),
        "most_frequent": round(ref["most_frequent"][1] / max(1, ref["most_frequent"][0]), 3),
        "chance": round(k / E, 3), "steps": len(steps), "layers": len(layers),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--no-real", action="store_true")
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    for name in MODELS:
        spec = load_spec(name)
        for stats in ("hybrimoe", "trimoe"):
            calls = iter_calls(generate(preset(spec, stats=stats), args.steps, prompt_len=0, with_scores=False))
            rows[f"{name} (synthetic {stats})"] = evaluate(calls, spec.num_experts, spec.top_k)
    if not args.no_real:
        if REAL.is_dir():
            for folder in sorted(p for p in REAL.iterdir() if p.is_dir()):
                files = sorted(folder.glob("*.parquet"))
                if not files:
                    continue
                t = load(files[0])
                meta = t.metadata
                rows[f"{folder.name} (real)"] = evaluate(iter_calls(t), int(meta["num_experts"]), int(meta["top_k"]))
        else:
            print(f"(no real traces at {REAL}: skipped)")
    print(f"{'trace':<52} {'d=1':>6} {'d=2':>6} {'d=3':>6} | {'2nd half d=1/2/3':>18} | "
          f"{'prev':>5} {'freq':>5} {'chance':>6}")  # fmt: skip
    for name, r in rows.items():
        w, h = r["whole"], r["second_half"]
        print(f"{name:<52} {w[1]:>6.3f} {w[2]:>6.3f} {w[3]:>6.3f} | {h[1]:>5.3f} {h[2]:>5.3f} {h[3]:>5.3f} | "
              f"{r['prev_token']:>5.3f} {r['most_frequent']:>5.3f} {r['chance']:>6.3f}")  # fmt: skip
    print(json.dumps({"benchmark": "route_predictor", "steps": args.steps, "traces": rows}))


if __name__ == "__main__":
    main()
