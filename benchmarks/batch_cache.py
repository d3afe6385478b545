"""Cache hit rates under batched decode (issue 29): B sequences decoding together against one sequence alone.

Each trace is a batch-1 routing stream. moetier.sim.cache_replay.batched_calls turns it into B sequences
decoding together (B cursors spread evenly over the stream, one layer call per step holding the B tokens' rows,
as runtime/batch.py runs a server's batch), which moetier.sim.cache_replay.replay runs through each policy with
a cold cache of --ratio of all routed experts; an access is one unique expert of one layer call. mrs-admit is
replayed as the engine's store runs it (transient slots, pin groups, bypass: tests/store/test_store_admit.py
checks that the two count the same).

Traces: the bundled model's (data/traces/*.parquet, router scores recorded) and, when the folder exists, the
real routing traces in ../shared/data/traces/*/trace.parquet (no licence: read in place, never copied; without
router scores the replay falls back to the gate weights). A missing folder is skipped with a note. Streams
longer than --steps are cut to their first --steps decode steps.

Prints a table (hit rate in %, per trace, per B, per policy), then one JSON line.

    python benchmarks/batch_cache.py [--batches 1,8] [--ratio 0.25] [--steps 400] [--policies lru,lfu,mrs,mrs-admit]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moetier import traces  # noqa: E402
from moetier.sim.cache_replay import batched_calls, parse_policies, replay, trace_layers  # noqa: E402

SHARED_TRACES = ROOT.parent / "shared" / "data" / "traces"


def trace_paths() -> tuple[list[tuple[str, Path]], list[str]]:
    """(name, path) of every trace to replay, and notes on what was skipped."""
    out = [(f"bundled/{p.stem}", p) for p in sorted((ROOT / "data" / "traces").glob("*.parquet"))]
    notes = []
    if SHARED_TRACES.is_dir():
        out += [(f"real/{p.parent.name}", p) for p in sorted(SHARED_TRACES.glob("*/trace.parquet"))]
    else:
        notes.append(f"{SHARED_TRACES} not found: real traces skipped")
    return out, notes


def run(name: str, path: Path, batches: list[int], ratio: float, steps: int, policies: list[str]) -> dict[str, Any]:
    trace = traces.load(path)
    meta = trace.metadata
    calls = traces.iter_calls(trace)
    n_experts, top_k = int(meta["num_experts"]), int(meta["top_k"])
    layers = trace_layers(trace)
    out: dict[str, Any] = {"trace": name, "num_experts": n_experts, "top_k": top_k, "rows": {}}
    stream = len({c.step for c in calls if c.step > 0})
    out["steps"] = min(stream, steps)
    for b in batches:
        merged = batched_calls(calls, b, steps=min(stream, steps))
        row: dict[str, dict[str, Any]] = {}
        for policy in policies:
            t0 = time.perf_counter()
            res = replay(merged, policy, ratio, n_experts, top_k=top_k, layers=layers)
            row[policy] = {"hit_rate": res.hit_rate, "accesses": res.accesses, "bypasses": res.bypasses,
                           "slots": res.slots, "scores": res.scores, "seconds": time.perf_counter() - t0}  # fmt: skip
        out["rows"][str(b)] = row
        print(f"{name:<44} B={b:<3} " + "  ".join(f"{p} {100 * r['hit_rate']:5.1f}" for p, r in row.items()),
              flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8", help="sequences decoding together, comma-separated")
    ap.add_argument("--ratio", type=float, default=0.25, help="cache slots / all routed experts")
    ap.add_argument("--steps", type=int, default=400, help="decode steps replayed per trace (at most)")
    ap.add_argument("--policies", default="lru,lfu,mrs,mrs-admit")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    policies = parse_policies(args.policies)
    paths, notes = trace_paths()
    for note in notes:
        print(f"note: {note}")
    print(f"hit rate in % at {args.ratio:.0%} of the experts, cold cache, at most {args.steps} decode steps")
    results = [run(name, path, batches, args.ratio, args.steps, policies) for name, path in paths]
    print(json.dumps({"benchmark": "batch_cache", "ratio": args.ratio, "batches": batches, "policies": policies,
                      "max_steps": args.steps, "notes": notes, "traces": results}))  # fmt: skip


if __name__ == "__main__":
    main()
