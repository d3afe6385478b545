"""Our quantized expert tiers against ggml's block formats at equal bytes (issue 28, item 3): quality, quantize
time, dynamic precision's pairs and decode speed.

Candidates (routed experts only; attention, router, embeddings and head stay as the checkpoint has them), every one a
`moetier quantize` tier the engine loads with `--precision NAME`:
- ours: int8 (per row), int4 and int2 at several group sizes, fitted by `--methods` (search / hqq / rtn);
- ggml's block types: q6_k, q5_k, q4_k, iq4_xs, q3_k, q2_k, quantised by ggml's own quantiser (llama-quantize's
  code path, no importance matrix). A matrix whose rows are not whole 256-value super-blocks takes llama-quantize's
  fallback type (Q6_K -> Q8_0, Q5_K -> Q5_1, Q4_K -> Q5_0, IQ4_XS / Q3_K / Q2_K -> IQ4_NL), as a GGUF file of the
  model would; the table lists the types.
1. Quality, fp32 (`--dtype fp32`: the formats' values, not a kernel's arithmetic) and bf16 (the engine as it runs:
   our native kernels, ggml's dot products), every expert resident, scored against the checkpoint in fp32
   (runtime/quality.py `reference_config`) over `--tokens` held-out tokens in windows of `--window`: KL mean with its
   standard error, top-1 agreement, perplexity; stored bits per expert weight (the tier's bytes over the experts'
   weights: scales, zeros and super-block metadata included); the tier writer's wall time.
2. Dynamic precision (bf16, synchronous switches, a 512-token warmup) at equal expert budgets: (int4, int2) against
   (q4_k, q2_k) and (iq4_xs, q2_k), at 1.1x and 1.25x the all-resident budget of the larger low tier.
3. `--speed`: decode tok/s on the Qwen3-MoE-shaped benchmark model (benchmarks/_models.py; H = 1024, I = 256, so
   every matrix is whole K-quant super-blocks), every expert resident, `--repeats` interleaved rounds, medians.

    python benchmarks/ggml_tiers.py [--model models/tiny-shakespeare-moe] [--tokens 8192] [--window 256] [--speed]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch
from safetensors.torch import load_file

import moetier
from benchmarks._models import qwen3_bench_model
from moetier import Budgets, EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.formats.qtier import tier_summary
from moetier.formats.quantize import quantize_model
from moetier.kernels import ggml, native
from moetier.runtime.quality import collect, compare, reference_config
from moetier.store.store import ExpertStore

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "shakespeare_heldout.txt"
GGML = ("q6_k", "q5_k", "q4_k", "iq4_xs", "q3_k", "q2_k")
OURS = (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("int2", 32), ("int2", 64), ("int2", 128))
BF16_ROWS = (("int8", None), ("int4", None), ("int2", None), *((p, None) for p in GGML))
PAIRS = (("int4", "int2"), ("q4_k", "q2_k"), ("iq4_xs", "q2_k"))
SPEED = ("full", "int8", "q6_k", "q4_k", "int4", "iq4_xs", "q3_k", "q2_k", "int2")
WARMUP = 512
FACTORS = (1.1, 1.25)  # dynamic budgets over the larger all-low budget; 1.5x held every bundled expert at hi
_EXPERT = (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def is_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(_EXPERT)


def our_tier(model: Path, quant: Path, precision: str, group: int | None, method: str) -> dict[str, Any]:
    """Write (or reuse) a tier; its stored bits per expert weight from the tier's files, and the writer's wall time
    (None when the tier was already there: give a fresh --work to time every tier)."""
    t0 = time.perf_counter()
    groups = {precision: group} if group else None
    events: list[Any] = []
    (path,) = quantize_model(model, [precision], out=quant, group_sizes=groups, method=method, progress=events.append)
    secs = None if all(e.status == "skipped" for e in events) else round(time.perf_counter() - t0, 2)
    data = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    sd = load_file(model / "model.safetensors")
    weights = sum(w.numel() for n, w in sd.items() if is_expert(n))
    return {"bits_per_weight": 8 * data / weights, "path": str(path), "quantize_s": secs}


def score(model: Path, cfg: EngineConfig, ids: list[int], window: int, ref: Any, name: str) -> dict[str, Any]:
    with moetier.load(model, cfg) as engine:
        engine.store.preload()
        q = compare(engine, ids, window, ref, name).summary
    return {**q.as_dict(), "ppl": q.ppl}


def engine_cfg(precision: str, quant: Path, rt: RuntimeConfig, group: int | None = None, budget: int | None = None,
               **pc: Any) -> EngineConfig:  # fmt: skip
    pcfg = PrecisionConfig(mode=precision, quant_dir=str(quant), groups=((precision, group),) if group else (), **pc)
    return EngineConfig(precision=pcfg, runtime=rt, budgets=Budgets(host_expert_bytes=budget))


def quality(args: argparse.Namespace, ids: list[int], ref: Any, dtype: str) -> dict[str, dict[str, Any]]:
    """Section 1 at `dtype`: every candidate's tier written (or reused) and scored."""
    rt = RuntimeConfig(device="cpu", dtype=dtype)
    rows: dict[str, dict[str, Any]] = {}
    cands: list[tuple[str, str, int | None, str]] = []  # (name, precision, group, method)
    if dtype == "fp32":
        cands += [(f"moetier {p}" + (f" g{g}" if g else "") + f" {m}", p, g, m)
                  for m in args.methods.split(",") if m for p, g in OURS]  # fmt: skip
    else:
        cands += [(f"moetier {p} {args.methods.split(',')[0]}", p, g, args.methods.split(",")[0])
                  for p, g in BF16_ROWS if p not in GGML]  # fmt: skip
    cands += [(f"ggml {p}", p, None, "search") for p in GGML]
    for name, precision, group, method in cands:
        quant = args.work / (f"quant-{method}" if precision not in GGML else "quant-ggml")
        info = our_tier(args.model, quant, precision, group, method)
        if precision in GGML:
            info["types"] = sorted(set(tier_summary(Path(info["path"]))["types"].values()))  # as the tier records
        rows[name] = {**info, **score(args.model, engine_cfg(precision, quant, rt, group), ids, args.window, ref,
                                      name)}  # fmt: skip
        print(f"{dtype} {name}: {rows[name]['bits_per_weight']:.3f} bits, KL {rows[name]['kl_mean']:.5f}", flush=True)
    return rows


def print_quality(rows: dict[str, dict[str, Any]], dtype: str) -> None:
    print(f"\n{dtype}: {'candidate':22} {'bits/w':>7} {'KL mean':>9} {'± se':>8} {'top-1':>7} {'ppl':>8} "
          f"{'quant s':>8}  types")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["bits_per_weight"]):
        print(f"{'':6}{name:22} {r['bits_per_weight']:7.3f} {r['kl_mean']:9.5f} {r['kl_stderr']:8.5f} "
              f"{r['top1_pct']:6.2f}% {r['ppl']:8.3f} {r['quantize_s'] or float('nan'):8.2f}  "
              f"{','.join(r.get('types', []))}")


def all_resident_budget(model: Path, precision: str, quant: Path, rt: RuntimeConfig) -> int:
    with moetier.load(model, engine_cfg(precision, quant, rt)) as eng:
        assert isinstance(eng.store, ExpertStore)
        eng.store.preload()
        s = eng.stats()
        return int(s["tiers"]["host"]["pool_bytes"] + s["staging_bytes"])


def dynamic_pairs(args: argparse.Namespace, ids: list[int]) -> dict[str, dict[str, Any]]:
    """Section 2: each pair at the same expert budgets (bf16, sync switches, warmed up on the text's head)."""
    rt = RuntimeConfig(device="cpu", dtype="bf16")
    method = args.methods.split(",")[0]
    quant = {p: args.work / ("quant-ggml" if p in GGML else f"quant-{method}") for pair in PAIRS for p in pair}
    for p, q in quant.items():
        our_tier(args.model, q, p, None, method)
    base = max(all_resident_budget(args.model, lo, quant[lo], rt) for _, lo in PAIRS)
    warm = ids[:WARMUP]
    scored = ids[WARMUP:]
    ref_tail = collect_ref(args, scored)
    rows: dict[str, dict[str, Any]] = {}
    for factor in FACTORS:
        budget = int(base * factor)
        for hi, lo in PAIRS:
            name = f"dynamic {hi}/{lo} @{factor}x"
            assert quant[hi] == quant[lo]  # a pair's tiers share one folder (PrecisionConfig.quant_dir)
            cfg = engine_cfg("dynamic", quant[hi], rt, budget=budget, hi=hi, lo=lo, sync=True)
            with moetier.load(args.model, cfg) as eng:
                eng.warmup(warm)
                q = compare(eng, scored, args.window, ref_tail, name).summary
                s = eng.stats()
            rows[name] = {**q.as_dict(), "ppl": q.ppl, "budget": budget, "n_hot": s["switching"]["n_hot"],
                          "promotions": s["promotions"]}  # fmt: skip
            print(f"{name}: budget {budget}, {rows[name]['n_hot']} hot, KL {q.kl_mean:.5f}", flush=True)
    return rows


def collect_ref(args: argparse.Namespace, ids: list[int]) -> Any:
    rt = RuntimeConfig(device="cpu", dtype="fp32")
    with moetier.load(args.model, reference_config(EngineConfig(runtime=rt))) as ref_engine:
        return collect(ref_engine, ids, args.window, {"model": str(args.model), "text": str(TEXT)})


def speed(args: argparse.Namespace) -> dict[str, float]:
    """Section 3: decode tok/s of each precision on the benchmark model, every expert resident, interleaved."""
    bench = qwen3_bench_model()
    quant = args.work / "quant-bench"
    tiers = [p for p in SPEED if p != "full"]
    for p in tiers:  # rtn for ours: the fit does not change speed
        t0 = time.perf_counter()
        quantize_model(bench, [p], out=quant, method="rtn")
        print(f"benchmark-model {p} tier ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rt = RuntimeConfig(device="cpu", dtype="bf16")
    prompt = list(range(100, 116))
    engines = {}
    for p in SPEED:
        eng = moetier.load(bench, engine_cfg(p, quant, rt))
        assert isinstance(eng.store, ExpertStore)
        eng.store.preload()
        eng.generate(prompt, 8, stop_at_eos=False)
        engines[p] = eng
    runs: dict[str, list[float]] = {p: [] for p in engines}
    for _ in range(args.repeats):
        for p, eng in engines.items():
            runs[p].append(eng.generate(prompt, args.decode_tokens, stop_at_eos=False).decode_tok_s)
    for eng in engines.values():
        eng.close()
    out = {p: statistics.median(v) for p, v in runs.items()}
    print(f"\ndecode tok/s, benchmark model, every expert resident, median of {args.repeats} interleaved rounds:")
    for p, v in out.items():
        print(f"  {p:8} {v:8.2f}  ({v / out['int4']:.2f}x int4; rounds {', '.join(f'{x:.1f}' for x in runs[p])})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-shakespeare-moe")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--methods", default="search,rtn", help="our fits, the first also for the bf16 and dynamic rows")
    ap.add_argument("--work", type=Path, default=REPO / ".bench" / "ggml-tiers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-dynamic", action="store_true")
    ap.add_argument("--speed", action="store_true", help="also section 3 (the benchmark model's decode speed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not ggml.available():
        raise SystemExit(f"ggml is not available: {ggml.load_error()}")
    rt = RuntimeConfig(device="cpu", dtype="fp32")
    with moetier.load(args.model, reference_config(EngineConfig(runtime=rt))) as ref_engine:
        ids = ref_engine.encode(TEXT.read_text())[: args.tokens + 1]
    ref = collect_ref(args, ids)
    model_cpu, flags = native.cpu_info()
    result: dict[str, Any] = {"benchmark": "ggml_tiers", "model": str(args.model), "tokens": len(ids) - 1,
                              "window": args.window, "ref_ppl": math.exp(ref.nll_sum / ref.tokens), "cpu": model_cpu,
                              "isa": [f for f in flags if f.startswith(("avx", "amx"))]}  # fmt: skip
    print(f"cpu: {model_cpu}; flags: {' '.join(result['isa'])}; {len(ids) - 1} tokens of {TEXT.name}, windows of "
          f"{args.window}; reference: the checkpoint in fp32")
    if not args.skip_quality:
        for dtype in ("fp32", "bf16"):
            result[f"quality_{dtype}"] = quality(args, ids, ref, dtype)
            print_quality(result[f"quality_{dtype}"], dtype)
    if not args.skip_dynamic:
        result["dynamic"] = dynamic_pairs(args, ids)
        print(f"\ndynamic (bf16, warmup {WARMUP} tokens, scored on the rest): {'pair':30} {'budget':>9} {'hot':>4} "
              f"{'KL mean':>9} {'± se':>8} {'top-1':>7} {'ppl':>8}")
        for name, r in result["dynamic"].items():
            print(f"{'':8}{name:30} {r['budget']:9d} {r['n_hot']:4d} {r['kl_mean']:9.5f} {r['kl_stderr']:8.5f} "
                  f"{r['top1_pct']:6.2f}% {r['ppl']:8.3f}")
    if args.speed:
        result["speed"] = speed(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
