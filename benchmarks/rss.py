"""Peak RSS when experts do not fit: experts = 4x the host expert budget.

Builds the benchmark model (benchmarks/_models.py), then under `/usr/bin/time -v`:
  (a) a child that only imports torch, transformers and moetier (the constant cost),
  (b) a child that loads the model with a host budget of 25% of its expert bytes and
      greedily decodes 32 tokens.
Reports peak RSS of (b) against non-expert bytes + budget + (a). Prints one JSON line.

    python benchmarks/rss.py [--budget-fraction 0.25] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd


def peak_rss(argv: list[str]) -> int:
    """Run argv under /usr/bin/time -v; return its maximum resident set size in bytes."""
    proc = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if m is None:
        raise SystemExit(f"no RSS in /usr/bin/time output:\n{proc.stderr}")
    return int(m.group(1)) * 1024


def child(path: str, budget: int, tokens: int) -> None:
    import moetier

    cfg = moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget), runtime=moetier.RuntimeConfig(dtype="bf16")
    )
    with moetier.load(path, cfg) as engine:
        res = engine.generate(list(range(3, 19)), max_new_tokens=tokens, stop_at_eos=False)
        print(json.dumps(res.stats | {"info": engine.info.as_dict()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "BUDGET", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    from benchmarks._models import qwen3_bench_model
    from moetier.formats.checkpoint import CheckpointIndex
    from moetier.models.open import read_config

    # 1. model and its byte split
    path = str(qwen3_bench_model(args.cache_dir))
    read_config(path)
    index = CheckpointIndex(path)
    expert = sum(loc.nbytes for n, loc in index.tensors.items() if ".experts." in n)
    non_expert = sum(loc.nbytes for loc in index.tensors.values()) - expert
    budget = int(expert * args.budget_fraction)
    # 2. the two children
    base = peak_rss([sys.executable, "-c", "import torch, transformers, moetier, moetier.runtime.lean"])
    run = peak_rss([sys.executable, "-m", "benchmarks.rss", "--child", path, str(budget), str(args.tokens)])
    bound = non_expert + budget + base
    mib = 2**20
    print(f"expert bytes        {expert / mib:9.1f} MiB")
    print(f"host expert budget  {budget / mib:9.1f} MiB  ({args.budget_fraction:.0%} of experts)")
    print(f"non-expert bytes    {non_expert / mib:9.1f} MiB")
    print(f"import-only RSS     {base / mib:9.1f} MiB")
    print(f"peak RSS (decode)   {run / mib:9.1f} MiB")
    print(f"non-expert + budget + import = {bound / mib:.1f} MiB; peak exceeds it by {(run - bound) / mib:+.1f} MiB")
    print(json.dumps({
        "benchmark": "rss", "expert_bytes": expert, "budget_bytes": budget, "non_expert_bytes": non_expert,
        "import_rss_bytes": base, "peak_rss_bytes": run, "excess_over_bound_bytes": run - bound,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
