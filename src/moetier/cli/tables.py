"""Rich tables for the command line (cli/): generation and eval statistics, model info, and the
metric / value table of `moetier simulate` (cli/simulate.py, cli/simulate_tri.py).

Pure formatting: every function takes plain values (an Engine.stats() dict, a ModelInfo
as a dict) and returns a rich renderable; nothing here loads models or prints.
Sizes show human-readable and exact: `24.00 MiB (25165824 B)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group
from rich.table import Table

from moetier.config import format_size

TIER_NAMES = {"host": "host", "accel": "accelerator"}


def size(nbytes: int | float | None) -> str:
    """'24.00 MiB (25165824 B)'; '-' for None."""
    if nbytes is None:
        return "-"
    return f"{format_size(nbytes)} ({int(nbytes)} B)"


def _kv_table(title: str, rows: Iterable[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def metric_table(title: str, rows: Iterable[tuple[str, str]], caption: str) -> Table:
    """A headed metric / value table (values right-aligned) with `caption` under it, both left-justified."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def tier_table(stats: Mapping[str, Any]) -> Table:
    """One row per expert tier: budget, pool (slots x slot size), peak residency, hits, misses."""
    table = Table(title="expert tiers", title_justify="left")
    for col in ("tier", "budget", "pool", "peak", "hits", "misses", "evicted"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, tier in stats.get("tiers", {}).items():
        slots = int(tier["slots"])
        slot_bytes = int(tier["pool_bytes"]) // slots if slots else 0
        pools = tier.get("pools")  # dynamic precision: one pool per precision
        pool = (
            " + ".join(f"{n} x {format_size(b)} {p}" for p, (n, b) in pools.items())
            if pools else f"{slots} x {format_size(slot_bytes)}"
        )  # fmt: skip
        table.add_row(
            TIER_NAMES.get(name, name),
            format_size(tier["budget_bytes"]),
            pool,
            format_size(tier["peak_resident_bytes"]),
            str(tier["hits"]),
            str(tier["misses"]),
            str(tier["evictions"]),
        )
    return table


def _precision_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Experts and bytes at each precision; promotions and demotions when dynamic."""
    mix = stats.get("precision", {})
    rows = [(f"experts at {p}", f"{m['experts']} ({format_size(m['bytes'])})") for p, m in mix.items()]
    sw = stats.get("switching")
    if sw is not None:
        rows.append(("promotions / demotions", f"{stats.get('promotions', 0)} / {stats.get('demotions', 0)}"))
        rows.append(("precision decisions", f"{sw['decisions']} ({sw['n_hot']} hot slots)"))
        dram = sw.get("dram")
        if dram is not None:
            per = ", ".join(f"{p} {m['hit_rate']:.0%}" for p, m in dram["precisions"].items())
            cached = f"{dram['hit_rate']:.0%} ({per}; {format_size(dram['budget_bytes'])})"
            rows.append(("host DRAM cache hits", cached))
        if sw["mover_errors"]:
            rows.append(("mover errors", f"{len(sw['mover_errors'])}: {sw['mover_errors'][-1]}"))
    return rows


def _sparsity_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    sp = stats.get("sparsity")
    if sp is None:
        return []
    tip = sp["tipping_tokens"]
    return [
        ("sparsity target / achieved", f"{sp['target']:.2f} / {sp['achieved']:.3f}"
                                        + (f" (blocks of {sp['block']})" if sp["block"] > 1 else "")),
        ("gather path below", f"{tip} tokens per expert ({sp['kernel']})"),
    ]  # fmt: skip


def sparsity_table(stats: Mapping[str, Any]) -> Table | None:
    """Achieved sparsity per MoE layer, with the calls each path took."""
    sp = stats.get("sparsity")
    if sp is None:
        return None
    table = Table(title="intra-expert sparsity per MoE layer", title_justify="left")
    for col in ("layer", "threshold", "achieved", "gather calls", "dense calls"):
        table.add_column(col, justify="right")
    for layer, row in sp["layers"].items():
        table.add_row(str(layer), f"{row['threshold']:.4g}", f"{row['achieved']:.3f}", str(row["sparse_calls"]),
                      str(row["dense_calls"]))  # fmt: skip
    return table


def _nearest(values: list[float], x: float) -> int:
    return min(range(len(values)), key=lambda j: abs(values[j] - x))


def calibration_table(payload: Mapping[str, Any]) -> Table:
    """`moetier calibrate`: thresholds per MoE layer at a few targets (block 1)."""
    targets = [float(t) for t in payload["targets"]]
    shown = [t for t in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95) if any(abs(t - x) < 1e-9 for x in targets)]
    table = Table(title=f"sparsity thresholds ({payload['tokens']} tokens)", title_justify="left")
    table.add_column("layer", justify="right")
    for t in shown:
        table.add_column(f"s={t:g}", justify="right")
    table.add_column("pairs", justify="right")
    pairs = payload.get("calibration", {}).get("pairs", {})
    for layer, rows in payload["thresholds"].items():
        row = rows.get("1") or next(iter(rows.values()))
        vals = [row[_nearest(targets, t)] for t in shown]
        table.add_row(str(layer), *(f"{v:.4g}" for v in vals), str(pairs.get(str(layer), "")))
    return table


def _cache_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Hit rate and policy; prefetch accuracy (overall, with the predictor that ran, and per distance) and
    outcome; the hybrid split when it ran."""
    rows = [("expert hit rate", f"{stats.get('hit_rate', 0.0):.1%} ({stats.get('cache_policy', '?')})")]
    pf = stats.get("prefetch")
    if pf is not None:
        pred = f"{pf['predictor']}, depth {pf['depth']}"  # the predictor that ran (runtime/prefetch.py PREDICTORS)
        rows.append(("prefetch accuracy", f"{pf['accuracy']:.1%} of {pf['predicted']} predicted ({pred})"))
        by_d = pf["accuracy_by_distance"]  # "d" -> accuracy of the predictions made d MoE layers ahead
        if by_d:
            rows.append(("prefetch accuracy by distance", ", ".join(f"d={d} {a:.1%}" for d, a in by_d.items())))
        rows.append(("prefetched used / issued", f"{pf['used']} / {pf['issued']} ({pf['wasted']} evicted unused, "
                                                 f"{pf['failed']} failed, {pf['waits']} waited on)"))  # fmt: skip
        if pf["errors"]:
            rows.append(("prefetch errors", pf["errors"][-1]))
    hy = stats.get("hybrid_stats")
    if hy is not None:
        rows.append(("hybrid tasks gpu / cpu", f"{hy['accel_tasks']} / {hy['host_tasks']} ({stats['scheduler']})"))
    return rows


def _disk_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    """How experts were read (formats/diskio.py): O_DIRECT, or buffered and why."""
    io = stats.get("disk_io")
    if io is None:
        return []
    rows = [("disk reads", f"{io['mode']}, {io['depth']} in flight")]
    if io["fallback"]:
        rows.append(("disk reads fallback", str(io["fallback"])))
    return rows


def _engine_rows(stats: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [
        *_precision_rows(stats),
        *_sparsity_rows(stats),
        *_cache_rows(stats),
        ("expert hits / misses", f"{stats['hits']} / {stats['misses']}"),
        ("bytes read from disk", size(stats["disk_bytes"])),
        *_disk_rows(stats),
        ("bytes host -> accelerator", size(stats["h2d_bytes"])),
        ("peak host expert bytes", size(stats["peak_host_expert_bytes"])),
        ("peak accelerator expert bytes", size(stats["peak_accel_expert_bytes"])),
        ("staging buffer", size(stats["staging_bytes"])),
        ("decoder / device / dtype", f"{stats['decoder']} / {stats['device']} / {stats['dtype']}"),
    ]


def generation_report(payload: Mapping[str, Any]) -> Group:
    """Stats after `moetier generate`; `payload` is the command's JSON object."""
    rows = [
        ("time to first token", f"{payload['ttft_s']:.3f} s"),
        ("decode speed", f"{payload['decode_tok_s']:.2f} tok/s"),
        ("prompt tokens", str(payload["prompt_tokens"])),
        ("new tokens", str(payload["new_tokens"])),
        *_engine_rows(payload),
    ]
    return Group(_kv_table("generation", rows), tier_table(payload), *_optional(sparsity_table(payload)))


def eval_report(payload: Mapping[str, Any]) -> Group:
    """Stats after `moetier eval`; `payload` is the command's JSON object."""
    rows = [
        ("perplexity", f"{payload['ppl']:.4f}"),
        ("mean NLL (nats/token)", f"{payload['nll']:.4f}"),
        ("tokens scored", str(payload["tokens"])),
        ("wall time", f"{payload['eval_s']:.3f} s ({payload['eval_tok_s']:.1f} tok/s)"),
        *_engine_rows(payload),
    ]
    return Group(_kv_table("evaluation", rows), tier_table(payload), *_optional(sparsity_table(payload)))


def _optional(table: Table | None) -> list[Table]:
    return [table] if table is not None else []


def info_table(info: Mapping[str, Any]) -> Table:
    """`moetier info`: the shape of a checkpoint and its expert bytes."""
    moe_layers = list(info["moe_layers"])
    shown = ", ".join(map(str, moe_layers)) if len(moe_layers) <= 16 else f"{moe_layers[0]}..{moe_layers[-1]}"
    rows = [
        ("path", str(info["path"])),
        ("family", str(info["family"])),
        ("architecture", str(info["architecture"])),
        ("layers", str(info["num_layers"])),
        ("MoE layers", f"{len(moe_layers)} ({shown})"),
        ("routed experts per MoE layer", str(info["num_experts"])),
        ("experts per token (top-k)", str(info["top_k"])),
        ("hidden size", str(info["hidden_size"])),
        ("expert intermediate size", str(info["expert_intermediate"])),
        ("checkpoint dtype", str(info["checkpoint_dtype"])),
        ("bytes per expert", size(info["expert_bytes"])),
        ("total routed expert bytes", size(info["total_expert_bytes"])),
        ("non-expert bytes", size(info["non_expert_bytes"])),
    ]
    return _kv_table("model", rows)


def quant_table(tiers: Iterable[Mapping[str, Any]]) -> Table:
    """`moetier quantize`: one row per quantized disk tier, with its relative weight error."""
    table = Table(title="quantized tiers", title_justify="left")
    for col in ("precision", "layout", "groups (w13 / w2)", "size", "rel. error w13", "rel. error w2", "status",
                "path"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("precision", "layout", "status", "path") else "right")
    for t in tiers:
        gs, err, types = t.get("group_sizes", {}), t.get("error", {}), t.get("types") or {}
        groups = f"{gs.get('w13', '?')} / {gs.get('w2', '?')}"
        if types:  # a ggml block precision: its blocks are its groups, of the type each matrix takes
            groups = f"{types.get('w13', '?')} / {types.get('w2', '?')}"
        table.add_row(
            str(t["precision"]), str(t.get("layout", "packed")), groups,
            format_size(t.get("bytes", 0)),
            f"{err.get('w13', float('nan')):.4f}", f"{err.get('w2', float('nan')):.4f}",
            str(t.get("status", "ok" if t.get("complete") else "incomplete")), str(t["path"]),
        )  # fmt: skip
    return table
