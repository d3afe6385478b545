"""`moetier info MODEL`: the shape of a checkpoint, its quantized tiers and its sparsity table.

Registered on the main app by cli/app.py (`register(app)`). Opens the checkpoint as the engine does
(models.open.open_checkpoint: config.json, every safetensors header, every expert and non-expert tensor's shape
and dtype, leftovers), so a checkpoint `generate` refuses is refused here with the same message; no expert pool
is allocated and no model weight is loaded. Each quantized tier gets the checks loading it makes
(formats/qtier.list_tiers with the model's shape, sha256 of its layer files included: a full read of each
tier), and is listed as ok, incomplete, stale, damaged or unreadable, with the reason.

Invariants (cli/app.py's): errors are one line `error: ...` with exit 2; with --json stdout holds exactly one
JSON line. A broken checkpoint is such an error; a tier that is not ok is not (the model itself loads), it is
listed with its status and reason.
"""

from __future__ import annotations

import torch
import typer

from moetier.cli.console import consoles, emit_json, register_command, user_errors
from moetier.cli.model_arg import open_model
from moetier.cli.options import JsonOut, Model, QuantDir
from moetier.cli.tables import info_table, quant_table
from moetier.formats.qtier import SourceShape, list_tiers, source_fingerprint
from moetier.models.open import model_info, open_checkpoint
from moetier.runtime.calibrate import model_identity, table_summary


def info(model: Model, quant_dir: QuantDir = None, json_out: JsonOut = False) -> None:
    """Shape of a checkpoint: family, layers, experts, top-k, sizes, expert and non-expert bytes; its quantized
    tiers and sparsity table.

    The checkpoint gets every check loading it makes: one that `moetier generate` would refuse is reported as
    `error: <the same message>` with exit 2. Quantized tiers are checked as loading them checks them (layer files
    hashed): each is listed as ok, incomplete, stale, damaged or unreadable, with the reason (exit 0)."""
    report, err = consoles(json_out)
    with user_errors():
        arg = open_model(model, err)
        with err.status(f"reading {arg.label}"):
            # 1. the checkpoint, as the engine opens it (models.open: every tensor's header checked)
            opened = open_checkpoint(arg.path, "auto", torch.device("cpu"))
            try:
                described = model_info(arg.path, opened)
                # 2. the tiers, with the checks QuantTier.open makes against this model
                tiers = list_tiers(arg.path, root=quant_dir or arg.quant_root, index=opened.index,
                                   shape=SourceShape.of(opened.reader), verify=True)  # fmt: skip
            finally:
                opened.reader.close()
            data = described.as_dict()
            fingerprint = source_fingerprint(opened.index)["fingerprint"]
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
            for t in tiers:
                if t.get("reason"):
                    report.print(f"{t['path']}: {t['status']}: {t['reason']}", highlight=False, soft_wrap=True)
            if sparsity is not None:
                tokens = f", calibrated on {sparsity['tokens']} tokens" if sparsity.get("tokens") else ""
                report.print(f"sparsity table: {sparsity['path']}{tokens}: {sparsity['status']}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `moetier info` to `app` (once)."""
    register_command(app, "info", info)


__all__ = ["info", "register"]
