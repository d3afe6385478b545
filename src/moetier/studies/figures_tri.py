"""The TriMoE study's figures and tables (docs/trimoe.md), drawn from the rows of `sweeps/trimoe.toml`
(`figures = "trimoe"`): paper Fig. 6 (MoE-layer decode speedup over klotski), Fig. 7 (end-to-end
throughput over klotski), Table 3 (utilisation per domain), Fig. 8 (ablation), Fig. 9 (NDP count and
CPU TFLOPS sensitivity), 5.5 (robustness at small batches; block "robustness" when present, else "systems"), and
two of our own: relayout's gain against
the trace's popularity drift, and the eq. 6 contention reading. `tables.md` holds every number drawn.

The headline blocks are the paper's setting (issue 30: regime "paper", DIMM-Link calibrated to 5.5; or, from
sweeps/trimoe_stationary.toml, the stationary regime; the titles name the regime and pricing of the rows): systems,
robustness, ablation, ablation-base; older study files' calm columns (systems-calm, ablation-calm,
ablation-base-calm) are drawn where present. Blocks read
(by name): those, ablation-links (+relayout with each DIMM-Link move over every link), ndp, cpu, drift,
drift-base, contention, contention-base. Fig. 7 is end-to-end throughput with the prefill phase
(`e2e_tok_s`). Table 3 is given per step time (`step_*`: the dense work counted as GPU compute) and per MoE
time. A figure whose block is absent or has no ok rows is skipped (a smaller grid draws what it can).
Invariants: matplotlib Agg only; every number in tables.md comes from a row; nothing here simulates.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moetier.plotting import pyplot, save_figure

Rows = Sequence[dict[str, Any]]
SYSTEMS = ("klotski", "ktransformers-plus", "monde", "trimoe")
BASELINES = ("ktransformers-plus", "monde")
ABLATION = ("gpu-ndp", "+cpu", "+refinement", "+relayout")


def _pick(rows: Rows, block: str, **eq: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and r.get("block", block) == block
            and all(r.get(k) == v for k, v in eq.items())]  # fmt: skip


def _one(rows: Rows, block: str, **eq: Any) -> dict[str, Any] | None:
    got = _pick(rows, block, **eq)
    return got[0] if got else None


def _models(rows: Rows, block: str) -> list[str]:
    return list(dict.fromkeys(str(r["model"]) for r in _pick(rows, block)))


def _regime(rows: Rows, block: str = "systems") -> str:
    """The headline blocks' trace regime, from their rows: "drift D", or "step noise S, drift D" for the
    stationary column (sweeps/trimoe_stationary.toml)."""
    got = _pick(rows, block) or _pick(rows, "ablation")
    noise = max((float(r.get("step_noise") or 0.0) for r in got), default=0.0)
    drifts = sorted({float(r["drift"]) for r in got if r.get("drift") is not None})
    named = sorted({str(r["regime"]) for r in got if r.get("regime")})  # sim.tri REGIMES (issue 30)
    drift = ("drift " + "/".join(f"{d:g}" for d in drifts) if drifts
             else "regime " + "/".join(named) if named else "preset drift")  # fmt: skip
    return f"step noise {noise:g}, {drift}" if noise > 0 else drift


def _link(rows: Rows, block: str = "systems") -> str:
    """The headline blocks' DIMM-Link pricing (sim.tri DIMM_LINK), from their rows."""
    links = sorted({str(r["dimm_link"]) for r in _pick(rows, block) if r.get("dimm_link")})
    return "/".join(links) if links else "per link"


def _speedups(rows: Rows, model: str, batch: int, col: str, higher: bool, block: str = "systems") -> dict[str, float]:
    """system -> its metric over klotski's (MoE time: klotski / system; throughput: system / klotski)."""
    base = _one(rows, block, model=model, batch_size=batch, scheduler="klotski")
    out: dict[str, float] = {}
    for s in SYSTEMS:
        r = _one(rows, block, model=model, batch_size=batch, scheduler=s)
        if base is not None and r is not None:
            out[s] = r[col] / base[col] if higher else base[col] / r[col]
    return out


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for j, (label, ys) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(groups)), groups, fontsize="small")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def _table(title: str, head: list[str], body: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _systems(rows: Rows, plt: Any, out: Path, md: list[str]) -> list[Path]:
    """Fig. 6 and 7 (batch 256/512/768 per model), 5.5 robustness, Table 3."""
    models = _models(rows, "systems")
    batches = sorted({int(r["batch_size"]) for r in _pick(rows, "systems")})
    if not models:
        return []
    paths = []
    for col, higher, name, label in (
        ("moe_step_s", False, "fig6_moe_speedup", "MoE-layer decode speedup"),
        ("e2e_tok_s", True, "fig7_e2e_speedup", "end-to-end throughput"),
    ):
        big = [b for b in batches if b >= 256] or batches[-1:]
        fig, axes = plt.subplots(1, len(big), figsize=(4.2 * len(big), 3.6), squeeze=False)
        body = []
        for ax, b in zip(axes[0], big, strict=True):
            sp = {m: _speedups(rows, m, b, col, higher) for m in models}
            _bars(ax, models, {s: [sp[m].get(s, 0.0) for m in models] for s in SYSTEMS})
            ax.set_title(f"batch {b}", fontsize="medium")
            ax.set_ylabel(f"{label} over klotski (x)")
            body += [[m, str(b), *(f"{sp[m][s]:.2f}" if s in sp[m] else "-" for s in SYSTEMS)] for m in models]
        paths.append(save_figure(fig, out / f"{name}.png"))
        md.append(_table(f"{label} over klotski (x)", ["model", "batch", *SYSTEMS], body))
    # robustness: trimoe over the best baseline against batch
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    body = []
    small = sorted({int(r["batch_size"]) for r in _pick(rows, "robustness")})  # 5.5's small batches (issue 30)
    for m in models:
        pts = []
        for b in sorted({*batches, *small}):
            ms = _speedups(rows, m, b, "moe_step_s", False) or _speedups(rows, m, b, "moe_step_s", False, "robustness")
            if "trimoe" in ms and any(s in ms for s in BASELINES):
                best = max(ms[s] for s in BASELINES if s in ms)
                pts.append((b, ms["trimoe"] / best))
                body.append([m, str(b), f"{ms['trimoe']:.2f}", f"{best:.2f}", f"{ms['trimoe'] / best:.2f}"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("trimoe / best baseline (MoE time, x)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "robustness_batch.png"))
    md.append(_table("trimoe against the best baseline (MoE speedups over klotski)",
                     ["model", "batch", "trimoe", "best baseline", "ratio"], body))  # fmt: skip
    # the paper's regime beside the calm presets: trimoe over the best baseline (MoE time and end to end)
    both = []
    for m in models:
        for b in (x for x in batches if x >= 256):
            cells = []
            for block in ("systems", "systems-links", "systems-calm"):
                for col, higher in (("moe_step_s", False), ("e2e_tok_s", True)):
                    su = _speedups(rows, m, b, col, higher, block if block != "systems-links" else "systems")
                    tri = _one(rows, "systems-links", model=m, batch_size=b, scheduler="trimoe")
                    if block == "systems-links" and tri is not None and "klotski" in su:
                        k = _one(rows, "systems", model=m, batch_size=b, scheduler="klotski")
                        assert k is not None
                        su["trimoe"] = tri[col] / k[col] if higher else k[col] / tri[col]
                    elif block == "systems-links":
                        su.pop("trimoe", None)
                    have = [s for s in BASELINES if s in su]
                    if "trimoe" in su and have:
                        lead = max(have, key=lambda s: su[s])
                        cells.append(f"{su['trimoe'] / su[lead]:.2f} ({lead})")
                    else:
                        cells.append("-")
            both.append([m, str(b), *cells])
    rg = _regime(rows)
    md.append(_table(f"trimoe / best baseline: the headline regime ({rg}; DIMM-Link {_link(rows)}, or every link per "
                     "move where a systems-links block ran) and calm presets where a systems-calm block ran",
                     ["model", "batch", f"MoE, {rg}", f"end to end, {rg}", f"MoE, {rg}, every link",
                      f"end to end, {rg}, every link", "MoE, calm", "end to end, calm"],
                     both))  # fmt: skip
    # Table 3: FLOP utilisation and busy time per domain, batch 512 (else the largest), mean over models
    util_body = []
    tb = 512 if 512 in batches else batches[-1]
    for s in SYSTEMS:
        rs = _pick(rows, "systems", batch_size=tb, scheduler=s)
        if rs:
            mean = {k: sum(float(r[k]) for r in rs) / len(rs) for k in
                    ("step_compute_gpu", "step_busy_gpu", "step_compute_cpu", "step_busy_cpu", "step_compute_ndp",
                     "compute_gpu", "compute_cpu", "compute_ndp", "busy_gpu", "busy_cpu", "busy_ndp", "busy_dimm",
                     "flop_util_gpu", "flop_util_cpu", "flop_util_ndp")}  # fmt: skip
            util_body.append([s, *(f"{100 * mean[k]:.1f}%" for k in mean)])
    md.append(_table(f"utilisation at batch {tb}, mean over the models (Table 3); step_*: per step time, "
                     "the dense work counted as GPU compute; the rest per MoE time",
                     ["system", "step computing GPU", "step busy GPU", "step computing CPU", "step busy CPU",
                      "step computing NDP", "computing GPU", "computing CPU", "computing NDP", "busy GPU", "busy CPU",
                      "busy NDP", "busy DIMM (eq. 6)", "FLOP util GPU", "FLOP util CPU", "FLOP util NDP"],
                     util_body))  # fmt: skip
    mig_body = []
    for m in models:
        for b in batches:
            r = _one(rows, "systems", model=m, batch_size=b, scheduler="trimoe")
            if r is not None:
                mig_body.append([m, str(b), f"{100 * r['predictor_accuracy']:.1f}%", f"{r['prefill_s']:.2f}",
                                 f"{100 * r['predictor_hot_recall']:.1f}%",
                                 *(str(int(r[f"migration_{k}"])) for k in ("prefetch", "relayout", "migrate")),
                                 f"{r['migration_dimm_link_bytes'] / 1e9:.1f}",
                                 f"{100 * r['migration_link_frac']:.2f}%"])  # fmt: skip
    md.append(_table("trimoe: predictor accuracy and background moves (all steps)",
                     ["model", "batch", "predictor accuracy", "prefill s", "hot recall", "prefetches", "relayouts",
                      "migrations",
                      "DIMM-Link GB", "link time / run time"], mig_body))  # fmt: skip
    return paths


def _ablation(rows: Rows, plt: Any, out: Path, md: list[str], suffix: str = "", note: str = "") -> list[Path]:
    """Fig. 8: gpu-ndp -> +cpu -> +refinement -> +relayout at batch 512 (blocks ablation{suffix} and
    ablation-base{suffix})."""
    abl, base = f"ablation{suffix}", f"ablation-base{suffix}"
    models = _models(rows, abl)
    steps = {
        "gpu-ndp": (base, "gpu-ndp", False, False),
        "+cpu": (abl, "trimoe", False, False),
        "+refinement": (abl, "trimoe", True, False),
        "+relayout": (abl, "trimoe", True, True),
    }
    data: dict[str, list[float]] = {}
    body = []
    for m in models:
        ms = []
        for label in ABLATION:
            block, sched, ref, rel = steps[label]
            r = _one(rows, block, model=m, scheduler=sched, refinement=ref, relayout=rel)
            ms.append(float(r["moe_step_s"]) if r is not None else float("nan"))
        data[m] = [ms[0] / x for x in ms]
        body.append([m, *(f"{1e3 * x:.1f}" for x in ms),
                     *(f"{ms[i - 1] / ms[i]:.2f}" for i in range(1, len(ms)))])  # fmt: skip
    if not models:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    _bars(ax, list(ABLATION), data)
    ax.set_ylabel("speedup over gpu-ndp (x)")
    ax.set_title(f"ablation, batch 512{note}", fontsize="medium")
    path = save_figure(fig, out / f"fig8_ablation{suffix}.png")
    md.append(
        _table(
            f"ablation at batch 512{note}: MoE ms per step, then each step's gain (Fig. 8)",
            ["model", *(f"{s} ms" for s in ABLATION), *(f"{s} gain" for s in ABLATION[1:])],
            body,
        )
    )
    return [path]


def _sweep_line(rows: Rows, plt: Any, out: Path, md: list[str], block: str, x: str, xlabel: str,
                name: str) -> list[Path]:  # fmt: skip
    """MoE time against one parameter (trimoe, normalised to its value at x = 1 or 16), per model."""
    models = _models(rows, block)
    if not models:
        return []
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    body = []
    for m in models:
        rs = sorted(_pick(rows, block, model=m, scheduler="trimoe"), key=lambda r: float(r[x]))
        ref = next((r for r in rs if float(r[x]) in (1.0, 16.0)), rs[-1])
        ax.plot([float(r[x]) for r in rs], [float(r["moe_step_s"]) / float(ref["moe_step_s"]) for r in rs],
                marker="o", label=m)  # fmt: skip
        body += [[m, f"{float(r[x]):g}", f"{1e3 * float(r['moe_step_s']):.1f}",
                  f"{float(r['moe_step_s']) / float(ref['moe_step_s']):.2f}"] for r in rs]  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("trimoe MoE time (relative)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    path = save_figure(fig, out / f"{name}.png")
    md.append(_table(f"trimoe against {xlabel} (batch 512)", ["model", xlabel, "MoE ms/step", "relative"], body))
    return [path]


def _drift(rows: Rows, plt: Any, out: Path, md: list[str]) -> list[Path]:
    """Relayout's gain and trimoe's lead over ktransformers-plus against the trace's popularity drift."""
    models = _models(rows, "drift")
    if not models:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    body = []
    for m in models:
        drifts = sorted({float(r["drift"]) for r in _pick(rows, "drift", model=m)})
        gain, lead = [], []
        for d in drifts:
            on = _one(rows, "drift", model=m, drift=d, scheduler="trimoe", relayout=True)
            off = _one(rows, "drift", model=m, drift=d, scheduler="trimoe", relayout=False)
            kt = _one(rows, "drift-base", model=m, drift=d, scheduler="ktransformers-plus")
            if on is None or off is None or kt is None:
                continue
            gain.append((d, off["moe_step_s"] / on["moe_step_s"]))
            lead.append((d, kt["moe_step_s"] / on["moe_step_s"]))
            body.append([m, f"{d:g}", f"{100 * on['predictor_accuracy']:.1f}%", f"{gain[-1][1]:.3f}",
                         f"{lead[-1][1]:.2f}"])  # fmt: skip
        axes[0].plot([g[0] for g in gain], [g[1] for g in gain], marker="o", label=m)
        axes[1].plot([g[0] for g in lead], [g[1] for g in lead], marker="o", label=m)
    for ax, ylabel in zip(axes, ("+relayout gain (x)", "trimoe over ktransformers-plus (x)"), strict=True):
        ax.set_xlabel("popularity drift (rank swaps per layer per step)")
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    path = save_figure(fig, out / "drift_relayout.png")
    md.append(_table("relayout against popularity drift (batch 512)",
                     ["model", "drift", "predictor accuracy", "+relayout gain", "trimoe / ktransformers-plus"],
                     body))  # fmt: skip
    return [path]


def _links(rows: Rows, md: list[str]) -> None:
    """+relayout under the two DIMM-Link pricings (per link; every link per move), drift 24, batch 512."""
    body = []
    for m in _models(rows, "ablation-links"):
        off = _one(rows, "ablation", model=m, scheduler="trimoe", refinement=True, relayout=False)
        per = _one(rows, "ablation", model=m, scheduler="trimoe", refinement=True, relayout=True)
        spread = _one(rows, "ablation-links", model=m, scheduler="trimoe", refinement=True, relayout=True)
        if off is None or per is None or spread is None:
            continue
        body.append([m, f"{1e3 * off['moe_step_s']:.1f}",
                     *(f"{1e3 * r['moe_step_s']:.1f} ({off['moe_step_s'] / r['moe_step_s']:.3f}x, "
                       f"{int(r['migration_relayout'])} relayouts, {int(r['migration_migrate'])} migrations)"
                       for r in (per, spread))])  # fmt: skip
    if body:
        md.append(_table(f"+relayout by DIMM-Link pricing ({_regime(rows, 'ablation')}, batch 512; MoE ms per step)",
                         ["model", "relayout off", "per link (default)", "every link per move"], body))  # fmt: skip


def _contention(rows: Rows, md: list[str]) -> None:
    """Eq. 6 readings: the ablation's first three points under "array" and "channel" contention."""
    body = []
    for m in _models(rows, "contention"):
        for c in ("array", "channel"):
            g = _one(rows, "contention-base", model=m, contention=c, scheduler="gpu-ndp", refinement=False)
            a = _one(rows, "contention", model=m, contention=c, scheduler="trimoe", refinement=False)
            b = _one(rows, "contention", model=m, contention=c, scheduler="trimoe", refinement=True)
            if g is not None and a is not None and b is not None:
                body.append([m, c, f"{1e3 * g['moe_step_s']:.1f}", f"{1e3 * a['moe_step_s']:.1f}",
                             f"{1e3 * b['moe_step_s']:.1f}", f"{g['moe_step_s'] / a['moe_step_s']:.2f}",
                             f"{a['moe_step_s'] / b['moe_step_s']:.2f}", str(int(b["moves"]))])  # fmt: skip
    if body:
        md.append(_table("eq. 6 contention readings (batch 512, relayout on; MoE ms per step)",
                         ["model", "contention", "gpu-ndp", "+cpu", "+refinement", "+cpu gain",
                          "+refinement gain", "refinement moves"], body))  # fmt: skip


def draw(rows: Rows, out: Path) -> list[Path]:
    """Every figure the rows allow, plus OUT/tables.md; returns the files written."""
    plt = pyplot()
    md: list[str] = ["# TriMoE study: numbers behind the figures\n"]
    paths = _systems(rows, plt, out, md)
    paths += _ablation(rows, plt, out, md, "", f", {_regime(rows, 'ablation')} (predictor accuracy ~ the paper's 78%)")
    _links(rows, md)
    paths += _ablation(rows, plt, out, md, "-calm", ", calm presets (predictor ~96%)")
    paths += _sweep_line(rows, plt, out, md, "ndp", "ndp_count", "NDP DIMMs", "fig9a_ndp_count")
    paths += _sweep_line(rows, plt, out, md, "cpu", "cpu_tflops_scale", "CPU TFLOPS scale", "fig9b_cpu_tflops")
    paths += _drift(rows, plt, out, md)
    _contention(rows, md)
    table = out / "tables.md"
    table.write_text("\n".join(md), encoding="utf-8")
    return [*paths, table]


__all__ = ["draw"]
