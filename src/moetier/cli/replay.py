"""`moetier replay`: hit rates of cache policies on a recorded or synthetic routing trace.

Registered on the main app by cli/app.py (`register(app)`). Thin: it parses the flags,
calls moetier.sim.cache_replay (one policy after another, a progress bar on stderr) and prints a
rich table (per layer, overall, decode only; one hit-rate column per policy) or, with --json, one
JSON line.

Invariants (as cli/app.py): bad input (a missing or non-trace file, a ratio outside (0, 1], an
unknown policy, --alpha/--top-p without mrs) is one line `error: ...` on stderr and exit 2;
with --json stdout holds exactly one JSON line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier import traces
from moetier.cli.console import consoles, emit_json, progress_bar, register_command, require_trace, user_errors
from moetier.cli.options import JsonOut
from moetier.errors import ConfigError, TraceError
from moetier.sim.cache_replay import parse_policies, replay, slots_for, trace_layers

PolicyOpt = Annotated[
    str,
    typer.Option("--cache-policy", help="lru, lfu, mrs, belady; a comma-separated list, or all, to compare."),
]
RatioOpt = Annotated[
    float, typer.Option("--cache-ratio", help="Cache size as a fraction in (0, 1] of all routed experts of all layers.")
]
AlphaOpt = Annotated[float | None, typer.Option("--alpha", help="MRS averaging coefficient in (0, 1].")]
TopPOpt = Annotated[int | None, typer.Option("--top-p", help="MRS: experts whose scores count per call (default 2k).")]
PerLayerOpt = Annotated[
    bool,
    typer.Option("--per-layer", help="One cache per MoE layer of floor(ratio x E) slots, not one global cache."),
]


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def replay_table(results: list[dict[str, Any]]) -> Table:
    """Rows: each layer, all calls, decode calls; columns: accesses, then one hit rate per policy."""
    first = results[0]
    table = Table(
        title=f"cache hit rate, {first['slots']} of {first['total_experts']} experts cached "
        f"(ratio {first['cache_ratio']:g}{', per-layer caches' if first.get('per_layer_caches') else ''})",
        title_justify="left",
    )
    table.add_column("layer")
    table.add_column("accesses", justify="right")
    for res in results:
        table.add_column(res["policy"], justify="right")
    for layer, cell in first["per_layer"].items():
        table.add_row(layer, str(cell["accesses"]), *(_pct(r["per_layer"][layer]["hit_rate"]) for r in results))
    table.add_section()
    table.add_row("all", str(first["accesses"]), *(_pct(r["hit_rate"]) for r in results), style="bold")
    table.add_row("decode", str(first["decode_accesses"]), *(_pct(r["decode_hit_rate"]) for r in results))
    return table


def replay_cmd(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="Routing trace (.parquet) recorded with --trace.")],
    cache_policy: PolicyOpt = "lru",
    cache_ratio: RatioOpt = 0.25,
    alpha: AlphaOpt = None,
    top_p: TopPOpt = None,
    per_layer: PerLayerOpt = False,
    json_out: JsonOut = False,
) -> None:
    """Replay a routing trace through cache policies: hit rate per layer, overall and in decode."""
    report, err = consoles(json_out)
    with user_errors():
        # 1. flags
        policies = parse_policies(cache_policy)
        slots_for(cache_ratio, 1)  # range check before reading the trace
        knobs: dict[str, Any] = {k: v for k, v in (("alpha", alpha), ("top_p", top_p)) if v is not None}
        if knobs and "mrs" not in policies:
            raise ConfigError(f"only mrs takes {', '.join('--' + k.replace('_', '-') for k in knobs)}")
        # 2. the trace
        require_trace(trace)
        loaded = traces.load(trace)
        calls = traces.iter_calls(loaded)
        if not calls:
            raise TraceError(f"{trace}: the trace holds no layer calls")
        meta = loaded.metadata
        # 3. replay each policy, under a progress bar (stderr)
        results = []
        with progress_bar(err, transient=True) as progress:
            task = progress.add_task(f"replaying {len(calls)} calls", total=len(policies))
            for name in policies:
                progress.update(task, description=f"replaying {len(calls)} calls: {name}")
                results.append(replay(
                    calls, name, cache_ratio, num_experts=int(meta["num_experts"]), top_k=int(meta["top_k"]),
                    layers=trace_layers(loaded), per_layer=per_layer, **(knobs if name == "mrs" else {}),
                ).as_dict())  # fmt: skip
                progress.advance(task)
        # 4. report
        if results[0]["scores"] == "weights":
            err.print("note: the trace has no router scores; MRS ranks by the top-k gate weights", highlight=False)
        report.print(replay_table(results))
        if json_out:
            emit_json({
                "trace": str(trace), "model": meta.get("model"), "cache_ratio": cache_ratio,
                "slots": results[0]["slots"], "total_experts": results[0]["total_experts"],
                "scores": results[0]["scores"], "calls": len(calls), "policies": policies, "per_layer": per_layer,
                "hit_rate": {r["policy"]: r["hit_rate"] for r in results},
                "decode_hit_rate": {r["policy"]: r["decode_hit_rate"] for r in results},
                "results": {r["policy"]: r for r in results},
            })  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add `moetier replay` to `app` (once)."""
    register_command(app, "replay", replay_cmd)


__all__ = ["register", "replay_cmd", "replay_table"]
