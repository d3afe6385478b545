"""`moetier info MODEL`: the shape of a checkpoint, its quantized tiers and its sparsity table.

Registered on the main app by cli/app.py (`register(app)`). Reads config.json and the safetensors headers only
(models.open.describe): no expert pool is allocated and no weight is loaded.

Invariants (cli/app.py's): errors are one line `error: ...` with exit 2; with --json stdout holds exactly one
JSON line.
"""

from __future__ import annotations

import typer

from moetier.cli.console import consoles, emit_json, register_command, user_errors
from moetier.cli.model_arg import open_model
from moetier.cli.options import JsonOut, Model, QuantDir
from moetier.cli.tables import info_table, quant_table
from moetier.formats.qtier import list_tiers, source_fingerprint
from moetier.models.open import describe, open_index
from moetier.runtime.calibrate import model_identity, table_summary


def info(model: Model, quant_dir: QuantDir = None, json_out: JsonOut = False) -> None:
    """Shape of a checkpoint: family, layers, experts, top-k, sizes, expert and non-expert bytes."""
    report, err = consoles(json_out)
    with user_errors():
        arg = open_model(model, err)
        with err.status(f"reading {arg.label}"):
            described = describe(arg.path)
            data = described.as_dict()
            index = open_index(arg.path)
            tiers = list_tiers(arg.path, root=quant_dir or arg.quant_root, index=index)
            fingerprint = source_fingerprint(index)["fingerprint"]
            sparsity = table_summary(arg.sparsity_table, model_identity(described, fingerprint))
        data["sparsity_table"] = sparsity
        data["moe_layers"] = list(data["moe_layers"])
        data["total_params_bytes"] = data["total_expert_bytes"] + data["non_expert_bytes"]
        data["quantized_tiers"] = tiers
        if json_out:
            emit_json(data)
        else:
            report.print(info_table(data))
            if tiers:
                report.print(quant_table(tiers))
            if sparsity is not None:
                tokens = f", calibrated on {sparsity['tokens']} tokens" if sparsity.get("tokens") else ""
                report.print(f"sparsity table: {sparsity['path']}{tokens}: {sparsity['status']}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `moetier info` to `app` (once)."""
    register_command(app, "info", info)


__all__ = ["info", "register"]
