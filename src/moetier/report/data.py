"""The numbers behind each figure of `moetier report`, from a ReportInput (report/load.py).

Each function returns its data, or a `Skip` whose reason the HTML index prints in place of the figure
(e.g. "no precision data: run was not --precision dynamic"). Pure numpy over the trace and the JSON
documents: no plotting, no torch.

Invariants: activation shares of a layer sum to 1 over its experts (a layer with no calls is left
out); hit-rate curves replay a fresh cache per (policy, ratio) with moetier.sim.cache_replay, so a
point equals what `moetier replay --cache-policy P --cache-ratio R` prints for the same trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetier import traces
from moetier.errors import TraceError
from moetier.report.load import ReportInput
from moetier.sim.cache_replay import replay, trace_layers


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Activation:
    layers: tuple[int, ...]
    share: Any  # np.ndarray float64 [L, E]: token share of each expert in its layer
    tokens: Any  # np.ndarray int64 [L]: routed tokens per layer


@dataclass(frozen=True)
class PrecisionSeries:
    steps: tuple[int, ...]
    experts: dict[str, tuple[int, ...]]  # precision -> experts held at it, per sample
    promotions: tuple[int, ...]  # cumulative
    demotions: tuple[int, ...]
    unit: str  # "tokens generated" | "windows"


def activation(inp: ReportInput) -> Activation | Skip:
    """Token share per (layer, expert) over the whole trace (prefill and decode rows)."""
    if inp.trace is None:
        return Skip(f"no routing trace: {_why_no_trace(inp)}")
    t = inp.trace.table
    if t.num_rows == 0:
        return Skip("no routing trace: the trace holds no rows")
    num_experts = int(inp.trace.metadata["num_experts"])
    col = t.column("experts").combine_chunks()
    layer = t.column("layer").to_numpy().astype(np.int64)  # [N]
    ids = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)  # [N*k]
    lens = col.value_lengths().to_numpy(zero_copy_only=False)  # [N]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise TraceError(f"{inp.trace_path}: expert id out of range [0, {num_experts})")
    uniq = np.unique(layer)  # [L] ascending
    li = np.searchsorted(uniq, np.repeat(layer, lens))  # [N*k] layer index of each routed slot
    counts = np.bincount(li * num_experts + ids, minlength=len(uniq) * num_experts)  # [L*E]
    counts = counts.reshape(len(uniq), num_experts).astype(np.float64)  # [L, E]
    tokens = np.bincount(np.searchsorted(uniq, layer), minlength=len(uniq))  # [L]
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)  # [L, E]
    return Activation(tuple(int(x) for x in uniq), share, tokens)


def _why_no_trace(inp: ReportInput) -> str:
    if inp.kind == "simulation" and inp.trace_path is None:
        return "the simulation replayed a synthetic trace, which is not saved (simulate --trace FILE is)"
    return f"{inp.trace_path} is missing"


def hit_curves(
    inp: ReportInput, ratios: Sequence[float], policies: Sequence[str],
    on_point: Callable[[str, float], None] | None = None,
) -> dict[str, list[dict[str, float]]] | Skip:  # fmt: skip
    """policy -> [{ratio, hit_rate, decode_hit_rate}] by replaying the trace once per (policy, ratio)."""
    if inp.trace is None:
        return Skip(f"no routing trace: {_why_no_trace(inp)}")
    calls = traces.iter_calls(inp.trace)
    if not calls:
        return Skip("no routing trace: the trace holds no layer calls")
    meta = inp.trace.metadata
    num_experts, top_k, layers = int(meta["num_experts"]), int(meta["top_k"]), trace_layers(inp.trace)
    out: dict[str, list[dict[str, float]]] = {}
    for policy in policies:
        for ratio in ratios:
            res = replay(calls, policy, ratio, num_experts=num_experts, top_k=top_k, layers=layers)
            out.setdefault(policy, []).append(
                {"ratio": float(ratio), "hit_rate": res.hit_rate, "decode_hit_rate": res.decode_hit_rate}
            )
            if on_point is not None:
                on_point(policy, ratio)
    return out


def _config(inp: ReportInput, section: str) -> dict[str, Any]:
    cfg = inp.run.get("config")
    sec = cfg.get(section) if isinstance(cfg, dict) else None
    return sec if isinstance(sec, dict) else {}


def precision_series(inp: ReportInput) -> PrecisionSeries | Skip:
    """Precision mix and cumulative promotions/demotions per stats.jsonl line (dynamic-precision runs)."""
    if inp.kind != "run":
        return Skip(f"no precision data: the input is a {inp.kind}, not a run directory")
    mode = _config(inp, "precision").get("mode", "full")
    if mode != "dynamic":
        return Skip(f"no precision data: run was not --precision dynamic (precision {mode})")
    rows = [r for r in inp.stats if isinstance(r.get("precision"), dict)]
    if not rows:
        return Skip("no precision data: the run's stats.jsonl holds no lines")
    names = sorted({p for r in rows for p in r["precision"]})
    return PrecisionSeries(
        steps=tuple(int(r["step"]) for r in rows),
        experts={p: tuple(int(r["precision"].get(p, 0)) for r in rows) for p in names},
        promotions=tuple(int(r.get("promotions", 0)) for r in rows),
        demotions=tuple(int(r.get("demotions", 0)) for r in rows),
        unit="windows" if inp.run.get("command") == "eval" else "tokens generated",
    )


def sparsity_layers(inp: ReportInput) -> tuple[dict[str, float], float] | Skip:
    """({layer: achieved sparsity}, target) from the run's final stats (runs with --sparsity)."""
    if inp.kind != "run":
        return Skip(f"no sparsity data: the input is a {inp.kind}, not a run directory")
    sp = inp.run.get("result", {}).get("sparsity")
    if not isinstance(sp, dict) or not isinstance(sp.get("layers"), dict) or not sp["layers"]:
        return Skip("no sparsity data: run was not --sparsity (target 0)")
    layers = {str(k): float(v["achieved"]) for k, v in sp["layers"].items()}
    return layers, float(sp.get("target", 0.0))


def numbers(inp: ReportInput) -> list[tuple[str, str]]:
    """The small table of the index: what the input is and its headline numbers."""
    rows: list[tuple[str, str]] = [("input", f"{inp.kind}: {inp.path}")]
    if inp.trace is not None:
        meta = inp.trace.metadata
        rows += [("model", str(meta.get("model"))), ("experts / top-k", f"{meta['num_experts']} / {meta['top_k']}"),
                 ("trace rows", str(len(inp.trace)))]  # fmt: skip
    res = inp.run.get("result", {}) if isinstance(inp.run.get("result"), dict) else {}
    if inp.kind == "run":
        rows.append(("command", str(inp.run.get("command"))))
        for key, fmt in (("new_tokens", "{}"), ("decode_tok_s", "{:.2f}"), ("ppl", "{:.4f}"), ("tokens", "{}"),
                         ("hit_rate", "{:.3f}"), ("promotions", "{}"), ("demotions", "{}")):  # fmt: skip
            if isinstance(res.get(key), int | float):
                rows.append((key, fmt.format(res[key])))
        if isinstance(res.get("sparsity"), dict):
            rows.append(("sparsity target / achieved", f"{res['sparsity']['target']} / {res['sparsity']['achieved']}"))
    if inp.kind == "simulation":
        rows.append(("source", str(inp.run.get("source"))))
        for key in ("spec", "profile", "scheduler", "cache_policy", "cache_ratio"):
            if key in res:
                rows.append((key, str(res[key])))
        for key, scale, fmt in (("ttft_s", 1e3, "{:.3f} ms"), ("tbt_s", 1e3, "{:.3f} ms"),
                                ("throughput_tok_s", 1.0, "{:.1f} tok/s")):  # fmt: skip
            if isinstance(res.get(key), int | float):
                rows.append((key.removesuffix("_s").removesuffix("_tok"), fmt.format(res[key] * scale)))
        if isinstance(res.get("hit_rate"), int | float):
            rows.append(("hit_rate", f"{res['hit_rate']:.3f}"))
    return rows


__all__ = [
    "Activation",
    "PrecisionSeries",
    "Skip",
    "activation",
    "hit_curves",
    "numbers",
    "precision_series",
    "sparsity_layers",
]
