"""Cache hit rates of LRU, LFU, MRS and Belady at cache ratios 25/50/75% (issue 5, HybriMoE VI-D).

Two sets of traces, each replayed with a cold cache by moetier.sim.cache_replay (one global cache
of ratio x all routed experts of all MoE layers; an access is one unique expert of one layer call):

(a) recorded: the bundled model (models/tiny-shakespeare-moe) generates from several passages of
    data/shakespeare_heldout.txt (sampled, temperature 0.8, seeded) with router scores recorded,
    through the Python API (moetier.load, Engine.record_trace, Engine.generate). The rows sum the
    hits and accesses of all prompts.
(b) synthetic: moetier.studies.synthetic.generate(preset(name), steps, prompt_len) for Mixtral-8x7B,
    Qwen2-57B-A14B and DeepSeek-V2-Lite (skipped, with a note, if moetier.studies.synthetic is missing).

`--alphas 0.05,0.1,...` adds one MRS row per alpha (the sweep behind MRS's default). Prints a
table (overall hit rate; decode-only in brackets), then one JSON line.

    python benchmarks/cache_hits.py [--prompts 4] [--tokens 200] [--steps 1000] [--alphas 0.1,0.3]
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

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from moetier import traces  # noqa: E402
from moetier.sim.cache_replay import replay, trace_layers  # noqa: E402

POLICIES = ("lru", "lfu", "mrs", "belady")
RATIOS = (0.25, 0.5, 0.75)
SYNTH_SPECS = ("mixtral-8x7b", "qwen2-57b-a14b", "deepseek-v2-lite")


def record_bundled(out_dir: Path, prompts: int, tokens: int, lines: int = 30) -> list[Path]:
    """One trace per prompt: `lines` lines of the held-out text at evenly spaced offsets."""
    import moetier

    text = (ROOT / "data" / "shakespeare_heldout.txt").read_text(encoding="utf-8").splitlines()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(prompts):
        start = 200 + i * (len(text) - 400) // max(1, prompts)
        prompt = "\n".join(text[start : start + lines])
        path = out_dir / f"bundled-{i}.parquet"
        with moetier.load(ROOT / "models" / "tiny-shakespeare-moe") as engine:
            engine.record_trace(path, with_scores=True)
            engine.generate(prompt, tokens, moetier.SamplingConfig(temperature=0.8, top_p=0.95, seed=i),
                            stop_at_eos=False)  # fmt: skip
        paths.append(path)
    return paths


def synthetic_traces(steps: int, prompt_len: int) -> tuple[dict[str, list[traces.Trace]], str | None]:
    """name -> [trace] from moetier.studies.synthetic presets; (empty, reason) when the module is missing."""
    try:
        from moetier.studies import synthetic
    except ImportError as exc:
        return {}, f"moetier.studies.synthetic not available ({exc})"
    return {name: [synthetic.generate(synthetic.preset(name), steps, prompt_len=prompt_len)]
            for name in SYNTH_SPECS}, None  # fmt: skip


def variants(alphas: list[float]) -> list[tuple[str, str, dict[str, Any]]]:
    """(column label, policy, knobs): the four policies, then MRS per swept alpha."""
    rows: list[tuple[str, str, dict[str, Any]]] = [(p, p, {}) for p in POLICIES]
    rows += [(f"mrs a={a:g}", "mrs", {"alpha": a}) for a in alphas]
    return rows


def measure(group: list[traces.Trace], ratio: float, policy: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """Replay every trace of a group; hits and accesses summed over them."""
    tot = {"accesses": 0, "hits": 0, "decode_accesses": 0, "decode_hits": 0, "replay_s": 0.0}
    for tr in group:
        calls = traces.iter_calls(tr)
        res = replay(calls, policy, ratio, num_experts=int(tr.metadata["num_experts"]),
                     top_k=int(tr.metadata["top_k"]), layers=trace_layers(tr), **knobs)  # fmt: skip
        for k in ("accesses", "hits", "decode_accesses", "decode_hits"):
            tot[k] += getattr(res, k)
        tot["replay_s"] += res.seconds
    tot["hit_rate"] = tot["hits"] / tot["accesses"] if tot["accesses"] else 0.0
    tot["decode_hit_rate"] = tot["decode_hits"] / tot["decode_accesses"] if tot["decode_accesses"] else 0.0
    return tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="bundled-model traces to record")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per bundled-model trace")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps per synthetic trace")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each synthetic trace (step 0)")
    ap.add_argument("--alphas", default="", help="comma list of extra MRS alphas to sweep")
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "cache_hits", help="where recorded traces go")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",") if a.strip()]

    # 1. the traces
    t0 = time.perf_counter()
    groups: dict[str, list[traces.Trace]] = {
        "bundled (recorded)": [traces.load(p) for p in record_bundled(args.out, args.prompts, args.tokens)]
    }
    record_s = time.perf_counter() - t0
    synth, missing = synthetic_traces(args.steps, args.prompt_len)
    groups |= {f"{name} (synthetic)": group for name, group in synth.items()}
    # 2. replay
    cols = variants(alphas)
    rows: list[dict[str, Any]] = []
    for source, group in groups.items():
        for ratio in RATIOS:
            cells = {label: measure(group, ratio, pol, knobs) for label, pol, knobs in cols}
            rows.append({"source": source, "ratio": ratio, "accesses": cells["lru"]["accesses"], "cells": cells})
    # 3. report
    console = Console(width=max(Console().width, 180))
    main_cols = [label for label, _, _ in cols if label in POLICIES]
    table = Table(title="cache hit rate %: all calls [decode only]", title_justify="left")
    for col in ("trace", "ratio", "accesses", *main_cols, "mrs-lru"):
        table.add_column(col, justify="left" if col == "trace" else "right")
    for row in rows:
        c = row["cells"]
        table.add_row(
            row["source"], f"{row['ratio']:.2f}", str(row["accesses"]),
            *(f"{100 * c[label]['hit_rate']:.1f} [{100 * c[label]['decode_hit_rate']:.1f}]" for label in main_cols),
            f"{100 * (c['mrs']['hit_rate'] - c['lru']['hit_rate']):+.1f}",
        )  # fmt: skip
    console.print(table)
    sweep = [label for label, _, _ in cols if label not in POLICIES]
    if sweep:
        table = Table(title="MRS alpha sweep: hit rate % minus LRU's (all calls)", title_justify="left")
        for col in ("trace", "ratio", "lru", "mrs", *sweep):
            table.add_column(col, justify="left" if col == "trace" else "right")
        for row in rows:
            c = row["cells"]
            lru = c["lru"]["hit_rate"]
            table.add_row(row["source"], f"{row['ratio']:.2f}", f"{100 * lru:.1f}",
                          *(f"{100 * (c[label]['hit_rate'] - lru):+.1f}" for label in ["mrs", *sweep]))  # fmt: skip
        console.print(table)
    if missing:
        console.print(f"synthetic traces skipped: {missing}", highlight=False)
    console.print(f"recorded {args.prompts} bundled traces in {record_s:.1f} s", highlight=False)
    payload = {
        "benchmark": "cache_hits", "prompts": args.prompts, "tokens": args.tokens, "steps": args.steps,
        "prompt_len": args.prompt_len, "synthetic_missing": missing,
        "results": [{"trace": r["source"], "ratio": r["ratio"], "accesses": r["accesses"],
                     **{label: {"hit_rate": round(v["hit_rate"], 4), "decode_hit_rate": round(v["decode_hit_rate"], 4)}
                        for label, v in r["cells"].items()}} for r in rows],
    }  # fmt: skip
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
