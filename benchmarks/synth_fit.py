"""How well the synthetic routing generator reproduces real and published statistics (issue 5, item 5).

(a) fit: each recorded trace of the bundled model in data/traces/ is fitted
    (moetier.studies.synthetic_fit.fit_params), then
    `--seeds` synthetic traces of the same shape (batch, decode steps, prompt length) are generated from
    the fitted knobs with fresh seeds; the table compares the recorded statistics with the synthetic mean
    and standard deviation, and checks |recorded - synthetic mean| <= TOL for each.
(b) presets: for every shipped spec (moetier.specs.spec_names), moetier.studies.synthetic.preset(spec)
    generates a batch-1 trace
    (`--steps` decode steps after a 32-token prompt) and a batch-128 trace (50 steps); the table gives
    the token shares of the preset's hot/warm/cold classes against TriMoE 3.1 (cold: over 70% of the
    experts, about 8% of tokens; warm: 20-40% of the experts, up to 70%), the cold share of the batch-1
    trace with drift off (drift moves which experts are hot over a long trace), and the dynamics.
(c) speed of generate(): 1000 decode steps x 26 layers x 64 experts at batch 1, and 100 steps at batch 512.

Prints the tables, then one JSON line.   python benchmarks/synth_fit.py [--seeds 5] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from moetier import traces  # noqa: E402
from moetier.specs import load_spec, spec_names  # noqa: E402
from moetier.studies.synthetic import PRESET_DYNAMICS, SynthParams, generate, preset, routing  # noqa: E402
from moetier.studies.synthetic_fit import fit_params  # noqa: E402
from moetier.studies.synthetic_stats import class_shares, sorted_profile, stats_of, trace_stats  # noqa: E402

FIT_STATS = ("top10_share", "bottom70_share", "reuse", "layer_pred", "topk_mass", "reuse_indep",
             "layer_pred_base", "drift_corr")  # fmt: skip
CHECKED = ("top10_share", "bottom70_share", "reuse", "layer_pred", "topk_mass")
TOL = 0.04  # absolute, on shares / overlaps / probability mass
KNOBS = ("hot_frac", "warm_frac", "hot_share", "warm_share", "spread", "temporal", "layer_corr", "drift", "sharpness")


def fit_rows(seeds: int) -> list[dict[str, Any]]:
    """Per recorded trace: knobs, recorded stats, synthetic mean/sd, worst |difference| of CHECKED."""
    rows = []
    for path in sorted((ROOT / "data" / "traces").glob("*.parquet")):
        t = traces.load(path)
        obs = trace_stats(t)
        t0 = time.perf_counter()
        p = fit_params(t)
        fit_s = time.perf_counter() - t0
        prompt = obs["prefill_tokens"] // obs["batch"]
        sims = [trace_stats(generate(replace(p, seed=s), obs["decode_steps"], prompt)) for s in range(1, seeds + 1)]
        syn = {k: (float(np.mean([s[k] for s in sims])), float(np.std([s[k] for s in sims]))) for k in FIT_STATS}
        worst = max(abs(obs[k] - syn[k][0]) for k in CHECKED)
        rows.append({"trace": path.stem, "fit_s": round(fit_s, 2), "knobs": {k: getattr(p, k) for k in KNOBS},
                     "recorded": {k: obs[k] for k in FIT_STATS}, "synthetic": syn, "worst_abs_diff": worst,
                     "within_tol": worst <= TOL, "shape": [obs["batch"], obs["decode_steps"], prompt]})  # fmt: skip
    return rows


def preset_rows(steps: int) -> list[dict[str, Any]]:
    """Per spec: class sizes and their token shares at batch 1 and batch 128, plus dynamics at batch 1."""
    rows = []
    for name in spec_names():
        spec = load_spec(name)
        p = preset(spec)
        counts = p.class_counts
        r1 = routing(p, steps, 32)
        r128 = routing(replace(p, batch_size=128), 50, 0)
        still = routing(replace(p, drift=0.0), steps, 32)
        st = stats_of(r1)
        rows.append({
            "spec": name, "E": p.num_experts, "k": p.top_k, "layers": p.num_layers, "counts": counts,
            "fracs": [c / p.num_experts for c in counts],
            "shares_b1": class_shares(sorted_profile(r1), counts),
            "shares_b128": class_shares(sorted_profile(r128), counts),
            "cold_b1_nodrift": class_shares(sorted_profile(still), counts)[2],
            "bottom70_b1": st["bottom70_share"], "top10_b1": st["top10_share"], "reuse": st["reuse"],
            "reuse_indep": st["reuse_indep"], "layer_pred": st["layer_pred"], "topk_mass": st["topk_mass"],
        })  # fmt: skip
    return rows


def speed() -> dict[str, float]:
    out = {}
    for label, batch, steps in (("b1_1000x26x64", 1, 1000), ("b512_100x26x64", 512, 100)):
        p = SynthParams(num_layers=26, num_experts=64, top_k=6, hot_frac=3 / 64, warm_frac=15 / 64, batch_size=batch)
        generate(p, 2)  # calibration (cached per popularity profile) outside the timing
        t0 = time.perf_counter()
        generate(p, steps)
        out[label] = round(time.perf_counter() - t0, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="synthetic traces per fitted trace")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps of the batch-1 preset traces")
    args = ap.parse_args()
    console = Console(width=200)
    # 1. fits
    fits = fit_rows(args.seeds)
    t = Table(title=f"recorded bundled-model traces vs generate(fit(trace)), mean ± sd of {args.seeds} seeds "
              f"(check: |diff| <= {TOL} on {', '.join(CHECKED)})", title_justify="left")  # fmt: skip
    t.add_column("statistic")
    for row in fits:
        t.add_column(f"{row['trace']} recorded", justify="right")
        t.add_column("synthetic", justify="right")
    for k in FIT_STATS:
        t.add_row(
            k, *(c for r in fits for c in (f"{r['recorded'][k]:.3f}", "{:.3f} ± {:.3f}".format(*r["synthetic"][k])))
        )
    t.add_section()
    for k in KNOBS:
        t.add_row(f"knob {k}", *(c for r in fits for c in ("", f"{r['knobs'][k]:.3f}")))
    t.add_row("fit time (s)", *(c for r in fits for c in ("", f"{r['fit_s']:.2f}")))
    t.add_row("worst |diff|", *(c for r in fits for c in ("", f"{r['worst_abs_diff']:.3f}")))
    console.print(t)
    mean_knobs = {
        k: float(np.mean([r["knobs"][k] for r in fits])) for k in ("temporal", "layer_corr", "drift", "sharpness")
    }
    console.print(f"mean fitted dynamics: { {k: round(v, 3) for k, v in mean_knobs.items()} }; "
                  f"presets use {PRESET_DYNAMICS}", highlight=False)  # fmt: skip
    # 2. presets
    pres = preset_rows(args.steps)
    t = Table(title="presets vs TriMoE 3.1 (cold > 70% of experts ~ 8% of tokens; warm 20-40% of experts <= 70%); "
              f"token shares at batch 1 x {args.steps} steps [batch 128 x 50 steps]", title_justify="left")  # fmt: skip
    for col in ("spec", "E/k/L", "hot/warm/cold experts", "hot share", "warm share", "cold share", "cold, drift 0",
                "bottom-70%", "top-10%", "reuse [indep]", "layer pred", "top-k mass"):  # fmt: skip
        t.add_column(col, justify="left" if col == "spec" else "right")
    for r in pres:
        f = r["fracs"]
        t.add_row(
            r["spec"], f"{r['E']}/{r['k']}/{r['layers']}", "{}/{}/{} ({:.0%}/{:.0%}/{:.0%})".format(*r["counts"], *f),
            *(f"{r['shares_b1'][i]:.3f} [{r['shares_b128'][i]:.3f}]" for i in range(3)), f"{r['cold_b1_nodrift']:.3f}",
            f"{r['bottom70_b1']:.3f}", f"{r['top10_b1']:.3f}", f"{r['reuse']:.3f} [{r['reuse_indep']:.3f}]",
            f"{r['layer_pred']:.3f}", f"{r['topk_mass']:.3f}",
        )  # fmt: skip
    console.print(t)
    # 3. speed
    sp = speed()
    console.print(f"generate() seconds (with scores): {sp}", highlight=False)
    print(json.dumps({
        "benchmark": "synth_fit", "tolerance": TOL, "all_within_tol": all(r["within_tol"] for r in fits),
        "fits": fits, "mean_fitted_dynamics": mean_knobs, "preset_dynamics": PRESET_DYNAMICS,
        "presets": pres, "speed_s": sp, "example_params": asdict(preset(load_spec("deepseek-v2-lite"))),
    }, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))  # fmt: skip


if __name__ == "__main__":
    main()
