"""`moetier quantize MODEL`: write quantized disk tiers of the routed experts, one per precision (resumable).

Registered on the main app by cli/app.py (`register(app)`). Thin: the flags go to
formats.quantize.quantize_model under a progress bar on stderr; the tiers written are summarised in a table.

Invariants (cli/app.py's): errors are one line `error: ...` with exit 2; with --json stdout holds exactly one
JSON line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetier.cli.console import consoles, emit_json, progress_bar, register_command, user_errors
from moetier.cli.model_arg import open_model
from moetier.cli.options import Groups, JsonOut, Model, parse_groups
from moetier.cli.tables import quant_table
from moetier.formats.qtier import tier_summary
from moetier.formats.quant import DEFAULT_METHOD
from moetier.formats.quantize import quantize_model


def quantize(
    model: Model,
    precisions: Annotated[
        str,
        typer.Option(
            "--precisions",
            help="Comma-separated, of int8, int4, int2 (our groups) and q6_k, q5_k, q4_k, iq4_xs, q3_k, q2_k "
            "(ggml's block types, by ggml's own quantiser; docs/precision.md compares them).",
        ),
    ] = "int4",
    group: Groups = None,
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Tier root; default MODEL/moetier-quant (for a hub id: CACHE/hub/OWNER--NAME/moetier-quant).",
        ),
    ] = None,
    method: Annotated[
        str,
        typer.Option(
            help="search (scale search with least-squares refits, default), hqq (the earlier range search + "
            "half-quadratic zero solve: slower, no better) or rtn (min/max, round to nearest); int8, int4 and int2 "
            "only: the ggml block types are quantised by ggml."
        ),
    ] = DEFAULT_METHOD,
    force: Annotated[bool, typer.Option("--force", help="Delete an incompatible existing tier, start over.")] = False,
    for_sparsity: Annotated[
        bool,
        typer.Option(
            "--for-sparsity",
            help="Write the layout --sparsity reads (down projection as rows, quantised along the "
            "hidden size) to <precision>-g<group>-rows.",
        ),
    ] = False,
    json_out: JsonOut = False,
) -> None:
    """Write quantized disk tiers of the routed experts, one per precision (resumable: rerun to go on)."""
    report, err = consoles(json_out)
    with user_errors():
        precs = [p.strip() for p in precisions.split(",") if p.strip()]
        arg = open_model(model, err)
        groups: dict[str, int | None] = dict(parse_groups(group))
        with progress_bar(err) as progress:
            paths = quantize_model(arg.path, precs, out=out or arg.quant_root, group_sizes=groups, method=method,
                                   progress=progress, force=force, down_rows=for_sparsity)  # fmt: skip
        rows = [tier_summary(p) | {"path": str(p)} for p in paths]
        report.print(quant_table(rows))
        if json_out:
            emit_json({"model": arg.label, "tiers": rows})


def register(app: typer.Typer) -> None:
    """Add `moetier quantize` to `app` (once)."""
    register_command(app, "quantize", quantize)


__all__ = ["quantize", "register"]
