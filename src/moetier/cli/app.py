"""The `moetier` command line: generate, eval, quantize, calibrate, info; and, registered from
their own modules, profile (cli_profile.py), replay (cli_replay.py), synth (cli_synth.py) and
simulate (cli_simulate.py), report (cli_report.py; generate/eval --run-dir record its input).

Thin by design (DESIGN.md): flags (declared in cli_options.py) map onto the frozen
config dataclasses in moetier.config and the commands call the Python API
(`moetier.load`, `Engine`, `quantize_model`); console output, errors and progress bars
are cli_io.py's, tables cli_format.py's, the engine flags (one
EngineFlags, shared with serve), loading and closing the engine cli_engine.py's.
Invariants:
- every MoetierError, and any OSError on a file named by a flag, becomes one line
  `error: <message>` on stderr and exit code 2, never a traceback; bad flag values
  (an unparseable or negative size, an unknown device) exit 2 with click's message;
- with `--json`, stdout holds exactly one line, a JSON object; tokens, progress and
  tables go to stderr;
- Hugging Face Hub access is offline unless HF_HUB_OFFLINE is set explicitly.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from moetier import __version__
from moetier.cli.console import TokenStream, consoles, emit_json, progress_bar, read_text, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags, engine_session
from moetier.cli.options import (
    Device,
    Dtype,
    GpuMem,
    Groups,
    HostMem,
    JsonOut,
    MaxSeqLen,
    Model,
    QuantDir,
    engine_config,
    parse_groups,
)
from moetier.cli.profile import register as register_profile
from moetier.cli.replay import register as register_replay
from moetier.cli.report import RunDirOpt, RunRecorder, run_trace
from moetier.cli.report import register as register_report
from moetier.cli.serve import register as register_serve
from moetier.cli.simulate import register as register_simulate
from moetier.cli.sweep import register as register_sweep
from moetier.cli.synth import register as register_synth
from moetier.cli.tables import calibration_table, eval_report, generation_report, info_table, quant_table
from moetier.config import SamplingConfig
from moetier.errors import ConfigError


def _offline_by_default() -> None:
    """HF_HUB_OFFLINE=1 unless the user set it. huggingface_hub read the variable when
    `moetier` was imported (before this module ran), so its constant is updated too."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants as hub_constants

    hub_constants.HF_HUB_OFFLINE = True


_offline_by_default()

app = typer.Typer(
    name="moetier",
    help="Run Mixture-of-Experts LMs with expert weights in tiered, budgeted memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


# -- commands ---------------------------------------------------------------------
@app.command()
@engine_flags
def generate(
    model: Model,
    prompt: Annotated[str, typer.Option(help="Prompt text (tokenized without special tokens).")],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate (fewer if EOS comes first).")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1]; used when temperature > 0.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler, for reproducible sampling.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at EOS.")] = False,
    flags: EngineFlags = DEFAULT_FLAGS,
    run_dir: RunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Generate text from a prompt, streaming tokens, then print timing and memory statistics."""
    report, err = consoles(json_out)
    with user_errors():
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
        config = flags.config()
        with flags.session(model, config, err, run_trace(run_dir, flags.trace)) as engine:
            rec = RunRecorder.for_generate(run_dir, engine, model, max_new_tokens)
            stream = TokenStream(engine, sys.stderr if json_out else sys.stdout)
            try:
                result = engine.generate(prompt, max_new_tokens, sampling, on_token=rec.on_token(stream),
                                         stop_at_eos=not ignore_eos)  # fmt: skip
            finally:
                stream.finish()  # ends the line, also before an error message
        payload = {
            "model": str(model), "text": result.text, "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens, "new_tokens": len(result.token_ids),
            "ttft_s": result.ttft_s, "decode_tok_s": result.decode_tok_s, **result.stats,
        }  # fmt: skip
        rec.finish(payload)
        report.print(generation_report(payload))
        if json_out:
            emit_json(payload)


@app.command(name="eval")
@engine_flags
def eval_(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 text file to score.")],
    max_tokens: Annotated[int | None, typer.Option(min=2, help="Score only the first N tokens.")] = None,
    window: Annotated[int, typer.Option(min=0, help="Tokens per window; 0 = the context length, capped at 1024.")] = 0,
    flags: EngineFlags = DEFAULT_FLAGS,
    run_dir: RunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Perplexity of a text file over non-overlapping windows."""
    report, err = consoles(json_out)
    with user_errors():
        config = flags.config()
        body = read_text(text)
        with flags.session(model, config, err, run_trace(run_dir, flags.trace)) as engine:
            rec = RunRecorder.for_eval(run_dir, engine, model)
            ids = engine.encode(body)[:max_tokens]
            t0 = time.perf_counter()
            with progress_bar(err, transient=True) as progress:
                task = progress.add_task(f"scoring {len(ids)} tokens", total=None)
                result = engine.perplexity(ids, window=window, on_window=rec.on_window(
                    lambda done, total: progress.update(task, completed=done, total=total)))  # fmt: skip
            elapsed = time.perf_counter() - t0
        payload = {
            "model": str(model), "text_file": str(text), "ppl": result.ppl, "nll": result.nll,
            "tokens": result.tokens, "eval_s": elapsed,
            "eval_tok_s": result.tokens / elapsed if elapsed > 0 else 0.0,
            **result.stats,
        }  # fmt: skip
        rec.finish(payload)
        if not json_out:
            report.print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens", highlight=False)
        report.print(eval_report(payload))
        if json_out:
            emit_json(payload)


@app.command()
def quantize(
    model: Model,
    precisions: Annotated[str, typer.Option("--precisions", help="Comma-separated, of int8, int4, int2.")] = "int4",
    group: Groups = None,
    out: Annotated[Path | None, typer.Option(metavar="DIR", help="Tier root; default MODEL/moetier-quant.")] = None,
    method: Annotated[str, typer.Option(help="hqq (half-quadratic fit, default) or rtn (round to nearest).")] = "hqq",
    force: Annotated[bool, typer.Option("--force", help="Delete an incompatible existing tier, start over.")] = False,
    for_sparsity: Annotated[bool, typer.Option(
        "--for-sparsity", help="Write the layout --sparsity reads (down projection as rows, quantised along the "
                               "hidden size) to <precision>-g<group>-rows.")] = False,
    json_out: JsonOut = False,
) -> None:
    """Write quantized disk tiers of the routed experts, one per precision (resumable: rerun to go on)."""
    report, err = consoles(json_out)
    with user_errors():
        from moetier.formats.qtier import tier_summary
        from moetier.formats.quantize import quantize_model

        precs = [p.strip() for p in precisions.split(",") if p.strip()]
        groups: dict[str, int | None] = dict(parse_groups(group))
        with progress_bar(err) as progress:
            paths = quantize_model(model, precs, out=out, group_sizes=groups, method=method, progress=progress,
                                   force=force, down_rows=for_sparsity)  # fmt: skip
        rows = [tier_summary(p) | {"path": str(p)} for p in paths]
        report.print(quant_table(rows))
        if json_out:
            emit_json({"model": str(model), "tiers": rows})


@app.command()
def calibrate(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 calibration text (held-out text of the model's domain).")],
    out: Annotated[Path | None, typer.Option(metavar="FILE",
                   help="Where to write the table; default MODEL/moetier-sparsity/thresholds.json.")] = None,
    max_tokens: Annotated[int, typer.Option(min=2, help="Calibrate on the first N tokens.")] = 16384,
    window: Annotated[int, typer.Option(min=0, help="Tokens per forward; 0 = the context length, capped at 1024.")] = 0,
    host_expert_mem: HostMem = None,
    gpu_expert_mem: GpuMem = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_seq_len: MaxSeqLen = 0,
    json_out: JsonOut = False,
) -> None:
    """Thresholds of intra-expert activation sparsity: per MoE layer, target sparsity 0-0.95 -> threshold on
    |act(gate x)| of routed experts (shared experts stay dense)."""
    import hashlib

    report, err = consoles(json_out)
    with user_errors():
        from moetier.formats.checkpoint import CheckpointIndex
        from moetier.formats.qtier import source_fingerprint
        from moetier.kernels.sparse import default_table_path
        from moetier.runtime.calibrate import calibrate as run_calibration
        from moetier.runtime.calibrate import model_identity

        body = read_text(text)
        target = out or default_table_path(model)
        if target.is_dir():
            raise ConfigError(f"--out {target} is a directory; give a file name, e.g. {target / 'thresholds.json'}")
        config = engine_config(host_expert_mem, gpu_expert_mem, device, dtype, "lru", max_seq_len, False)
        with engine_session(model, config, None, False, err) as engine:
            ids = engine.encode(body)[:max_tokens]
            limit = min(int(getattr(engine.loaded.config, "max_position_embeddings", 1024)), 1024,
                        engine.max_len)  # fmt: skip
            win = window or limit
            if win > engine.max_len:
                raise ConfigError(f"--window {win} exceeds the KV cache of {engine.max_len} tokens")
            identity = model_identity(engine.info, source_fingerprint(CheckpointIndex(model))["fingerprint"])
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
        payload = {"model": str(model), "table": str(path), "tokens": len(ids), "window": win,
                   "calibrate_s": elapsed} | table.to_json()  # fmt: skip
        report.print(calibration_table(payload))
        report.print(f"wrote {path}", highlight=False)
        if json_out:
            emit_json(payload)


@app.command()
def info(model: Model, quant_dir: QuantDir = None, json_out: JsonOut = False) -> None:
    """Shape of a checkpoint: family, layers, experts, top-k, sizes, expert and non-expert bytes."""
    report, err = consoles(json_out)
    with user_errors():
        with err.status(f"reading {model}"):
            from moetier.models.open import describe

            described = describe(model)
            data = described.as_dict()
            from moetier.formats.qtier import list_tiers

            tiers = list_tiers(model, root=quant_dir)
            from moetier.formats.checkpoint import CheckpointIndex
            from moetier.formats.qtier import source_fingerprint
            from moetier.kernels.sparse import default_table_path
            from moetier.runtime.calibrate import model_identity, table_summary

            fingerprint = source_fingerprint(CheckpointIndex(model))["fingerprint"]
            sparsity = table_summary(default_table_path(model), model_identity(described, fingerprint))
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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moetier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run Mixture-of-Experts LMs with expert weights in tiered, budgeted memory."""


for _register in (register_profile, register_replay, register_synth, register_simulate, register_sweep):
    _register(app)
register_report(app)
register_serve(app)


def main() -> None:
    """Console-script entry point (`moetier = "moetier.cli.app:main"`)."""
    app()


if __name__ == "__main__":
    main()


__all__ = ["app", "main"]
