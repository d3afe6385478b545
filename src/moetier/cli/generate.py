"""`moetier generate MODEL --prompt TEXT`: stream generated text, then timing and memory statistics.

Registered on the main app by cli/app.py (`register(app)`). Thin: the engine flags (engine_flags.EngineFlags)
map onto the EngineConfig, the sampling flags onto SamplingConfig; `--run-dir` records the run (report.record).

Invariants (cli/app.py's): errors are one line `error: ...` with exit 2; tokens go to stdout as they come, or to
stderr with --json, whose stdout is exactly one JSON line. NaN / Inf from the model (the engine's NumericalError,
greedy or sampling) is such an error, after the tokens streamed so far; --json then prints no line.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from moetier.cli.console import TokenStream, consoles, emit_json, register_command, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags
from moetier.cli.model_arg import open_model
from moetier.cli.options import JsonOut, Model
from moetier.cli.tables import generation_report
from moetier.config import SamplingConfig
from moetier.report.record import RunDirOpt, RunRecorder, run_trace


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
    """Generate text from a prompt, streaming tokens, then print timing and memory statistics.

    NaN / Inf from the model is `error: ...` with exit 2 (with --json, no JSON line)."""
    report, err = consoles(json_out)
    with user_errors():
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
        config = flags.config()
        arg = open_model(model, err, flags.kernel_cache)
        config = arg.defaults(config)
        with flags.session(arg.path, config, err, run_trace(run_dir, flags.trace)) as engine:
            rec = RunRecorder.for_generate(run_dir, engine, arg.path, max_new_tokens)
            stream = TokenStream(engine, sys.stderr if json_out else sys.stdout)
            try:
                result = engine.generate(prompt, max_new_tokens, sampling, on_token=rec.on_token(stream),
                                         stop_at_eos=not ignore_eos)  # fmt: skip
            finally:
                stream.finish()  # ends the line, also before an error message
        payload = {
            "model": arg.label, "text": result.text, "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens, "new_tokens": len(result.token_ids),
            "ttft_s": result.ttft_s, "decode_tok_s": result.decode_tok_s, **result.stats,
        }  # fmt: skip
        rec.finish(payload)
        report.print(generation_report(payload))
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier generate` to `app` (once)."""
    register_command(app, "generate", generate)


__all__ = ["generate", "register"]
