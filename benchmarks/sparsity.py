"""Intra-expert activation sparsity: quality on the bundled model, speed on the benchmark model.

All in one process:
0. the paper's accounting (no model run, deterministic): its Table 2 total targets turned into routed
   sparsity by policies.sparsity.routed_target (Qwen3.5-35B-A3B: 8 routed experts of 512 neurons, a
   shared expert of 512) beside the routed sparsity the paper reports, and the GPU tipping point
   (tokens per expert) that policies.sparsity.roofline_profile derives for that expert shape on each
   shipped GPU profile at those routed sparsities (a model of the paper's kernel, not a measurement);
1. quality (models/tiny-shakespeare-moe, data/shakespeare_heldout.txt): thresholds calibrated on
   the first CALIB tokens, then on the next --max-tokens tokens (windows of 256, the training
   context): achieved sparsity and perplexity for targets 0, 0.5, 0.7, 0.8, 0.85, 0.9 (and 0.95),
   and the cutoff (largest target whose perplexity is within 5% of dense, interpolated). Scored with
   the masked dense path above the tipping point (SparsityConfig.dense "masked"), so every window is
   the sparse model, as the paper's accuracy columns are; the bundled model has no shared experts, so
   its total and routed sparsity are the same;
2. beyond the paper: (a) masks in blocks of 4-32 neurons at 0.85: achieved sparsity, perplexity,
   and MoE-layer time at batch 1; (b) mask reuse: how well an expert's previous active set (and
   the union of its last 4) predicts its next one at decode (recall and the share of neurons it
   would compute), which decides whether the gate projection could be skipped;
3. speed (the Qwen3-MoE-shaped random benchmark model, bf16, every expert resident): one MoE
   layer's time dense vs sparse at 0.85 for batch sizes 1, 4, 16, 64 (candidates interleaved,
   median of rounds), also against the gather kernel at threshold 0 (every neuron: what the
   kernel gains over torch's matmuls by itself), the tipping point the engine measured, and
   end-to-end decode tokens/s;
4. the same with int4 experts: static int4 (torch's packed kernel) vs int4 + 0.85 sparsity
   (the `--for-sparsity` rows tier, our kernel), and bf16 + 0.85 in the decode comparison.

    python benchmarks/sparsity.py [--max-tokens 16384] [--skip-quality] [--skip-speed] [--skip-quant] [--repeats 5]

(the speed parts time the engine's default switch: the original dense expert above the tipping point)

Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch

import moetier
from moetier.config import EngineConfig, RuntimeConfig, SparsityConfig
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.qtier import source_fingerprint
from moetier.policies.costmodel import load_profile, profile_names
from moetier.policies.sparsity import roofline_profile, routed_target, tipping_point
from moetier.runtime.calibrate import calibrate, model_identity
from moetier.runtime.observers import Tap

MODEL = Path("models/tiny-shakespeare-moe")
TEXT = Path("data/shakespeare_heldout.txt")
WINDOW, CALIB = 256, 8192
TARGETS = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95)
# the paper's Table 2 (Qwen3.5-35B-A3B): target total, achieved total, routed sparsity (fractions)
PAPER_TABLE2 = ((0.60, 0.57, 0.64), (0.70, 0.72, 0.81), (0.80, 0.79, 0.89), (0.85, 0.84, 0.94), (0.87, 0.87, 0.98))
PAPER_SHAPE = {"hidden": 2048, "inter": 512, "k": 8, "shared": 512}  # Qwen3.5-35B-A3B (paper Table 1)


def paper_accounting() -> dict[str, Any]:
    """Routed sparsity for each of the paper's achieved total sparsities, and roofline tipping points."""
    h, i, k, sh = (PAPER_SHAPE[x] for x in ("hidden", "inter", "k", "shared"))
    rows = [{"total": tot, "paper_routed": rt, "ours_routed": round(routed_target(tot, "total", k * i, sh), 4)}
            for _, tot, rt in PAPER_TABLE2]  # fmt: skip
    tips: dict[str, dict[str, int]] = {}
    for name in profile_names():
        gpu = load_profile(name).gpu
        if gpu is not None:
            tips[name] = {f"{rt:g}": tipping_point(roofline_profile(gpu, h, i, 2, rt)) for _, _, rt in PAPER_TABLE2}
    return {"shape": PAPER_SHAPE, "table2": rows, "roofline_tipping_tokens_per_expert": tips}


def make_table(model: Path, ids: list[int], out: Path, window: int) -> Path:
    eng = moetier.load(model, EngineConfig(runtime=RuntimeConfig(dtype="bf16")))
    ident = model_identity(eng.info, source_fingerprint(CheckpointIndex(model))["fingerprint"])
    table = calibrate(eng, ids, window, ident, "silu", {"text": "benchmark calibration split"})
    eng.close()
    return table.save(out)


def engine(model: Path, target: float, table: Path | None, **sc: Any) -> Any:
    """A bf16 engine; `sc` goes to SparsityConfig (dense="masked" for quality: the sparse model everywhere)."""
    scfg = SparsityConfig(target=target, table=str(table) if table else None, **sc)
    return moetier.load(model, EngineConfig(sparsity=scfg, runtime=RuntimeConfig(dtype="bf16")))


def quality(ids: list[int], max_tokens: int) -> dict[str, Any]:
    table = make_table(MODEL, ids[:CALIB], Path(".bench/sparsity-tiny.json"), WINDOW)
    evalset = ids[CALIB : CALIB + max_tokens]
    rows: dict[str, Any] = {}
    for t in TARGETS:
        eng = engine(MODEL, t, table, dense="masked")
        r = eng.perplexity(evalset, window=WINDOW)
        sp = r.stats.get("sparsity", {"achieved": 0.0, "layers": {}})
        rows[f"{t:g}"] = {"ppl": r.ppl, "achieved": sp["achieved"],
                          "per_layer": {k: v["achieved"] for k, v in sp["layers"].items()}}  # fmt: skip
        eng.close()
    dense = rows["0"]["ppl"]
    cutoff = 0.0
    pts = [(t, rows[f"{t:g}"]["ppl"]) for t in TARGETS]
    for (t0, p0), (t1, p1) in itertools.pairwise(pts):
        if p1 > 1.05 * dense:
            cutoff = t0 + (t1 - t0) * (1.05 * dense - p0) / (p1 - p0) if p1 != p0 else t0
            break
        cutoff = t1
    blocks: dict[str, Any] = {}
    for b in (1, 4, 8, 16, 32):
        eng = engine(MODEL, 0.85, table, block=b, dense="masked")
        r = eng.perplexity(evalset, window=WINDOW)
        blocks[str(b)] = {"ppl": r.ppl, "achieved": r.stats["sparsity"]["achieved"]}
        eng.close()
    reuse = mask_reuse(table, ids[CALIB : CALIB + 1024])
    return {"targets": rows, "dense_ppl": dense, "cutoff_5pct": cutoff, "blocks_at_0.85": blocks,
            "mask_reuse": reuse, "eval_tokens": len(evalset), "calib_tokens": CALIB}  # fmt: skip


def mask_reuse(table: Path, ids: list[int], target: float = 0.85) -> dict[str, float]:
    """Decode `ids` one token at a time; per (layer, expert) compare each active set with the expert's
    previous one and with the union of its last 4."""
    eng = engine(MODEL, target, table, tipping=0, dense="masked")  # masked dense: simple to observe
    hist: dict[tuple[int, int], list[torch.Tensor]] = {}
    stats = {"prev_recall": [], "prev_size": [], "union4_recall": [], "union4_size": []}
    for block in eng.loaded.blocks:
        sp = block.pipeline.executor

        def hook(route: Any, sp: Any = sp, block: Any = block) -> None:
            if route.layer != block.layer:
                return
            layer, ids_, x = route.layer, route.ids, route.x
            for e in ids_[0].tolist():
                views = block.store.acquire(block_key(layer, e))
                try:
                    a = sp.act(torch.nn.functional.linear(x, views.w13[: sp.inter]))[0]
                finally:
                    block.store.release(block_key(layer, e))
                m = a.abs() >= sp.threshold
                past = hist.setdefault((layer, e), [])
                if past and m.any():
                    for name, ref in (("prev", past[-1]), ("union4", torch.stack(past[-4:]).any(0))):
                        stats[f"{name}_recall"].append(float((m & ref).sum() / m.sum()))
                        stats[f"{name}_size"].append(float(ref.float().mean()))
                past.append(m)
                del past[:-4]

        eng.observers.add(Tap(hook))
    eng.decoder.reset()
    with torch.inference_mode():
        for tok in ids:
            eng.step(torch.tensor([[tok]]))
    eng.close()
    return {k: statistics.mean(v) for k, v in stats.items() if v}


def block_key(layer: int, e: int) -> Any:
    from moetier.types import ExpertKey

    return ExpertKey(layer, e)


# --------------------------------------------------------------------------- speed


def layer_time(eng: Any, x: torch.Tensor, layer: int) -> float:
    block = eng.loaded.blocks[layer]
    with torch.inference_mode():  # the block's matmuls pick their kernel per call (kernels/matmul.py)
        block(x[None])
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            block(x[None])
            n += 1
        return (time.perf_counter() - t0) / n


def speed(repeats: int) -> dict[str, Any]:
    from benchmarks._models import qwen3_bench_model

    bench = qwen3_bench_model()
    gen = torch.Generator().manual_seed(1)
    calib_ids = torch.randint(100, 30000, (2048,), generator=gen).tolist()
    table = make_table(bench, calib_ids, Path(".bench/sparsity-bench.json"), 256)
    engines = {"dense": engine(bench, 0.0, None), "sparse": engine(bench, 0.85, table)}
    for b in (4, 16):
        engines[f"sparse_block{b}"] = engine(bench, 0.85, table, block=b)
    # the gather kernel with threshold 0 (every neuron computed): separates what sparsity saves from
    # what the kernel itself does better than torch's matmuls
    engines["kernel_dense"] = engine(bench, 0.85, table)
    for s in engines["kernel_dense"].sparsity.layers.values():
        s.threshold = 0.0
    for eng in engines.values():
        eng.store.preload()
    tipping = engines["sparse"].sparsity.tipping
    profile = engines["sparse"].sparsity.profile
    xs = {bs: torch.randn(bs, 1024, generator=gen).to(torch.bfloat16) for bs in (1, 4, 16, 64)}
    times: dict[str, dict[int, list[float]]] = {n: {bs: [] for bs in xs} for n in engines}
    for _ in range(repeats):
        for bs, x in xs.items():
            for name, eng in engines.items():
                if name.startswith("sparse_block") and bs != 1:
                    continue
                times[name][bs].append(sum(layer_time(eng, x, layer) for layer in (0, 3, 6)) / 3)
    layer = {n: {bs: statistics.median(v) for bs, v in d.items() if v} for n, d in times.items()}
    prompt = list(range(100, 116))
    for eng in engines.values():
        eng.generate(prompt, 8, stop_at_eos=False)
    rates: dict[str, list[float]] = {"dense": [], "sparse": []}
    for _ in range(repeats):
        for name in rates:
            rates[name].append(engines[name].generate(prompt, 64, stop_at_eos=False).decode_tok_s)
    achieved = engines["sparse"].stats()["sparsity"]["achieved"]
    for eng in engines.values():
        eng.close()
    decode = {n: statistics.median(v) for n, v in rates.items()}
    return {
        "layer_s": layer, "speedup": {bs: layer["dense"][bs] / layer["sparse"][bs] for bs in xs},
        "block_speedup_b1": {n: layer["dense"][1] / layer[n][1] for n in layer if n.startswith("sparse")},
        "sparse_over_kernel_dense": {bs: layer["kernel_dense"][bs] / layer["sparse"][bs] for bs in xs},
        "tipping_tokens": tipping, "profile": profile, "decode_tok_s": decode,
        "decode_speedup": decode["sparse"] / decode["dense"], "decode_achieved": achieved,
        "threads": torch.get_num_threads(),
    }  # fmt: skip


def speed_quant(repeats: int, precision: str = "int4") -> dict[str, Any]:
    """The benchmark model with int4 experts: static int4 dense (torch's packed int4 kernel) vs int4
    sparse at 0.85 (the rows tier, our kernel), one MoE layer per batch size, and decode (with bf16
    sparse at 0.85 as a third decode candidate)."""
    from benchmarks._models import qwen3_bench_model
    from moetier.config import PrecisionConfig
    from moetier.formats.quantize import quantize_model

    bench = qwen3_bench_model()
    quant = Path(".bench/quant-bench")
    quantize_model(bench, [precision], out=quant, method="rtn")  # the fit does not change speed
    quantize_model(bench, [precision], out=quant, method="rtn", down_rows=True)
    gen = torch.Generator().manual_seed(1)
    calib_ids = torch.randint(100, 30000, (2048,), generator=gen).tolist()
    table = Path(".bench/sparsity-bench.json")
    if not table.exists():
        make_table(bench, calib_ids, table, 256)
    pcfg = PrecisionConfig(mode=precision, quant_dir=str(quant))
    engines = {
        "dense": moetier.load(bench, EngineConfig(precision=pcfg, runtime=RuntimeConfig(dtype="bf16"))),
        "sparse": moetier.load(bench, EngineConfig(precision=pcfg, runtime=RuntimeConfig(dtype="bf16"),
                                                   sparsity=SparsityConfig(target=0.85, table=str(table)))),
    }  # fmt: skip
    # for decode only: bf16 experts with sparsity, the best combination on this CPU
    engines["bf16_sparse"] = engine(bench, 0.85, table)
    for eng in engines.values():
        eng.store.preload()
    xs = {bs: torch.randn(bs, 1024, generator=gen).to(torch.bfloat16) for bs in (1, 4, 16, 64)}
    times: dict[str, dict[int, list[float]]] = {n: {bs: [] for bs in xs} for n in ("dense", "sparse")}
    for _ in range(repeats):
        for bs, x in xs.items():
            for name in times:
                times[name][bs].append(sum(layer_time(engines[name], x, layer) for layer in (0, 3, 6)) / 3)
    layer = {n: {bs: statistics.median(v) for bs, v in d.items()} for n, d in times.items()}
    prompt = list(range(100, 116))
    for eng in engines.values():
        eng.generate(prompt, 8, stop_at_eos=False)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            rates[name].append(eng.generate(prompt, 64, stop_at_eos=False).decode_tok_s)
    tipping = engines["sparse"].sparsity.tipping
    for eng in engines.values():
        eng.close()
    decode = {n: statistics.median(v) for n, v in rates.items()}
    return {"precision": precision, "layer_s": layer, "speedup": {bs: layer["dense"][bs] / layer["sparse"][bs]
            for bs in xs}, "decode_tok_s": decode, "decode_speedup": decode["sparse"] / decode["dense"],
            "tipping_tokens": tipping}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quant", action="store_true", help="skip int4 dense vs int4 sparse")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    pa = out["paper_accounting"] = paper_accounting()
    print("paper Table 2 (Qwen3.5-35B-A3B): total sparsity -> routed sparsity, paper vs ours")
    for r in pa["table2"]:
        print(f"  total {r['total']:.2f}: paper {r['paper_routed']:.2f}, ours {r['ours_routed']:.3f}")
    print("roofline tipping point (tokens per expert) at the paper's routed sparsities "
          + ", ".join(f"{rt:g}" for _, _, rt in PAPER_TABLE2) + ":")  # fmt: skip
    for name, tips in pa["roofline_tipping_tokens_per_expert"].items():
        print(f"  {name}: " + ", ".join(str(t) for t in tips.values()))
    if not args.skip_quality:
        tok = moetier.load(MODEL).tokenizer
        ids = list(tok.encode(TEXT.read_text(), add_special_tokens=False))
        q = out["quality"] = quality(ids, args.max_tokens)
        print(f"bundled model: calibrated on {q['calib_tokens']} tokens, scored {q['eval_tokens']} (window {WINDOW})")
        print(f"{'target':>7} {'achieved':>9} {'ppl':>9} {'vs dense':>9}")
        for t, r in q["targets"].items():
            print(f"{t:>7} {r['achieved']:>9.3f} {r['ppl']:>9.3f} {r['ppl'] / q['dense_ppl']:>9.3f}")
        print(f"cutoff (ppl +5%): {q['cutoff_5pct']:.3f}")
        print("blocks at 0.85: " + ", ".join(f"{b}: ppl {r['ppl']:.3f} achieved {r['achieved']:.3f}"
                                              for b, r in q["blocks_at_0.85"].items()))  # fmt: skip
        print("mask reuse: " + ", ".join(f"{k} {v:.3f}" for k, v in q["mask_reuse"].items()))
    if not args.skip_speed:
        s = out["speed"] = speed(args.repeats)
        print(f"benchmark model, {s['threads']} threads; tipping point {s['tipping_tokens']} tokens per expert")
        print(f"{'batch':>5} {'dense ms':>9} {'sparse ms':>9} {'speedup':>8} {'kernel@0 ms':>12} {'vs kernel@0':>12}")
        for bs, sp in s["speedup"].items():
            dense_ms, sparse_ms = 1e3 * s["layer_s"]["dense"][bs], 1e3 * s["layer_s"]["sparse"][bs]
            k0 = 1e3 * s["layer_s"]["kernel_dense"][bs]
            print(f"{bs:>5} {dense_ms:>9.3f} {sparse_ms:>9.3f} {sp:>8.2f} {k0:>12.3f} "
                  f"{s['sparse_over_kernel_dense'][bs]:>12.2f}")  # fmt: skip
        print("blocks, batch 1 speedup: " + ", ".join(f"{n}: {v:.2f}" for n, v in s["block_speedup_b1"].items()))
        d = s["decode_tok_s"]
        print(f"decode: dense {d['dense']:.1f} tok/s, sparse {d['sparse']:.1f} tok/s ({s['decode_speedup']:.2f}x, "
              f"achieved {s['decode_achieved']:.3f})")  # fmt: skip
    if not args.skip_quant:
        sq = out["speed_int4"] = speed_quant(args.repeats)
        print(f"benchmark model, int4 experts; tipping point {sq['tipping_tokens']} tokens per expert")
        print(f"{'batch':>5} {'int4 ms':>9} {'int4+0.85':>10} {'speedup':>8}")
        for bs, sp in sq["speedup"].items():
            dense_ms, sparse_ms = 1e3 * sq["layer_s"]["dense"][bs], 1e3 * sq["layer_s"]["sparse"][bs]
            print(f"{bs:>5} {dense_ms:>9.3f} {sparse_ms:>10.3f} {sp:>8.2f}")
        d = sq["decode_tok_s"]
        print(f"decode: int4 {d['dense']:.1f} tok/s, int4 + sparsity {d['sparse']:.1f} tok/s "
              f"({sq['decode_speedup']:.2f}x), bf16 + sparsity {d['bf16_sparse']:.1f} tok/s")  # fmt: skip
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
