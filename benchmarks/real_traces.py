"""Expert caches and predictors on the real routing traces in ../shared/data/traces (issue 17, item 2).

The traces (DeepSeek-V2-Lite-Chat on two prompt sets, Mixtral-8x7B-Instruct decode; see their README and
SOURCE.md) carry no licence: this script READS them from `../shared/data/traces` (relative to the repo root)
and prints figures; it writes nothing derived from them into the repository (fitted knobs go to --fit-dir,
outside it by default). When the folder is absent it says so and exits 0.

Per trace, everything beside the shuffled-routing null (moetier.studies.trace_eval.shuffle_tokens: per-layer
token order permuted, per-(layer, expert) counts kept):
(a) caches, cold, at each --ratios: lru, lfu, mrs, belady as ONE global cache over all layers and as
    PER-LAYER caches (floor(ratio x E) slots each), moetier.sim.cache_replay; baselines prev-token (each layer
    caches its previous call's experts: k per layer) and most-frequent-so-far (per-layer, same slots);
(b) TriMoE's EMA load predictor (policies/predictor.py, a = 0.3, FractionRule) with its class accuracy and
    hot recall, beside alpha = 1 (previous call's classes) and running counts (most-frequent-so-far);
(c) next-layer expert prediction at distance 1-3 (accuracy = |guess & actual| / k): prev-token,
    most-frequent, online co-activation counts, and the trace-side history predictor of
    moetier.policies.route_history when that module exists;
(d) with --fit: the synthetic generator fitted to the trace at run time (studies/synthetic_fit.py), one
    synthetic trace of the same shape from the fitted knobs, and the same measurements on it beside the real.

Prints tables, then one JSON line.
    python benchmarks/real_traces.py [--only mixtral] [--ratios 0.05,0.1,0.125,0.25,0.5] [--fit] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from moetier import traces  # noqa: E402
from moetier.sim.cache_replay import ALL_POLICIES, replay, slots_for  # noqa: E402
from moetier.studies import trace_eval as te  # noqa: E402

TRACES_DIR = ROOT.parent / "shared" / "data" / "traces"
RATIOS = (0.05, 0.1, 0.125, 0.25, 0.5)
DISTANCES = (1, 2, 3)


# -- loading -------------------------------------------------------------------------------------------------
def load_calls(path: Path, max_tokens: int) -> tuple[dict[str, Any], list[traces.Call]]:
    """(metadata, calls) of a trace, cut to its first `max_tokens` steps when > 0."""
    tr = traces.load(path)
    calls = traces.iter_calls(tr)
    if max_tokens > 0:
        steps = sorted({c.step for c in calls})[:max_tokens]
        keep = set(steps)
        calls = [c for c in calls if c.step in keep]
    return tr.metadata, calls


def variants(calls: list[traces.Call], seed: int) -> dict[str, list[traces.Call]]:
    return {"real": calls, "null": te.shuffle_tokens(calls, seed)}


# -- (a) caches ----------------------------------------------------------------------------------------------
def cache_job(args: tuple[str, str, str, bool, float, str, int, int]) -> dict[str, Any]:
    """One replay (run in a worker): trace, variant, policy, per_layer, ratio."""
    name, path, variant, per_layer, ratio, policy, seed, max_tokens = args
    meta, calls = load_calls(Path(path), max_tokens)
    calls = variants(calls, seed)[variant] if variant == "null" else calls
    res = replay(calls, policy, ratio, num_experts=int(meta["num_experts"]), top_k=int(meta["top_k"]),
                 per_layer=per_layer)  # fmt: skip
    return {"trace": name, "variant": variant, "mode": "per-layer" if per_layer else "global", "ratio": ratio,
            "policy": policy, "hit_rate": res.hit_rate, "slots": res.slots, "seconds": res.seconds}  # fmt: skip


def cache_baselines(calls: list[traces.Call], E: int, ratios: tuple[float, ...]) -> dict[str, Any]:
    prev = te.prev_token_hits(calls, E)
    out: dict[str, Any] = {"prev-token": {"hit_rate": prev.hit_rate, "slots_per_layer": prev.slots_per_layer}}
    for r in ratios:
        mf = te.most_frequent_hits(calls, E, slots_for(r, E))
        out[f"most-frequent@{r:g}"] = {"hit_rate": mf.hit_rate, "slots_per_layer": mf.slots_per_layer}
    return out


# -- (b), (c) predictors -------------------------------------------------------------------------------------
def history_predictor() -> tuple[te.NextLayerPredictor | None, str]:
    """The trace-side history predictor (moetier.policies.route_history.RouteHistoryPredictor) adapted to
    trace_eval's protocol, or (None, why not). The adapter feeds the stream token by token, layer by layer,
    and asks predict(layer, d) right after each feed: all distances in one pass, kept for the next call."""
    try:
        from moetier.policies.route_history import RouteHistoryPredictor
    except ImportError as exc:
        return None, f"moetier.policies.route_history not importable ({exc})"
    memo: dict[str, Any] = {}

    def run(x: np.ndarray, d: int, num_experts: int) -> np.ndarray:
        if memo.get("x") is not x or memo.get("E") != num_experts:
            N, L, k = x.shape
            pred = RouteHistoryPredictor(range(L), num_experts, k, depth=max(DISTANCES))
            guesses = {e: np.zeros((N, L - e, k), dtype=np.int64) for e in DISTANCES if e < L}
            for t in range(N):
                for pos in range(L):
                    pred.feed(pos, x[t, pos][None, :])
                    for e, g in guesses.items():
                        if pos + e < L:
                            g[t, pos] = pred.predict(pos, e)[0]
            memo.update(x=x, E=num_experts, guesses=guesses, own_stats=pred.stats())
        return np.asarray(memo["guesses"][d])

    return run, "moetier.policies.route_history.RouteHistoryPredictor (feed / predict per token and layer)"


def predictors(calls: list[traces.Call], E: int, extra: te.NextLayerPredictor | None) -> dict[str, Any]:
    layers = sorted({int(c.layer) for c in calls})
    load = {
        "trimoe-ema": te.load_predictor_stats(calls, layers, E, alpha=0.3),
        "prev-call": te.load_predictor_stats(calls, layers, E, alpha=1.0),
        "running-count": te.running_count_stats(calls, layers, E),
    }
    x = te.token_rows(calls)
    preds = dict(te.NEXT_LAYER) | ({"history": extra} if extra is not None else {})
    nxt = {name: te.next_layer_accuracy(x, f, E, DISTANCES) for name, f in preds.items()}
    return {"load": load, "next_layer": nxt}


# -- (d) fit -------------------------------------------------------------------------------------------------
def fit_and_generate(name: str, path: Path, fit_dir: Path, reuse: bool) -> tuple[Any, traces.Trace, float]:
    from moetier.studies import synthetic
    from moetier.studies.synthetic_fit import fit_params
    from moetier.studies.synthetic_stats import trace_stats

    knobs = fit_dir / f"{name}.json"
    t0 = time.perf_counter()
    if reuse and knobs.exists():
        p = synthetic.load_params(knobs)
    else:
        p = fit_params(traces.load(path))
        synthetic.save_params(p, knobs)
    fit_s = time.perf_counter() - t0
    obs = trace_stats(traces.load(path))
    syn = synthetic.generate(replace(p, seed=1), int(obs["decode_steps"]),
                             int(obs["prefill_tokens"]) // int(obs["batch"]))  # fmt: skip
    return p, syn, fit_s


# -- report --------------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES_DIR, help="folder of trace folders (default: ../shared)")
    ap.add_argument("--only", default="", help="comma list of substrings of trace folder names to run")
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="cache ratios")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--seed", type=int, default=0, help="seed of the shuffled null")
    ap.add_argument("--max-tokens", type=int, default=0, help="cut each trace to its first N steps (0 = all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for the cache replays")
    ap.add_argument("--no-caches", action="store_true", help="skip (a)")
    ap.add_argument("--no-predictors", action="store_true", help="skip (b) and (c)")
    ap.add_argument("--fit", action="store_true", help="(d): fit the generator to each trace, compare")
    ap.add_argument(
        "--fit-dir",
        type=Path,
        default=Path("/tmp/moetier-trace-fits"),
        help="where fitted knobs (.json) go; keep it outside the repository (no licence)",
    )
    ap.add_argument("--reuse-fit", action="store_true", help="read knobs from --fit-dir when there")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 200))
    if not args.traces.is_dir():
        console.print(f"real traces not found at {args.traces}: skipped", highlight=False)
        print(json.dumps({"benchmark": "real_traces", "skipped": f"no folder {args.traces}"}))
        return
    if args.fit_dir.resolve().is_relative_to(ROOT):
        raise SystemExit(f"--fit-dir {args.fit_dir} is inside the repository; fitted knobs may not go there")
    ratios = tuple(float(r) for r in args.ratios.split(",") if r.strip())
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    only = [s for s in args.only.split(",") if s]
    paths = {d.name: d / "trace.parquet" for d in sorted(args.traces.iterdir())
             if (d / "trace.parquet").exists() and (not only or any(s in d.name for s in only))}  # fmt: skip
    extra, extra_note = history_predictor()
    payload: dict[str, Any] = {"benchmark": "real_traces", "seed": args.seed, "ratios": ratios,
                               "max_tokens": args.max_tokens, "history_predictor": extra_note,
                               "traces": {}}  # fmt: skip
    # (a) caches: all replays through one pool
    if not args.no_caches:
        jobs = [(n, str(p), v, pl, r, pol, args.seed, args.max_tokens) for n, p in paths.items()
                for v in ("real", "null") for pl in (False, True) for r in ratios for pol in policies]  # fmt: skip
        t0 = time.perf_counter()
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                results = list(pool.map(cache_job, jobs))
        else:
            results = [cache_job(j) for j in jobs]
        console.print(f"{len(jobs)} replays in {time.perf_counter() - t0:.0f} s", highlight=False)
    for name, path in paths.items():
        meta, calls = load_calls(path, args.max_tokens)
        E, k, L = int(meta["num_experts"]), int(meta["top_k"]), len({c.layer for c in calls})
        entry: dict[str, Any] = {"model": meta.get("model"), "tokens": len(calls) // max(1, L), "layers": L,
                                 "experts": E, "top_k": k}  # fmt: skip
        var = variants(calls, args.seed)
        if not args.no_caches:
            rows = [r for r in results if r["trace"] == name]
            base = {v: cache_baselines(cs, E, ratios) for v, cs in var.items()}
            entry["caches"] = rows
            entry["cache_baselines"] = base
            table = Table(title=f"{name}: cache hit rate % (cold), real [shuffled null]", title_justify="left")
            for col in ("mode", "ratio", "slots", *policies, "most-freq", "prev-token (k/layer)"):
                table.add_column(col, justify="right")
            for mode in ("global", "per-layer"):
                for r in ratios:
                    cell = {(x["variant"], x["policy"]): x for x in rows if x["mode"] == mode and x["ratio"] == r}
                    mf, pt = f"most-frequent@{r:g}", "prev-token"
                    table.add_row(
                        mode, f"{r:g}", str(cell[("real", policies[0])]["slots"]),
                        *(f"{pct(cell[('real', p)]['hit_rate'])} [{pct(cell[('null', p)]['hit_rate'])}]"
                          for p in policies),
                        f"{pct(base['real'][mf]['hit_rate'])} [{pct(base['null'][mf]['hit_rate'])}]",
                        f"{pct(base['real'][pt]['hit_rate'])} [{pct(base['null'][pt]['hit_rate'])}]",
                    )  # fmt: skip
            console.print(table)
        if not args.no_predictors:
            t0 = time.perf_counter()
            pr = {v: predictors(cs, E, extra) for v, cs in var.items()}
            entry["predictors"] = pr
            table = Table(title=f"{name}: load-class predictors (TriMoE 4.3 scoring), real [null]",
                          title_justify="left")  # fmt: skip
            for col in ("predictor", "accuracy", "hot precision", "hot recall", "change acc.", "rel. error"):
                table.add_column(col, justify="right")
            for p, st in pr["real"]["load"].items():
                nu = pr["null"]["load"][p]
                table.add_row(p, *(f"{pct(st[m])} [{pct(nu[m])}]" for m in
                                   ("accuracy", "hot_precision", "hot_recall", "change_accuracy")),
                              f"{st['rel_error']:.2f} [{nu['rel_error']:.2f}]")  # fmt: skip
            console.print(table)
            table = Table(title=f"{name}: next-layer expert prediction, |guess & actual| / k %, real [null]",
                          title_justify="left")  # fmt: skip
            table.add_column("predictor")
            for d in DISTANCES:
                table.add_column(f"d={d}", justify="right")
            for p, acc in pr["real"]["next_layer"].items():
                nu = pr["null"]["next_layer"][p]
                table.add_row(p, *(f"{pct(acc[d])} [{pct(nu[d])}]" if d in acc else "-" for d in DISTANCES))
            console.print(table)
            console.print(f"predictors: {time.perf_counter() - t0:.0f} s", highlight=False)
        if args.fit:
            entry["fit"] = fit_section(console, name, path, calls, meta, ratios, policies, args)
        payload["traces"][name] = entry
    if extra is None:
        console.print(f"history predictor: {extra_note}", highlight=False)
    print(json.dumps(payload, default=_json_default))


def fit_section(
    console: Console,
    name: str,
    path: Path,
    calls: list[traces.Call],
    meta: dict[str, Any],
    ratios: tuple[float, ...],
    policies: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """(d): fitted knobs, then real vs synthetic statistics, global cache hit rates and predictors."""
    from moetier.studies.synthetic_stats import trace_stats

    p, syn, fit_s = fit_and_generate(name, path, args.fit_dir, args.reuse_fit)
    real_stats = trace_stats(traces.load(path))
    syn_stats = trace_stats(syn)
    syn_calls = traces.iter_calls(syn)
    E, k = int(meta["num_experts"]), int(meta["top_k"])
    out: dict[str, Any] = {"knobs": asdict(p), "fit_s": fit_s, "stats": {"real": real_stats, "synthetic": syn_stats}}
    table = Table(title=f"{name}: fitted knobs ({fit_s:.0f} s; written to {args.fit_dir})", title_justify="left")
    keys = ("hot_frac", "warm_frac", "hot_share", "warm_share", "spread", "temporal", "layer_corr", "drift",
            "sharpness")  # fmt: skip
    for key in keys:
        table.add_column(key, justify="right")
    table.add_row(*(f"{getattr(p, key):.3f}" for key in keys))
    console.print(table)
    hits: dict[str, dict[str, float]] = {"real": {}, "synthetic": {}}
    for r in ratios:
        for pol in policies:
            for v, cs in (("real", calls), ("synthetic", syn_calls)):
                hits[v][f"{pol}@{r:g}"] = replay(cs, pol, r, num_experts=E, top_k=k).hit_rate
    for v, cs in (("real", calls), ("synthetic", syn_calls)):
        hits[v]["prev-token"] = te.prev_token_hits(cs, E).hit_rate
        layers = sorted({int(c.layer) for c in cs})
        hits[v]["trimoe-ema accuracy"] = te.load_predictor_stats(cs, layers, E)["accuracy"]
        hits[v]["co-activation d=1"] = te.next_layer_accuracy(te.token_rows(cs), te.predict_coactivation, E, (1,))[1]
    out["measures"] = hits
    table = Table(title=f"{name}: real vs synthetic from the fitted knobs (seed 1, same shape)", title_justify="left")
    for col in ("measure", "real", "synthetic"):
        table.add_column(col, justify="right")
    for key in ("top10_share", "bottom70_share", "reuse", "reuse_indep", "layer_pred", "layer_pred_base",
                "drift_corr"):  # fmt: skip
        table.add_row(key, f"{real_stats[key]:.3f}", f"{syn_stats[key]:.3f}")
    for key in hits["real"]:
        table.add_row(key, pct(hits["real"][key]), pct(hits["synthetic"][key]))
    console.print(table)
    return out


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    return str(o)


if __name__ == "__main__":
    main()
