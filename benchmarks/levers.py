"""Which lever costs the least quality when expert memory is short (issue 29, item 4): fewer active experts per
token (a weight threshold, a top-k cap), experts pruned offline by REAP saliency, and expert precision (static
int8 / int4, dynamic hi / lo under an expert budget), on the bundled model, each as KL to the fp32 reference and
top-1 agreement, beside the expert bytes it computes per token and the expert bytes it holds.

Text: the first half of data/shakespeare_heldout.txt is scored (--tokens of it, in the model's 256-token training
windows, as `moetier eval --kl-ref full` does); the pruning saliency is measured on its second half. Expert bytes
per token: per MoE layer call, the slot bytes of each (token, expert) pair computed, at the precision its expert
held when the call routed (a route observer), over the tokens; resident expert bytes: the experts a run can read
(pruned ones never are) at their precision, or the dynamic store's budget. Not timings: runs on a busy machine.
Prints a table, then one JSON line.

    python benchmarks/levers.py --quant-dir DIR [--tokens 4096]

DIR holds the int8 and int4 tiers: `moetier quantize models/tiny-shakespeare-moe --precisions int8,int4 --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import moetier
from moetier.config import Budgets, EngineConfig, PrecisionConfig, RoutingConfig
from moetier.runtime.observers import Route, Tap
from moetier.runtime.prune import model_shape, prune_table, saliency
from moetier.runtime.quality import collect, compare, reference_config
from moetier.runtime.route_override import PruneFile
from moetier.store.dynamic import DynamicStore
from moetier.types import ExpertKey

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
HELDOUT = ROOT / "data" / "shakespeare_heldout.txt"
WINDOW = 256  # the model's training window (MODEL/moetier.json)


class BytesTap:
    """Expert bytes computed per token: each kept (token, expert) pair's slot bytes at its expert's precision."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.bytes = 0
        self.calls_tokens = 0
        self.layers: set[int] = set()

    def __call__(self, route: Route) -> None:
        ids = route.ids.reshape(-1).tolist()
        self.layers.add(route.layer)
        self.calls_tokens += int(route.ids.shape[0])
        s = self.store
        if isinstance(s, DynamicStore):
            for e in ids:
                if e >= 0:
                    v = s.index.get(ExpertKey(route.layer, e))
                    prec = v.precision if v is not None else s.lo
                    self.bytes += s.pools[prec].pool.slot_bytes
        else:
            self.bytes += sum(1 for e in ids if e >= 0) * s.slot_bytes

    def per_token(self) -> float:
        """Bytes per token over all MoE layers."""
        tokens = self.calls_tokens / max(len(self.layers), 1)
        return self.bytes / tokens if tokens else 0.0


def run(name: str, cfg: EngineConfig, ids: list[int], ref: Any, resident: int | None) -> dict[str, Any]:
    with moetier.load(MODEL, cfg) as e:
        tap = BytesTap(e.store)
        e.observers.add(Tap(tap))
        q = compare(e, ids, WINDOW, ref, "fp32 reference").summary
        stats = e.stats()
        if resident is None:  # a static precision: every expert at its slot size
            resident = 128 * int(e.store.slot_bytes)
    return {"name": name, "kl_mean": q.kl_mean, "kl_stderr": q.kl_stderr, "top1_pct": q.top1_pct, "ppl": q.ppl,
            "bytes_per_token": tap.per_token(), "resident_bytes": resident,
            "experts_per_token": stats.get("routing", {}).get("experts_per_token")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--quant-dir", required=True)
    ap.add_argument("--only", default="", help="comma-separated groups: base,reduce,prune,static,dynamic")
    args = ap.parse_args()
    groups = set(args.only.split(",")) if args.only else {"base", "reduce", "prune", "static", "dynamic"}
    text = HELDOUT.read_text()
    half = len(text) // 2
    base = EngineConfig()
    with moetier.load(MODEL, reference_config(base)) as r:
        ids = r.encode(text[:half])[: args.tokens]
        ref = collect(r, ids, WINDOW, {"model": str(MODEL)})
    rows: list[dict[str, Any]] = []
    full = 128 * 196608  # 4 MoE layers x 32 experts x 192 KiB (bf16)
    if "base" in groups:
        rows.append(run("bf16, every expert (baseline)", base, ids, ref, full))
    if "reduce" in groups:
        for k in (3, 2, 1):
            rows.append(run(f"top-k cap {k}", replace(base, routing=RoutingConfig(max_k=k)), ids, ref, full))
        for t in (0.05, 0.1, 0.15, 0.2, 0.3):
            rows.append(run(f"threshold {t}", replace(base, routing=RoutingConfig(threshold=t)), ids, ref, full))
        rows.append(run("threshold 0.2, no renorm", replace(base, routing=RoutingConfig(threshold=0.2,
                                                                                        renormalize=False)),
                        ids, ref, full))  # fmt: skip
    if "prune" in groups:
        with moetier.load(MODEL, base) as e:
            cal = e.encode(text[half:])[: args.calib_tokens]
            scores = saliency(e, cal, WINDOW)
            shape = model_shape(e.info)
        tmp = Path(tempfile.mkdtemp(prefix="moetier-levers-"))
        for f in (0.125, 0.25, 0.375, 0.5, 0.625):
            pruned = prune_table(scores, f, 4)
            path = PruneFile.write(tmp / f"prune-{f}.json", pruned, {"model": shape, "method": "reap", "fraction": f})
            kept = 128 - sum(len(v) for v in pruned.values())
            rows.append(run(f"REAP prune {f:g}", replace(base, routing=RoutingConfig(prune=str(path))), ids, ref,
                            kept * 196608))  # fmt: skip
    q = args.quant_dir
    if "static" in groups:
        for p in ("int8", "int4"):
            rows.append(run(f"static {p}", replace(base, precision=PrecisionConfig(mode=p, quant_dir=q)), ids, ref,
                            None))  # fmt: skip
    if "dynamic" in groups:
        for budget_mib in (9, 12, 16, 20):
            b = budget_mib * 1024 * 1024
            cfg = replace(base, budgets=Budgets(host_expert_bytes=b),
                          precision=PrecisionConfig(mode="dynamic", hi="full", lo="int4", quant_dir=q, sync=True))
            rows.append(run(f"dynamic full/int4, {budget_mib} MiB", cfg, ids, ref, b))
    print(f"{'lever':36} {'KL nats/tok':>14} {'top-1 %':>8} {'ppl':>8} {'KiB/token':>10} {'resident MiB':>12}")
    for r in rows:
        print(f"{r['name']:36} {r['kl_mean']:9.4f}±{r['kl_stderr']:.4f} {r['top1_pct']:8.2f} {r['ppl']:8.3f} "
              f"{r['bytes_per_token'] / 1024:10.1f} {r['resident_bytes'] / 2**20:12.2f}")
    print(json.dumps({"tokens": len(ids), "window": WINDOW, "rows": rows}))


if __name__ == "__main__":
    main()
