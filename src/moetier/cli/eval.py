"""`moetier eval MODEL --text FILE`: perplexity of a text file over non-overlapping windows, and, with
`--kl-ref`, KL divergence and top-1 agreement against a reference model's next-token distribution.

Registered on the main app by cli/app.py (`register(app)`). Thin: the engine flags (engine_flags.EngineFlags)
map onto the EngineConfig; `--run-dir` records the run (report.record); the quality math and the reference
logits file are runtime/quality.py's.

Window: `--window`, else the window the model says it was trained on (`train_window` in MODEL/moetier.json),
else the context length capped at 1024 and at the KV cache. `--kl-ref full` scores the text first with the
reference (the same checkpoint in fp32, all experts resident, full precision, sparsity off), keeps its compact
log-probabilities and closes it before loading the candidate, so the two models are never resident together.
`--save-logits FILE` writes this run's log-probabilities for a later `--kl-ref FILE`.

Invariants (cli/app.py's): errors (a missing or non-UTF-8 text, a reference file of another model, text or
window included) are one line `error: ...` with exit 2; progress bars go to stderr; with --json stdout holds
exactly one JSON line. A model that produces NaN / Inf (a damaged weight: the engine's NumericalError, or a
perplexity that comes out NaN) is such an error: no figure is printed and --json prints no line. A figure that
merely overflows (a finite NLL too large to exponentiate) is null in the JSON line, listed in `non_finite`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from moetier.cli.console import consoles, emit_json, progress_bar, read_text, register_command, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags, engine_session
from moetier.cli.model_arg import open_model
from moetier.cli.options import JsonOut, Model
from moetier.cli.tables import eval_report
from moetier.config import EngineConfig
from moetier.errors import ConfigError, NumericalError
from moetier.report.record import RunDirOpt, RunRecorder, run_trace
from moetier.runtime.engine import Engine
from moetier.runtime.quality import (
    TRAIN_WINDOW_FILE,
    QualitySummary,
    RefLogprobs,
    collect,
    compare,
    declared_window,
    eval_window,
    model_fingerprint,
    reference_config,
    safe_exp,
)

Window = Annotated[
    int,
    typer.Option(min=0, help=f"Tokens per window; 0 = the window the model was trained on when its folder says so "
                             f"('train_window' in MODEL/{TRAIN_WINDOW_FILE}), else the context length, capped "
                             "at 1024."),
]  # fmt: skip
KlRef = Annotated[
    str | None,
    typer.Option("--kl-ref", metavar="full|FILE", rich_help_panel="Quality",
                 help="Also report KL divergence (nats/token: mean ± standard error, median, 99th percentile) and "
                      "top-1 agreement against a reference: 'full' = this checkpoint in fp32, all experts resident, "
                      "full precision, sparsity off (scored first, then unloaded); or a FILE written by "
                      "--save-logits (same model, text, --max-tokens and window)."),
]  # fmt: skip
KlOther = Annotated[
    bool,
    typer.Option("--kl-other-checkpoint", rich_help_panel="Quality",
                 help="With --kl-ref FILE: accept logits saved from another checkpoint of the same model (a GGUF or "
                      "quantized file against its bf16 original); the vocabulary and the token ids must still "
                      "match."),
]  # fmt: skip
KlFrom = Annotated[
    int,
    typer.Option("--kl-from", min=0, rich_help_panel="Quality",
                 help="With --kl-ref: report KL, top-1 and perplexities over each window's positions from this one on "
                      "(llama-perplexity --kl-divergence scores the second half of each window: give window / 2 to "
                      "compare with it on the same positions). 0: every position."),
]  # fmt: skip
SaveLogits = Annotated[
    Path | None,
    typer.Option("--save-logits", metavar="FILE", rich_help_panel="Quality",
                 help="Write this run's next-token log-probabilities (safetensors: 16-bit per vocabulary entry plus "
                      "the top 32 exact) for a later --kl-ref FILE."),
]  # fmt: skip


def _window(engine: Engine, requested: int, declared: int | None) -> tuple[int, str]:
    max_positions = int(getattr(engine.loaded.config, "max_position_embeddings", 1024))
    return eval_window(requested, declared, max_positions, engine.max_len)


def _record_meta(model: Path, text: Path, config: EngineConfig) -> dict[str, Any]:
    return {"model": str(model), "fingerprint": model_fingerprint(model), "text": str(text),
            "config": dataclasses.asdict(config)}  # fmt: skip


def _score_reference(model: Path, text: Path, body: str, max_tokens: int | None, requested: int,
                     declared: int | None, config: EngineConfig, err: Console) -> RefLogprobs:  # fmt: skip
    """`--kl-ref full`: score the text with the reference engine, keep its record, unload it."""
    ref_config = reference_config(config)
    with engine_session(model, ref_config, None, False, err) as ref:
        ids = ref.encode(body)[:max_tokens]
        win, _ = _window(ref, requested, declared)
        with progress_bar(err, transient=True) as progress:
            task = progress.add_task(f"reference (fp32, full): scoring {len(ids)} tokens", total=None)
            return collect(ref, ids, win, _record_meta(model, text, ref_config),
                           lambda done, total: progress.update(task, completed=done, total=total))  # fmt: skip


def _quality_lines(q: QualitySummary, source: str) -> list[str]:
    return [
        f"KL divergence vs {source}: mean {q.kl_mean:.4g} ± {q.kl_stderr:.2g} nats/token, "
        f"median {q.kl_median:.4g}, 99th percentile {q.kl_p99:.4g}, max {q.kl_max:.4g}",
        f"top-1 agreement {q.top1_pct:.2f}% over {q.tokens} tokens; perplexity {q.ppl:.4f} (reference {q.ref_ppl:.4f})",
    ]


@engine_flags
def eval_(
    model: Model,
    text: Annotated[Path, typer.Option(help="UTF-8 text file to score.")],
    max_tokens: Annotated[int | None, typer.Option(min=2, help="Score only the first N tokens.")] = None,
    window: Window = 0,
    kl_ref: KlRef = None,
    kl_other_checkpoint: KlOther = False,
    kl_from: KlFrom = 0,
    save_logits: SaveLogits = None,
    flags: EngineFlags = DEFAULT_FLAGS,
    run_dir: RunDirOpt = None,
    json_out: JsonOut = False,
) -> None:
    """Perplexity of a text file over non-overlapping windows.

    With --kl-ref, also KL divergence and top-1 agreement against a reference model over the same tokens.
    NaN / Inf from the model is `error: ...` with exit 2 and no figure (with --json, no JSON line)."""
    report, err = consoles(json_out)
    with user_errors():
        config = flags.config()
        body = read_text(text)
        arg = open_model(model, err, flags.kernel_cache)
        config, path = arg.defaults(config), arg.path
        if kl_other_checkpoint and (kl_ref is None or kl_ref == "full"):
            raise ConfigError("--kl-other-checkpoint goes with --kl-ref FILE (logits saved from the other checkpoint)")
        if kl_from and kl_ref is None:
            raise ConfigError("--kl-from goes with --kl-ref (it picks the positions the KL is reported over)")
        if kl_ref is not None and save_logits is not None:
            raise ConfigError("--save-logits and --kl-ref go in separate runs: save the reference, then compare")
        if save_logits is not None and save_logits.is_dir():
            raise ConfigError(f"--save-logits {save_logits} is a directory; give a file name")
        declared = declared_window(path)
        ref: RefLogprobs | None = None
        ref_name = kl_ref
        if kl_ref == "full":
            ref, ref_name = _score_reference(path, text, body, max_tokens, window, declared, config, err), "full"
        elif kl_ref is not None:
            ref = RefLogprobs.load(Path(kl_ref))
        quality: QualitySummary | None = None
        with flags.session(path, config, err, run_trace(run_dir, flags.trace)) as engine:
            rec = RunRecorder.for_eval(run_dir, engine, path)
            ids = engine.encode(body)[:max_tokens]
            if len(ids) < 2:
                raise ConfigError(f"{text}: eval needs at least 2 tokens, got {len(ids)}")
            win, win_from = _window(engine, window, declared)
            t0 = time.perf_counter()
            with progress_bar(err, transient=True) as progress:
                task = progress.add_task(f"scoring {len(ids)} tokens", total=None)
                on_window = rec.on_window(lambda done, total: progress.update(task, completed=done, total=total))
                if ref is not None:
                    source = f"reference logits file {kl_ref}" if kl_ref != "full" else "the fp32 reference"
                    vocab = int(getattr(engine.loaded.config, "vocab_size", ref.vocab))
                    fingerprint = None if kl_other_checkpoint else model_fingerprint(path)
                    ref.check_matches(source, vocab, fingerprint, ids)
                    quality = compare(engine, ids, win, ref, source, on_window, kl_from).summary
                    ppl, nll, tokens = quality.ppl, math.log(quality.ppl), quality.tokens
                elif save_logits is not None:
                    saved = collect(engine, ids, win, _record_meta(path, text, config), on_window)
                    saved.save(save_logits)
                    nll, tokens = saved.nll_sum / saved.tokens, saved.tokens
                    ppl = safe_exp(nll)
                else:
                    result = engine.perplexity(ids, window=win, on_window=on_window)
                    ppl, nll, tokens = result.ppl, result.nll, result.tokens
            elapsed = time.perf_counter() - t0
            if not math.isfinite(nll):  # the engine checks its logits; this is the last line of defence
                raise NumericalError(
                    f"{path}: the model's log-probabilities over {text} are not finite (NLL {nll}): NaN / Inf in its "
                    "weights or activations; check the checkpoint"
                )
            stats = engine.stats()
        payload = {
            "model": arg.label, "text_file": str(text), "ppl": ppl, "nll": nll,
            "tokens": tokens, "window": win, "window_from": win_from, "eval_s": elapsed,
            "eval_tok_s": tokens / elapsed if elapsed > 0 else 0.0,
            **({"kl_ref": ref_name, "kl_from": kl_from, **quality.as_dict()} if quality is not None else {}),
            **({"saved_logits": str(save_logits)} if save_logits is not None else {}),
            **stats,
        }  # fmt: skip
        rec.finish(payload)
        if not json_out:
            report.print(f"perplexity {ppl:.4f} over {tokens} tokens (window {win}, {win_from})", highlight=False)
            for line in _quality_lines(quality, str(ref_name)) if quality is not None else []:
                report.print(line, highlight=False, soft_wrap=True)
            if save_logits is not None:
                report.print(f"log-probabilities written to {save_logits}", highlight=False)
        report.print(eval_report(payload))
        if json_out:
            emit_json(payload)


def register(app: typer.Typer) -> None:
    """Add `moetier eval` to `app` (once)."""
    register_command(app, "eval", eval_)


__all__ = ["eval_", "register"]
