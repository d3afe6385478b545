"""`moetier prune MODEL --text FILE --fraction F --out FILE`: the least salient routed experts of each MoE layer.

Registered on the main app by cli/app.py (`register(app)`). Thin: loads the engine (full routing, full precision,
the given budgets), runs runtime.prune's REAP saliency over the text under a progress bar on stderr, and writes the
pruning file (runtime/route_override.py PruneFile) that `generate` / `eval` / `serve --prune FILE` load: the
router then chooses among the remaining experts and the pruned ones are never read.

Invariants (cli/app.py's): errors (--out naming a folder, a fraction outside (0, 1), a --window past the KV cache)
are one line `error: ...` with exit 2; with --json stdout holds exactly one JSON line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import typer

from moetier.cli.console import consoles, emit_json, progress_bar, read_text, register_command, user_errors
from moetier.cli.engine_flags import engine_session
from moetier.cli.model_arg import open_model
from moetier.cli.options import Device, Dtype, GpuMem, HostMem, JsonOut, MaxSeqLen, Model, engine_config
from moetier.errors import ConfigError
from moetier.runtime.prune import model_shape, prune_table, saliency
from moetier.runtime.route_override import PruneFile


def prune(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 calibration text (held-out text of the model's domain).")],
    out: Annotated[Path, typer.Option(metavar="FILE", help="Where to write the pruning file (JSON).")],
    fraction: Annotated[float, typer.Option(help="Fraction of each MoE layer's routed experts to prune, in (0, 1) "
                                                 "(at most E - top-k of them).")] = 0.25,
    max_tokens: Annotated[int, typer.Option(min=2, help="Calibrate on the first N tokens.")] = 16384,
    window: Annotated[int, typer.Option(min=0, help="Tokens per forward; 0 = the context length, capped at 1024.")] = 0,
    host_expert_mem: HostMem = None,
    gpu_expert_mem: GpuMem = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_seq_len: MaxSeqLen = 0,
    json_out: JsonOut = False,
) -> None:
    """Prune the least salient routed experts of each MoE layer by REAP's saliency (gate weight x output norm,
    averaged over the tokens routed to the expert) on calibration text; writes the file --prune reads."""
    report, err = consoles(json_out)
    with user_errors():
        if not 0.0 < fraction < 1.0:
            raise ConfigError(f"--fraction must be in (0, 1), got {fraction}")
        if out.is_dir():
            raise ConfigError(f"--out {out} is a directory; give a file name, e.g. {out / 'pruned.json'}")
        body = read_text(text)
        arg = open_model(model, err)
        config = engine_config(host_expert_mem, gpu_expert_mem, device, dtype, "lru", max_seq_len, False)
        with engine_session(arg.path, config, None, False, err) as engine:
            ids = engine.encode(body)[:max_tokens]
            limit = min(int(getattr(engine.loaded.config, "max_position_embeddings", 1024)), 1024,
                        engine.max_len)  # fmt: skip
            win = window or limit
            if win > engine.max_len:
                raise ConfigError(f"--window {win} exceeds the KV cache of {engine.max_len} tokens")
            with progress_bar(err, transient=True) as progress:
                task = progress.add_task(f"expert saliency on {len(ids)} tokens", total=None)
                scores = saliency(engine, ids, win,
                                  lambda done, total: progress.update(task, completed=done, total=total))  # fmt: skip
            info = engine.info
            pruned = prune_table(scores, fraction, info.top_k)
        meta = {
            "model": model_shape(info), "method": "reap", "fraction": fraction,
            "calibration": {"text": str(text), "sha256": hashlib.sha256(body.encode()).hexdigest(), "tokens": len(ids),
                            "window": win},
            "saliency": {str(k): [round(float(v), 6) for v in s] for k, s in sorted(scores.items())},
        }  # fmt: skip
        path = PruneFile.write(out, pruned, meta)
        n = sum(len(v) for v in pruned.values())
        total = info.num_experts * len(pruned)
        report.print(f"pruned {n} of {total} routed experts ({fraction:g} of each MoE layer's {info.num_experts}); "
                     f"wrote {path}", highlight=False)  # fmt: skip
        if json_out:
            emit_json({"model": arg.label, "out": str(path), "fraction": fraction, "tokens": len(ids),
                       "pruned": {str(k): v for k, v in sorted(pruned.items())}})  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add `moetier prune` to `app` (once)."""
    register_command(app, "prune", prune)


__all__ = ["prune", "register"]
