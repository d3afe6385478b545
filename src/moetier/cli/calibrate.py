"""`moetier calibrate MODEL --text FILE`: the thresholds of intra-expert activation sparsity, per MoE layer.

Registered on the main app by cli/app.py (`register(app)`). Thin: loads the engine (full precision, the given
budgets), runs runtime.calibrate over the text under a progress bar on stderr, and writes the table (default
MODEL/moetier-sparsity/thresholds.json, kernels.sparse.default_table_path; for a hub id under its cache folder,
cli/model_arg.py) keyed by the model's identity.

Invariants (cli/app.py's): errors (--out naming a folder, a --window past the KV cache) are one line
`error: ...` with exit 2; with --json stdout holds exactly one JSON line.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Annotated

import typer

from moetier.cli.console import consoles, emit_json, progress_bar, read_text, register_command, user_errors
from moetier.cli.engine_flags import engine_session
from moetier.cli.model_arg import open_model
from moetier.cli.options import Device, Dtype, GpuMem, HostMem, JsonOut, MaxSeqLen, Model, engine_config
from moetier.cli.tables import calibration_table
from moetier.errors import ConfigError
from moetier.formats.qtier import source_fingerprint
from moetier.models.open import open_index
from moetier.runtime.calibrate import calibrate as run_calibration
from moetier.runtime.calibrate import model_identity


def calibrate(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 calibration text (held-out text of the model's domain).")],
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Where to write the table; default MODEL/moetier-sparsity/thresholds.json "
            "(for a hub id: CACHE/hub/OWNER--NAME/moetier-sparsity/thresholds.json).",
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=2, help="Calibrate on the first N tokens.")] = 16384,
    window: Annotated[int, typer.Option(min=0, help="Tokens per forward; 0 = the context length, capped at 1024.")] = 0,
    host_expert_mem: HostMem = None,
    gpu_expert_mem: GpuMem = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_seq_len: MaxSeqLen = 0,
    json_out: JsonOut = False,
) -> None:
    """Thresholds of intra-expert activation sparsity: per MoE layer, routed-expert sparsity 0-0.99 -> threshold
    on |act(gate x)| of routed experts (shared experts stay dense; the engine turns a total target into a
    routed one)."""
    report, err = consoles(json_out)
    with user_errors():
        body = read_text(text)
        arg = open_model(model, err)
        target = out or arg.sparsity_table
        if target.is_dir():
            raise ConfigError(f"--out {target} is a directory; give a file name, e.g. {target / 'thresholds.json'}")
        config = engine_config(host_expert_mem, gpu_expert_mem, device, dtype, "lru", max_seq_len, False)
        with engine_session(arg.path, config, None, False, err) as engine:
            ids = engine.encode(body)[:max_tokens]
            limit = min(int(getattr(engine.loaded.config, "max_position_embeddings", 1024)), 1024,
                        engine.max_len)  # fmt: skip
            win = window or limit
            if win > engine.max_len:
                raise ConfigError(f"--window {win} exceeds the KV cache of {engine.max_len} tokens")
            identity = model_identity(engine.info, source_fingerprint(open_index(arg.path))["fingerprint"])
            meta = {"text": str(text), "sha256": hashlib.sha256(body.encode()).hexdigest()}
            act = str(getattr(engine.loaded.config, "hidden_act", "?"))
            t0 = time.perf_counter()
            with progress_bar(err, transient=True) as progress:
                task = progress.add_task(f"calibrating on {len(ids)} tokens", total=None)
                table = run_calibration(
                    engine, ids, win, identity, act, meta,
                    on_window=lambda done, total: progress.update(task, completed=done, total=total),
                )  # fmt: skip
            elapsed = time.perf_counter() - t0
        path = table.save(target)
        payload = {"model": arg.label, "table": str(path), "tokens": len(ids), "window": win,
                   "calibrate_s": elapsed} | table.to_json()  # fmt: skip
        report.print(calibration_table(payload))
        report.print(f"wrote {path}", highlight=False)
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier calibrate` to `app` (once)."""
    register_command(app, "calibrate", calibrate)


__all__ = ["calibrate", "register"]
