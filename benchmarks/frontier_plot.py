"""Issue 29's quality-speed frontier: decode speed under a memory limit against KL to the full model, one panel per
limit, from the two benchmarks that measure each side.

- Speed: `benchmarks/bigger_than_memory.py --json FILE` (a large random Qwen3-MoE checkpoint, each engine alone in a
  cgroup at the limit, page cache dropped before each run): median decode tok/s per candidate and limit.
- Quality: `benchmarks/quality_frontier.py` (the bundled trained model, KL to its fp32 self on held-out text), read
  from its per-point results under `.bench/quality_frontier/points/`.
A candidate is placed when both sides measured it: llama.cpp's files (bf16, Q8_0, Q4_K_M, Q2_K...) by their type,
moetier's configurations by the matching quality point (`bf16` -> moetier bf16 experts, `int4` -> int4 experts, with
bf16 dense weights unless the candidate names `+dint8` / `+dint4`; `+wide`: the wide step's point; `gguf-TYPE`:
moetier on that file). Candidates
without a quality point of their own (prefetch, cache-policy variants: the same output as their precision) take their
precision's KL. Prints the table it plots.

    python benchmarks/frontier_plot.py --speed .bench/btm.json [more.json ...] --out docs/img/frontier.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

QUALITY = {"bf16": "moetier-full", "int4": "moetier-int4", "int8": "moetier-int8"}  # moetier precision -> point


def kl_of(name: str, points: Path, tokens: int, window: int) -> float | None:
    """KL mean of a candidate (llamacpp-TYPE or moetier-PRECISION[+levers]), None when not measured."""
    if name.startswith("llamacpp-"):
        stem = name
    else:
        base, *levers = name.removeprefix("moetier-").split("+")
        if base.startswith("gguf-"):  # moetier on llama.cpp's own file: that point of the quality side
            f = points / f"moetier-{base}-{tokens}-w{window}.json"
            return float(json.loads(f.read_text())["kl_mean"]) if f.exists() else None
        if base not in QUALITY:
            return None
        dense = [lv for lv in levers if lv in ("dint8", "dint4")]  # quantised dense weights: their own quality point
        stem = QUALITY[base] + (f"-{dense[0]}" if dense else "") + ("-wide" if "wide" in levers else "")
    f = points / f"{stem}-{tokens}-w{window}.json"
    return float(json.loads(f.read_text())["kl_mean"]) if f.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed", type=Path, nargs="+", default=[Path(".bench/btm.json")],
                    help="bigger_than_memory.py --json files; a candidate measured in several takes the median of all")
    ap.add_argument("--points", type=Path, default=Path(".bench/quality_frontier/points"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    files = [json.loads(f.read_text()) for f in a.speed]
    data = files[0]
    decodes: dict[str, list[float]] = {}
    for d in files:
        if d["limits"] != data["limits"]:
            raise SystemExit("the speed files were measured at other limits")
        for key, runs in d["runs"].items():
            decodes.setdefault(key, []).extend(r["decode"] for r in runs if "error" not in r)
    rows: dict[str, list[tuple[str, float, float]]] = {}
    for key, ok in decodes.items():
        name, share = key.rsplit("@", 1)
        kl = kl_of(name, a.points, a.tokens, a.window)
        if ok and kl is not None:
            rows.setdefault(share, []).append((name, statistics.median(ok), kl))
    print("| limit | candidate | decode tok/s | KL to fp32 (bundled model) |")
    print("|---|---|---|---|")
    for share, pts in rows.items():
        for name, tok_s, kl in sorted(pts, key=lambda p: -p[1]):
            print(f"| {float(share):.0%} | {name} | {tok_s:.2f} | {kl:.6f} |")
    if a.out is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    limits: dict[str, Any] = data.get("limits", {})
    for ax, (share, pts) in zip(axes[0], sorted(rows.items(), key=lambda kv: -float(kv[0])), strict=True):
        for n, (name, tok_s, kl) in enumerate(sorted(pts, key=lambda p: (p[2], p[1]))):
            llama = name.startswith("llamacpp-")
            ax.scatter(kl, tok_s, marker="s" if llama else "o", color="tab:gray" if llama else "tab:blue")
            ax.annotate(name.removeprefix("llamacpp-").removeprefix("moetier-") + (" (llama.cpp)" if llama else ""),
                        (kl, tok_s), textcoords="offset points", xytext=(5, 3 if n % 2 else -9),
                        fontsize=7)  # fmt: skip
        gib = limits.get(share, 0) / 2**30
        ax.set(xscale="log", yscale="log", xlabel="KL to the fp32 model (bundled model, nats)",
               ylabel="decode tok/s (large random checkpoint)",
               title=f"limit {float(share):.0%} of the model + 512 MiB ({gib:.2f} GiB)")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("up and to the left is better: squares llama.cpp (memory-mapped), circles moetier (--memory)")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
