"""Dynamic expert precision (DynaExq): quality, memory and speed against static precisions.

All in one process, on the bundled model (models/tiny-shakespeare-moe) and its held-out text:
1. quantized tiers int8/int4/int2 (HQQ fit), written once under .bench/quant-tiny;
2. per precision: relative weight error (from the tier manifests) and expert output error on
   real layer inputs (the MoE blocks' inputs over 512 held-out tokens, each expert on the tokens
   routed to it);
3. perplexity (windows of 256 tokens, the model's training context) and expert bytes of static
   full / int8 / int4 / int2, and of dynamic (int4, int2) and (full, int4) at budgets between
   the static extremes, after a 512-token warmup; switches synchronous so runs reproduce;
   "recovered" is the share of the static lo -> static hi perplexity gap dynamic closes;
4. decode tokens/s: dynamic at 1.25x static-lo's budget vs static lo (bundled model), and
   static int4 vs bf16 with every expert resident on the Qwen3-MoE-shaped benchmark model;
5. shift: warm up on Python source (argparse.py of the standard library), then score
   Shakespeare; per window: promotions, the share of the "oracle" hot set (warmed up on
   Shakespeare) the adaptive engine holds at hi, and perplexity of adaptive dynamic vs
   dynamic frozen after the code warmup vs the oracle vs static hi and lo.

6. `--paper-only`: DynaExq as the paper writes it (issue 17), int4/int2 at 1.25x static int2's
   budget: static int4 / int2, Algorithm 1 (hysteresis 0) vs the default 0.1, the transient buffer
   (0 / 2 / 4 high slots), lookahead, and the host DRAM cache (0.25x / 0.5x / 1x of every expert's
   bytes at both precisions) with and without the prefetch of predicted promotions; deterministic
   figures only (perplexity, moves, bytes, hit rates); `--cache-only` runs just the cache rows.

    python benchmarks/precision.py [--max-tokens 16384] [--skip-speed] [--skip-shift]
    python benchmarks/precision.py --paper-only [--paper-tokens 8192] [--cache-only]

An "expert budget" of a static precision is what it needs with every expert resident: its
pool plus its staging buffer (stats: pool_bytes + staging_bytes). Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
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

import argparse as argparse_module

import torch

import moetier
from moetier.config import Budgets, EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.formats.qtier import tier_summary
from moetier.formats.quantize import quantize_model
from moetier.runtime.observers import Tap
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

MODEL = Path("models/tiny-shakespeare-moe")
TEXT = Path("data/shakespeare_heldout.txt")
QUANT = Path(".bench/quant-tiny")
WINDOW, WARMUP = 256, 512


def engine(model: Path, quant: Path, mode: str, budget: int | None = None, hi: str = "full", lo: str = "int4",
           native: bool = True, **pc: Any) -> Any:  # fmt: skip
    pcfg = PrecisionConfig(mode=mode, hi=hi, lo=lo, quant_dir=str(quant), **pc)
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), precision=pcfg,
                       runtime=RuntimeConfig(dtype="bf16", native_kernels=native))  # fmt: skip
    return moetier.load(model, cfg)


def static_budget(stats: dict[str, Any]) -> int:
    return int(stats["tiers"]["host"]["pool_bytes"] + stats["staging_bytes"])


def expert_output_errors(ids: list[int]) -> dict[str, float]:
    """sqrt(sum ||y_q - y||^2 / sum ||y||^2) over every (token, routed expert) of 512 tokens."""
    # the torch path: the native step runs no block's forward (no hook) and routes a prompt in chunks
    full = engine(MODEL, QUANT, "full", native=False)
    inputs: dict[int, torch.Tensor] = {}
    routes: dict[int, torch.Tensor] = {}
    for block in full.loaded.blocks:
        block.register_forward_pre_hook(
            lambda mod, args: inputs.__setitem__(mod.layer, args[0].reshape(-1, args[0].shape[-1]))
        )
    full.observers.add(Tap(lambda r: routes.__setitem__(r.layer, r.ids)))
    full.logits(torch.tensor([ids[:WARMUP]]))

    def outputs(eng: Any) -> dict[ExpertKey, torch.Tensor]:
        out = {}
        for block in eng.loaded.blocks:
            x, ids_l = inputs[block.layer], routes[block.layer]  # [T, H], [T, k]
            for e in ids_l.unique().tolist():
                tok = (ids_l == e).any(-1).nonzero().flatten()
                key = ExpertKey(block.layer, e)
                views = eng.store.acquire(key)
                out[key] = block.expert_fn(x[tok], views).float()
                eng.store.release(key)
        return out

    ref = outputs(full)
    full.close()
    errors = {}
    for p in ("int8", "int4", "int2"):
        eng = engine(MODEL, QUANT, p)
        got = outputs(eng)
        eng.close()
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
        den = sum(float(ref[k].pow(2).sum()) for k in ref)
        errors[p] = (num / den) ** 0.5
    return errors


def ppl_static(ids: list[int]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in ("full", "int8", "int4", "int2"):
        eng = engine(MODEL, QUANT, p)
        r = eng.perplexity(ids[WARMUP:], window=WINDOW)
        s = eng.stats()
        out[p] = {"ppl": r.ppl, "expert_bytes": s["precision"][p]["bytes"], "budget": static_budget(s)}
        eng.close()
    return out


def ppl_dynamic(ids: list[int], hi: str, lo: str, budget: int, **pc: Any) -> dict[str, Any]:
    eng = engine(MODEL, QUANT, "dynamic", budget, hi, lo, sync=True, **pc)
    eng.warmup(ids[:WARMUP])
    after_warmup = eng.stats()["promotions"]
    r = eng.perplexity(ids[WARMUP:], window=WINDOW)
    s = eng.stats()
    eng.close()
    mix = s["precision"]
    return {
        "hi": hi, "lo": lo, "budget": budget, "ppl": r.ppl, "n_hot": s["switching"]["n_hot"],
        "expert_bytes": sum(m["bytes"] for m in mix.values()), "mix": mix, "warmup_promotions": after_warmup,
        "promotions": s["promotions"], "demotions": s["demotions"],
    }  # fmt: skip


def which_experts(ids: list[int], budget: int, tokens: int = 8192) -> dict[str, float]:
    """(int4, int2) with the hot slots frozen on the hottest (the controller's warmup choice), a
    random set, or the coldest experts per layer: does the choice of hot experts matter?"""
    import numpy as np

    oracle = engine(MODEL, QUANT, "dynamic", budget, "int4", "int2", sync=True, period=10**9)
    oracle.warmup(ids[:WARMUP])
    ctrl = oracle.switching.controller
    scores = {layer: ctrl.hotness.scores(layer) for layer in ctrl.layers}
    oracle.close()
    choosers = {
        "hottest": lambda s: np.argsort(-s, kind="stable"),
        "random": lambda s: np.random.RandomState(0).permutation(len(s)),
        "coldest": lambda s: np.argsort(s, kind="stable"),
    }  # fmt: skip
    out = {}
    for name, choose in choosers.items():
        eng = engine(MODEL, QUANT, "dynamic", budget, "int4", "int2", sync=True, period=10**9)
        store = eng.store
        for layer in ctrl.layers:
            want = {ExpertKey(layer, int(e)) for e in choose(scores[layer])[: ctrl.n_hot[layer]]}
            have = {k for k in hot_set(eng) if k.layer == layer}
            for down, up in zip(sorted(have - want), sorted(want - have), strict=True):  # pairs keep slots free
                store.switch(down, store.lo_precision)
                store.switch(up, store.hi_precision)
        out[name] = eng.perplexity(ids[WARMUP : WARMUP + tokens], window=WINDOW).ppl
        eng.close()
    return out


def ready(eng: Any, prompt: list[int]) -> Any:
    """Every expert resident (static stores load on first touch; dynamic ones preload), kernels warm."""
    if isinstance(eng.store, ExpertStore):
        eng.store.preload()
    eng.generate(prompt, 8, stop_at_eos=False)
    return eng


def interleaved(engines: dict[str, Any], prompt: list[int], n: int, repeats: int) -> dict[str, float]:
    """Median decode tok/s per engine, rounds interleaved so machine noise hits every candidate alike."""
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            runs[name].append(eng.generate(prompt, n, stop_at_eos=False).decode_tok_s)
    return {name: statistics.median(v) for name, v in runs.items()}


def speed(ids: list[int], budgets: dict[str, int], repeats: int) -> dict[str, Any]:
    prompt = ids[:16]
    out: dict[str, Any] = {}
    for hi, lo in (("int4", "int2"), ("full", "int4")):
        dyn = engine(MODEL, QUANT, "dynamic", int(1.25 * budgets[lo]), hi, lo)
        dyn.warmup(ids[:WARMUP])
        engines = {"static_lo": ready(engine(MODEL, QUANT, lo), prompt), "dynamic": ready(dyn, prompt)}
        rates = interleaved(engines, prompt, 128, repeats)
        for eng in engines.values():
            eng.close()
        out[f"{hi}/{lo}"] = rates | {"ratio": rates["dynamic"] / rates["static_lo"]}
    # the Qwen3-MoE-shaped benchmark model, every expert resident: bf16 vs int4 (and int8, int2), plus
    # the same model with experts that cost nothing (the floor the non-expert layers set)
    from benchmarks._models import qwen3_bench_model

    bench = qwen3_bench_model()
    bench_quant = Path(".bench/quant-bench")
    quantize_model(bench, ["int8", "int4", "int2"], out=bench_quant, method="rtn")  # the fit does not change speed
    bench_prompt = list(range(100, 116))
    engines = {p: ready(engine(bench, bench_quant, p), bench_prompt) for p in ("full", "int8", "int4", "int2")}
    floor = ready(engine(bench, bench_quant, "int2"), bench_prompt)
    for block in floor.loaded.blocks:
        block.expert_fn = lambda x, views: torch.zeros_like(x)
    engines["no_expert_cost"] = floor
    rates = interleaved(engines, bench_prompt, 64, repeats)
    for eng in engines.values():
        eng.close()
    out["bench_model"] = rates | {"int4_over_bf16": rates["int4"] / rates["full"]}
    return out


def hot_set(eng: Any) -> set[ExpertKey]:
    hi = eng.store.hi_precision
    return {k for k, v in eng.store.index.items() if v.precision == hi}


def shift(ids: list[int], budget: int, hi: str, lo: str, scenario: str, window: int = 128,
          windows: int = 32) -> dict[str, Any]:  # fmt: skip
    """Start from a hot set chosen on other text, then score Shakespeare window by window (period 64).

    scenario "code": the warmup is argparse.py's source (a natural shift); "inverted": the
    hot set is the one of a distribution whose expert ranking is Shakespeare's reversed (the
    controller is seeded with the oracle's scores in reverse rank order, so the experts
    coldest on Shakespeare start hot; a synthetic worst case). adaptive: the controller runs;
    frozen: the starting hot set stays; oracle: warmed up on Shakespeare, then frozen; static
    hi / lo for reference. Per window: NLL, promotions so far, and the share of the oracle's
    hot set the adaptive engine holds at hi.
    """
    text = ids[WARMUP : WARMUP + windows * window + 1]
    oracle = engine(MODEL, QUANT, "dynamic", budget, hi, lo, sync=True, period=10**9)
    oracle.warmup(ids[:WARMUP])
    oracle_hot = hot_set(oracle)
    ctrl = oracle.switching.controller
    inverted = {}
    for layer in ctrl.layers:
        scores = ctrl.hotness.scores(layer)  # [E]
        inv = [0.0] * len(scores)
        coldest_first = sorted(range(len(scores)), key=lambda i: scores[i])
        for value, e in zip(sorted(scores, reverse=True), coldest_first, strict=True):
            inv[e] = float(value)
        inverted[layer] = inv
    nll: dict[str, list[float]] = {}
    promotions: list[int] = []
    overlap: list[float] = []
    for name in ("adaptive", "frozen", "oracle", "static_hi", "static_lo"):
        if name == "oracle":
            eng = oracle
        elif name.startswith("static"):
            eng = engine(MODEL, QUANT, hi if name == "static_hi" else lo)
        else:
            eng = engine(MODEL, QUANT, "dynamic", budget, hi, lo, sync=True, period=64 if name == "adaptive" else 10**9)
            if scenario == "code":
                eng.warmup(eng.encode(inspect.getsource(argparse_module))[:WARMUP])
            else:
                eng.switching.controller.seed(inverted)
                eng.switching.after_forward(force=True)
                eng.switching.mover.drain()
        if name == "adaptive":
            overlap.append(len(hot_set(eng) & oracle_hot) / len(oracle_hot))
            promotions.append(eng.stats()["promotions"])
        nll[name] = []
        for start in range(0, len(text) - 1, window):
            nll[name].append(eng.perplexity(text[start : start + window + 1], window=window).nll)
            if name == "adaptive":
                overlap.append(len(hot_set(eng) & oracle_hot) / len(oracle_hot))
                promotions.append(eng.stats()["promotions"])
        eng.close()
    return {"scenario": scenario, "window": window, "nll": nll, "promotions": promotions,
            "overlap_with_oracle": overlap}  # fmt: skip


def paper_regime(ids: list[int], budget: int, tokens: int, only_cache: bool = False) -> list[dict[str, Any]]:
    """DynaExq as the paper writes it (issue 17), int4/int2 at `budget`, switches synchronous (deterministic):
    Algorithm 1 (hysteresis 0) beside our default 0.1; the transient buffer at 0 / 2 / 4 high slots
    (counted in the budget, so it costs hot slots); the host DRAM cache of both precisions at a quarter,
    half and all of every expert's bytes at both precisions, with and without the prefetch of predicted
    promotions; lookahead 1. Period 512 for the cache rows: eval feeds windows of 256 tokens, so a
    prefetch halfway between decisions has a forward to run in."""
    probe = engine(MODEL, QUANT, "dynamic", 10**9, "int4", "int2")
    st = probe.store.stats()
    probe.close()
    every = len(probe.store.keys) * (st["slot_bytes"]["int4"] + st["slot_bytes"]["int2"])
    runs: list[tuple[str, int, dict[str, Any]]] = [
        ("Algorithm 1 (h=0)", 0, {"hysteresis": 0.0}),
        ("h=0.1 (default)", 0, {}),
        ("transient 2", 0, {"transient_slots": 2}),
        ("transient 4", 0, {"transient_slots": 4}),
        ("lookahead 1", 0, {"lookahead": 1.0}),
        ("period 512", 0, {"period": 512}),
    ]
    if only_cache:
        runs = []
    for frac in (0.25, 0.5, 1.0):
        runs.append((f"period 512, DRAM {frac:g}x", int(frac * every), {"period": 512}))
        runs.append((f"period 512, DRAM {frac:g}x + prefetch", int(frac * every), {"period": 512, "prefetch": True}))
    out = []
    for p in () if only_cache else ("int4", "int2"):  # the static ends of the gap, on the same tokens
        eng = engine(MODEL, QUANT, p)
        row = {"name": f"static {p}", "ppl": eng.perplexity(ids[WARMUP : WARMUP + tokens], window=WINDOW).ppl}
        eng.close()
        out.append(row)
        print(json.dumps(row), flush=True)
    for name, cache, pc in runs:
        pcfg = PrecisionConfig(mode="dynamic", hi="int4", lo="int2", quant_dir=str(QUANT), sync=True, **pc)
        cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget, host_cache_bytes=cache), precision=pcfg,
                           runtime=RuntimeConfig(dtype="bf16"))  # fmt: skip
        eng = moetier.load(MODEL, cfg)
        eng.warmup(ids[:WARMUP])
        before = eng.stats()["switching"].get("dram")  # after preload and warmup: its misses are compulsory
        r = eng.perplexity(ids[WARMUP : WARMUP + tokens], window=WINDOW)
        s = eng.stats()
        eng.close()
        sw = s["switching"]
        row = {"name": name, "ppl": r.ppl, "n_hot": sw["n_hot"], "promotions": s["promotions"],
               "demotions": s["demotions"], "peak_inflight": sw["transient"]["peak_inflight"],
               "disk_bytes": s["disk_bytes"], "cache_bytes": cache, "every_expert_both_bytes": every}  # fmt: skip
        if "dram" in sw:
            d = sw["dram"]
            row |= {"dram_hit_rate": d["hit_rate"], "hi_hit_rate": d["precisions"]["int4"]["hit_rate"],
                    "lo_hit_rate": d["precisions"]["int2"]["hit_rate"], "prefetch_used": d["prefetch_used"],
                    "prefetch_wasted": d["prefetch_wasted"]}  # fmt: skip
            assert before is not None
            for p in ("int4", "int2"):  # over the scored tokens only: one lookup per switch
                h = d["precisions"][p]["hits"] - before["precisions"][p]["hits"]
                m = d["precisions"][p]["misses"] - before["precisions"][p]["misses"]
                row[f"{p}_switch_hits"], row[f"{p}_switch_lookups"] = h, h + m
        if "prefetch" in sw:
            pf = sw["prefetch"]
            row |= {k: pf[k] for k in ("predicted", "predicted_promoted", "staged")}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens scored after the warmup")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved decode rounds per candidate (median)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-shift", action="store_true")
    ap.add_argument("--paper-only", action="store_true",
                    help="only the DynaExq-as-written section (Algorithm 1, transient buffer, DRAM cache, prefetch)")
    ap.add_argument("--paper-tokens", type=int, default=8192, help="held-out tokens of the paper section's runs")
    ap.add_argument("--cache-only", action="store_true", help="with --paper-only: only the DRAM cache rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    # 1. tiers
    paths = quantize_model(MODEL, ["int8", "int4", "int2"], out=QUANT)
    tiers = {tier_summary(p)["precision"]: tier_summary(p) for p in paths}
    tok = engine(MODEL, QUANT, "full")
    ids = tok.encode(TEXT.read_text(encoding="utf-8"))[: WARMUP + args.max_tokens]
    tok.close()
    if args.paper_only:  # 1.25x static int2's budget (its pool, sized for every expert, + staging)
        lo = engine(MODEL, QUANT, "int2")
        lo_budget = static_budget(lo.stats())
        lo.close()
        rows = paper_regime(ids, int(1.25 * lo_budget), args.paper_tokens, args.cache_only)
        print(json.dumps({"paper_regime": rows, "budget": int(1.25 * lo_budget), "seconds": time.time() - t0}))
        return
    # 2. errors
    out_err = expert_output_errors(ids)
    print("\nprecision  rel. weight error (w13 / w2)  expert output error")
    for p in ("int8", "int4", "int2"):
        e = tiers[p]["error"]
        print(f"{p:9}  {e['w13']:.4f} / {e['w2']:.4f}               {out_err[p]:.4f}")
    # 3. perplexity
    static = ppl_static(ids)
    print(f"\nstatic ({len(ids) - WARMUP} tokens, window {WINDOW})\nprecision  ppl      expert bytes  budget")
    for p, r in static.items():
        print(f"{p:9}  {r['ppl']:.3f}  {r['expert_bytes']:>12}  {r['budget']:>9}")
    dynamic = []
    for hi, lo, mults in (("int4", "int2", (1.1, 1.25, 1.5, 1.75)), ("full", "int4", (1.1, 1.25, 1.5, 2.0, 3.0))):
        gap = static[lo]["ppl"] - static[hi]["ppl"]
        for m in mults:
            budget = int(m * static[lo]["budget"])
            try:
                r = ppl_dynamic(ids, hi, lo, budget)
            except moetier.MoetierError as exc:
                print(f"dynamic {hi}/{lo} at {m}x: {exc}")
                continue
            r["budget_x_static_lo"] = m
            r["recovered"] = (static[lo]["ppl"] - r["ppl"]) / gap if gap else float("nan")
            dynamic.append(r)
    print("\ndynamic hi/lo  budget(x lo)  n_hot  ppl      recovered  promotions/demotions  expert bytes")
    for r in dynamic:
        print(f"{r['hi']:>4}/{r['lo']:<5}    {r['budget_x_static_lo']:>5.2f}x     {r['n_hot']:>5}  {r['ppl']:.3f}  "
              f"{r['recovered']:>8.1%}  {r['promotions']:>6}/{r['demotions']:<6}  {r['expert_bytes']}")  # fmt: skip
    result: dict[str, Any] = {"tiers": tiers, "expert_output_error": out_err}
    result["which_experts"] = which = which_experts(ids, int(1.25 * static["int2"]["budget"]))
    print("\nint4/int2 at 1.25x, hot slots frozen on: " + "  ".join(f"{k} {v:.2f}" for k, v in which.items()))
    result |= {"static": static, "dynamic": dynamic}
    # 4. speed
    if not args.skip_speed:
        result["speed"] = sp = speed(ids, {p: static[p]["budget"] for p in static}, args.repeats)
        print("\ndecode tok/s (bundled model, 1.25x static lo budget)")
        for pair in ("int4/int2", "full/int4"):
            s = sp[pair]
            print(f"  {pair:10} static lo {s['static_lo']:.1f}  dynamic {s['dynamic']:.1f}  ratio {s['ratio']:.2f}")
        b = sp["bench_model"]
        print("decode tok/s (Qwen3-MoE-shaped benchmark model, all resident): "
              + "  ".join(f"{p} {b[p]:.1f}" for p in ("full", "int8", "int4", "int2", "no_expert_cost"))
              + f"  int4/bf16 {b['int4_over_bf16']:.2f}x")  # fmt: skip
    # 5. shift
    if not args.skip_shift:
        result["shift"] = []
        for scenario in ("inverted", "code"):
            sh = shift(ids, int(1.25 * static["int2"]["budget"]), "int4", "int2", scenario)
            result["shift"].append(sh)
            print(f"\nshift ({scenario}), int4/int2 at 1.25x: perplexity per 4 windows of 128 Shakespeare tokens")
            print("windows  promotions  hot set = oracle's  adaptive  frozen  oracle  static_hi  static_lo")
            n = sh["nll"]
            print(f"start    {sh['promotions'][0]:10}  {sh['overlap_with_oracle'][0]:17.0%}")
            for b in range(0, len(n["adaptive"]), 4):
                ppl = {k: math.exp(statistics.fmean(v[b : b + 4])) for k, v in n.items()}
                print(f"{b:3}-{b + 3:<3}  {sh['promotions'][b + 4]:10}  {sh['overlap_with_oracle'][b + 4]:17.0%}  "
                      f"{ppl['adaptive']:8.2f}  {ppl['frozen']:6.2f}  {ppl['oracle']:6.2f}  {ppl['static_hi']:9.2f}  "
                      f"{ppl['static_lo']:9.2f}")  # fmt: skip
            whole = {k: math.exp(statistics.fmean(v)) for k, v in n.items()}
            print("all windows: " + "  ".join(f"{k} {v:.2f}" for k, v in whole.items()))
    result["seconds"] = time.time() - t0
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
