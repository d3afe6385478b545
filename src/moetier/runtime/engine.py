"""Engine: a wired model plus generation, perplexity, tracing and statistics.

`moetier.load(path, config)` (runtime/wire.py) builds one: wire.py chooses the decoder (the lean
decoder of runtime/lean.py for families whose attention it implements, else the transformers
modules with TieredMoE blocks, runtime/decode_hf.py; both produce the reference model's logits),
the executor and the route observers; the engine only runs them.

`Engine.step` is the one forward step: every forward of generate, warmup, logits / perplexity and
the batch runner (runtime/batch.py) goes through it, so precision switching's `after_forward` follows
every forward alike; generate, perplexity and the batch runner also give it the trace's step index
(warmup, logits() and calibration keep the previous one, as before).

Faults: `Engine.step` lets an ExpertReadError (store/store.py: a failed expert read, its `rows` set
by the MoE block) propagate unchanged; the engine stays usable (the decoder's position and the
precision controller's routing are untouched by a failed step, and KV writes are positional, so a
retry of the same step, with or without the failed rows, is idempotent); the routing the failed forward's
MoE layers recorded into the trace before the failure is taken back (TraceRecorder.rollback), so a trace
holds exactly the routing of forwards that completed. Every step's logits are
checked for NaN / Inf with one reduction (`_all_finite`); non-finite logits raise NumericalError
naming, where it can find one, the damaged expert (the blocks' `find_nonfinite`, experts routed in
that step) or non-expert weight, with `rows`: the rows of the step's logits that are not finite, and
`logits`: the step's whole output. Unlike a read error, that forward ran to its end (the decoders'
positions moved on), so a batching caller uses the finite rows of `logits` rather than retrying (and
tells Engine.step so, `rows_are_tokens`: the trace keeps those rows' routing, drops the others').
Experts are not checked when read from disk: that would cost a pass over every expert read on the
miss path (tens of percent of a read), while a damaged expert is caught the first time it computes.
`health()` reports "degraded" while a read or numerical error happened in the last HEALTH_WINDOW_S
seconds.

Invariants: one user at a time (not thread-safe); `close` stops the background threads (precision
switching's mover, the hybrid worker), writes the trace and closes the store, also after a failure.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from moetier.config import EngineConfig, SamplingConfig
from moetier.errors import CheckpointError, ConfigError, NumericalError
from moetier.formats.gguf import is_gguf
from moetier.kernels import decode, native
from moetier.models.gguf_config import open_gguf
from moetier.models.open import ModelInfo
from moetier.runtime import memory
from moetier.runtime.executors.sparse import SPEC as SPARSE_SPEC
from moetier.runtime.executors.sparse import SparsityState
from moetier.runtime.executors.spec import ExecutorState
from moetier.runtime.lean import LeanDecoder
from moetier.runtime.loader import LoadedModel
from moetier.runtime.observers import ObserverList, TraceObserver
from moetier.runtime.precision import Switching
from moetier.runtime.prefetch import Prefetcher
from moetier.store.source import FaultLog
from moetier.traces import TraceRecorder

HEALTH_WINDOW_S = 60.0  # health() is "degraded" while a read or numerical error is this recent


class Decoder(Protocol):
    def reset(self) -> None: ...

    def forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor: ...


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float
    decode_tok_s: float
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalResult:
    ppl: float
    tokens: int
    nll: float
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Wired:
    """What runtime/wire.py hands the engine: the model and everything chosen for it."""

    loaded: LoadedModel
    config: EngineConfig
    decoder: Decoder
    observers: ObserverList  # shared by every block's pipeline
    executor: str  # the name of the executor variant (runtime/executors EXECUTORS)
    executor_state: ExecutorState | None = None
    switching: Switching | None = None
    prefetcher: Prefetcher | None = None


class Engine:
    def __init__(self, wired: Wired) -> None:
        self.loaded, self.config = wired.loaded, wired.config
        self.info: ModelInfo = wired.loaded.info
        self.store = wired.loaded.store
        self.device, self.dtype = wired.loaded.device, wired.loaded.dtype
        self.decoder: Decoder = wired.decoder
        self.observers = wired.observers
        self.executor, self.executor_state = wired.executor, wired.executor_state
        self.switching, self.prefetcher = wired.switching, wired.prefetcher
        # the native step, when the decoder has one: its head counts non-finite logits, so step() need not scan them
        self._fused = wired.decoder.fused if isinstance(wired.decoder, LeanDecoder) else None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.recorder: TraceRecorder | None = None
        self._trace_path: Path | None = None
        self.numerical_faults = FaultLog()  # NumericalErrors raised by step (health)
        self._dense_scanned = False  # the non-expert weights scanned for NaN / Inf (once, after non-finite logits)
        self._dense_damage: str | None = None  # what that scan found

    # -- tokenizer -------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None and is_gguf(self.info.path):
            self._tokenizer = open_gguf(self.info.path).tokenizer()  # from the GGUF metadata
        if self._tokenizer is None:
            names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
            if not any((Path(self.info.path) / n).exists() for n in names):
                raise CheckpointError(
                    f"{self.info.path}: no tokenizer files ({', '.join(names)}); pass token ids instead of text"
                )
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.info.path)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.info.path}: no usable tokenizer files ({exc})") from exc
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- tracing ---------------------------------------------------------------
    def record_trace(self, path: str | os.PathLike[str], with_scores: bool = False) -> None:
        """Record every MoE layer call's routing; written by save_trace() or close()."""
        target = Path(path)
        if target.is_dir():
            raise ConfigError(f"trace path {target} is a directory; give a file name, e.g. {target / 't.parquet'}")
        if target.parent.exists() and not os.access(target.parent, os.W_OK):
            raise ConfigError(f"trace path {target}: cannot write in {target.parent}")
        meta = {
            "model": self.info.path, "family": self.info.family, "num_experts": self.info.num_experts,
            "top_k": self.info.top_k, "hidden_size": self.info.hidden_size,
            "moe_intermediate_size": self.info.expert_intermediate, "dtype": str(self.dtype).removeprefix("torch."),
            "num_layers": self.info.num_layers, "moe_layers": list(self.info.moe_layers),
        }  # fmt: skip
        self.recorder = TraceRecorder(meta, with_scores=with_scores)
        self._trace_path = Path(path)
        self.observers.add(TraceObserver(self.recorder))

    def save_trace(self) -> Path | None:
        if self.recorder is None or self._trace_path is None:
            return None
        return self.recorder.save(self._trace_path)

    # -- compute ---------------------------------------------------------------
    def step(
        self, ids: torch.Tensor | None = None, index: int | None = None, all_logits: bool = False,
        run: Callable[[], torch.Tensor] | None = None, force_switch: bool = False, rows_are_tokens: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """The forward step, of the decoder or of `run` (exactly one of `ids` and `run`): ids [1, T] (T tokens of
        one sequence) -> logits [T, V] (all_logits) or [1, V] (last) of the decoder; or what `run()` returns
        (runtime/batch.py: a slot's prefill or a batch's decode step on its own KV caches).
        1. the trace: this forward's rows start here, at step index `index` (when given);
        2. the forward (kernels.matmul picks each product's kernel for its row count, per call);
        3. the logits checked for NaN / Inf (NumericalError naming the damage, with `rows` and `logits`);
        4. precision switching: this forward's routing to the controller (`force_switch`: decide now).
        A failed forward (ExpertReadError, NumericalError) propagates unchanged and leaves no routing behind: not
        in the precision controller, not in the trace. `rows_are_tokens`: row b of the output is the forward's
        token b (a batch's decode step, one token per sequence), whose caller samples the finite rows of a
        NumericalError's logits: their tokens' routing stays in the trace, the non-finite rows' is dropped."""
        if (ids is None) == (run is None):
            raise ValueError("Engine.step takes ids or run, exactly one of them")
        if self.recorder is not None:
            self.recorder.begin(index)
        try:
            out = run() if run is not None else self.decoder.forward(cast(torch.Tensor, ids), all_logits)
            fused = self._fused
            if not (fused is not None and fused.checked is out) and not _all_finite(out):
                raise self._numerical_error(out)
        except BaseException as exc:
            if self.switching is not None:
                self.switching.discard_forward()
            if self.recorder is not None:
                self.recorder.rollback(_finite_rows(exc) if rows_are_tokens else ())
            raise
        if self.switching is not None:
            self.switching.after_forward(force=force_switch)
        return out

    def _numerical_error(self, logits: torch.Tensor) -> NumericalError:
        """NumericalError for non-finite `logits` ([V] or [R, V]): the rows at fault and the damage found (off the
        hot path: the routed experts of each block, then the non-expert weights once); counted for health()."""
        bad = ~torch.isfinite(logits.reshape(-1, logits.shape[-1])).all(-1)  # [R]
        rows = tuple(int(r) for r in bad.nonzero().flatten().tolist())
        culprit = next((m for m in (b.find_nonfinite() for b in self.loaded.blocks) if m is not None), None)
        culprit = culprit or self._dense_scan()
        if culprit is None:
            culprit = (
                f"no weight of the model nor of the experts routed in this step is NaN or Inf: the activations "
                f"overflowed in {str(self.dtype).removeprefix('torch.')} (try --dtype fp32)"
            )
        exc = NumericalError(f"non-finite logits (NaN or Inf) in row(s) {list(rows)} of this step: {culprit}", rows,
                             logits)  # fmt: skip
        self.numerical_faults.record(exc)
        return exc

    def _dense_scan(self) -> str | None:
        """The first non-expert weight (parameter or buffer) holding NaN / Inf, as a message; scanned once (the
        weights do not change at run time)."""
        if not self._dense_scanned:
            self._dense_scanned = True
            named = [*self.loaded.model.named_parameters(), *self.loaded.model.named_buffers()]
            for name, t in named:
                if t.is_floating_point() and t.device.type != "meta":
                    n = int((~torch.isfinite(t)).sum().item())
                    if n:
                        self._dense_damage = f"{self.info.path}: non-expert weight {name} has {n} non-finite value(s)"
                        break
        return self._dense_damage

    @property
    def sparsity(self) -> SparsityState | None:
        """The sparse executor's state (thresholds, counters) when intra-expert sparsity is on, else None."""
        return cast(SparsityState, self.executor_state) if self.executor == SPARSE_SPEC.name else None

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [1, T, V] for a fresh sequence (no cache kept)."""
        return self._eval_logits(input_ids, None)

    def _eval_logits(self, input_ids: torch.Tensor, index: int | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ConfigError(f"logits() takes input_ids of shape [1, T], got {list(input_ids.shape)}")
        self.decoder.reset()
        return self.step(input_ids.to(self.device), index, all_logits=True).unsqueeze(0)

    @torch.inference_mode()
    def warmup(self, text: str | list[int], max_tokens: int | None = None) -> int:
        """DynaExq 3.5: run `text` (up to `max_tokens`, default precision.warmup_tokens) through the
        model to seed expert hotness, fix each layer's threshold, and promote the hottest experts
        before serving (waits for the switches). Returns the tokens used; no-op unless dynamic."""
        if self.switching is None:
            return 0
        limit = max_tokens if max_tokens is not None else self.config.precision.warmup_tokens
        ids = (self.encode(text) if isinstance(text, str) else list(text))[: min(limit, self._max_len())]
        if not ids:
            raise ConfigError("warmup text is empty after tokenization")
        self.decoder.reset()
        self.step(torch.tensor([ids], device=self.device), force_switch=True)
        self.switching.mover.drain()
        return len(ids)

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        on_token: Callable[[int, str], None] | None = None,
        stop_at_eos: bool = True,
    ) -> GenerationResult:
        """Prefill the prompt, then decode up to max_new_tokens; `on_token(id, text)` streams."""
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        sampling = sampling or SamplingConfig()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ConfigError("the prompt is empty after tokenization")
        self.check_fits(len(ids), max_new_tokens)
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        eos = self.eos_ids if stop_at_eos else set()
        out: list[int] = []
        self.decoder.reset()
        t0 = time.perf_counter()
        logits = self.step(torch.tensor([ids], device=self.device), index=0)[-1]  # [V]
        ttft = 0.0
        t_first = t0
        for step in range(max_new_tokens):
            tok = sample(logits, sampling, gen)
            if step == 0:
                t_first = time.perf_counter()
                ttft = t_first - t0
            out.append(tok)
            if on_token is not None:
                on_token(tok, str(self.tokenizer.decode([tok])) if self._has_tokenizer() else "")
            if tok in eos or step == max_new_tokens - 1:
                break
            logits = self.step(torch.tensor([[tok]], device=self.device), index=step + 1)[-1]
        elapsed = time.perf_counter() - t_first
        decode_tok_s = (len(out) - 1) / elapsed if len(out) > 1 and elapsed > 0 else 0.0
        text = str(self.tokenizer.decode(out, skip_special_tokens=True)) if self._has_tokenizer() else ""
        return GenerationResult(text, out, len(ids), ttft, decode_tok_s, self.stats())

    @torch.inference_mode()
    def perplexity(
        self,
        text: str | list[int],
        max_tokens: int | None = None,
        window: int = 0,
        on_window: Callable[[int, int], None] | None = None,
    ) -> EvalResult:
        """Token-level perplexity over non-overlapping windows of `window` tokens (0: the context length,
        capped at 1024 and at the KV cache). `on_window(done, total)` reports progress."""
        ids = self.encode(text) if isinstance(text, str) else list(text)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise ConfigError(f"perplexity needs at least 2 tokens, got {len(ids)}")
        nll, count = 0.0, 0
        for _, logits, target in self.window_logits(ids, window, on_window):  # logits [T, V], target [T]
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            count += target.numel()
        return EvalResult(ppl=math.exp(nll / count), tokens=count, nll=nll / count, stats=self.stats())

    @torch.inference_mode()
    def window_logits(
        self, ids: list[int], window: int = 0, on_window: Callable[[int, int], None] | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The windows perplexity() scores, one at a time (it and runtime/quality.py read them): yields (start,
        logits [T, V] float32, targets [T]) per non-overlapping window of `window` tokens (0: the context length,
        capped at 1024 and at the KV cache); each window is a fresh sequence, its trace step index start // window."""
        if len(ids) < 2:
            raise ConfigError(f"scoring needs at least 2 tokens, got {len(ids)}")
        if window > self._max_len():
            raise ConfigError(f"window of {window} tokens exceeds the KV cache of {self._max_len()} tokens")
        window = window or min(int(getattr(self.loaded.config, "max_position_embeddings", 1024)), 1024, self._max_len())
        starts = range(0, len(ids) - 1, window)
        for n_done, start in enumerate(starts):
            chunk = ids[start : start + window + 1]  # len(chunk) >= 2: start <= len(ids) - 2
            logits = self._eval_logits(torch.tensor([chunk[:-1]]), start // window)[0].float()  # [T, V]
            yield start, logits, torch.tensor(chunk[1:], device=logits.device)  # targets [T]
            if on_window is not None:
                on_window(n_done + 1, len(starts))

    @functools.cached_property
    def eos_ids(self) -> set[int]:
        """EOS ids of config.json and generation_config.json (transformers stops on the latter's list)."""
        found: set[int] = set()
        sources: list[Any] = [self.loaded.config]
        if (Path(self.info.path) / "generation_config.json").exists():
            try:
                sources.append(GenerationConfig.from_pretrained(self.info.path))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.info.path}/generation_config.json: cannot be read ({exc})") from exc
        for src in sources:
            eos = getattr(src, "eos_token_id", None)
            if eos is not None:
                found |= {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
        return found

    @property
    def max_len(self) -> int:
        """Longest sequence one forward can take (the KV cache of the lean decoder)."""
        return self._max_len()

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """ConfigError unless the prompt and every new token but the last (never fed back) fit the KV cache."""
        if prompt_tokens + max_new_tokens - 1 > self._max_len():
            raise ConfigError(
                f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the KV cache of "
                f"{self._max_len()} tokens (lower max_new_tokens or raise max_seq_len, --max-seq-len)"
            )

    def _max_len(self) -> int:
        """Longest sequence the decoder can hold (the lean decoder's KV cache; unbounded otherwise)."""
        return int(getattr(self.decoder, "max_len", 1 << 30))

    def _has_tokenizer(self) -> bool:
        try:
            return self.tokenizer is not None
        except CheckpointError:
            return False

    # -- accounting --------------------------------------------------------------
    def _routing_stats(self) -> dict[str, Any]:
        """{"routing": the routing override's counters (runtime/route_override.py)}, or {} without one."""
        for b in self.loaded.blocks:
            if b.pipeline is not None and b.pipeline.override is not None:
                return {"routing": b.pipeline.override.stats()}
        return {}

    def _kernels(self) -> str:
        """Which kernels decode runs: "native (ISA)" with the C library, else "torch" and why."""
        rt = self.config.runtime
        if self.device.type != "cpu":
            return "torch (device)"
        lib = decode.load(rt.native_kernels, rt.kernel_cache)
        if lib is None:
            return f"torch ({native.load_error(rt.native_kernels, rt.kernel_cache)})"
        return f"native ({decode.isa(lib)})" if self.dtype == torch.bfloat16 else f"torch ({self.dtype} model)"

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded", "read_errors", "numerical_errors", "last_error", "last_error_time"}:
        degraded while a failed expert read (demand or background) or a NumericalError happened in the last
        HEALTH_WINDOW_S seconds; last_error_time is time.time() of the last one (None: never)."""
        reads, read_msg, read_t, read_mono = self.store.faults.snapshot()
        nums, num_msg, num_t, num_mono = self.numerical_faults.snapshot()
        last = max(
            ((mono, msg, t) for mono, msg, t in ((read_mono, read_msg, read_t), (num_mono, num_msg, num_t))
             if mono is not None),
            default=None, key=lambda x: x[0],
        )  # fmt: skip
        degraded = last is not None and time.monotonic() - last[0] < HEALTH_WINDOW_S
        return {
            "status": "degraded" if degraded else "ok",
            "read_errors": reads,
            "numerical_errors": nums,
            "last_error": last[1] if last is not None else None,
            "last_error_time": last[2] if last is not None else None,
        }

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        compute = s.get("accel", s["host"])
        accesses = compute["hits"] + compute["misses"]
        return {
            "hits": compute["hits"],
            "misses": compute["misses"],
            "hit_rate": compute["hits"] / accesses if accesses else 0.0,
            "cache_policy": self.config.cache.policy,
            "scheduler": self.config.scheduler.name,
            "executor": self.executor,
            "hybrid": self.executor == "hybrid",
            "disk_bytes": s["disk_bytes"],
            "h2d_bytes": s["h2d_bytes"],
            "read_errors": s["read_errors"],
            "numerical_errors": self.numerical_faults.count,
            "peak_host_expert_bytes": s["host"]["peak_resident_bytes"],
            "peak_accel_expert_bytes": s["accel"]["peak_resident_bytes"] if "accel" in s else 0,
            "staging_bytes": s["staging_bytes"],
            "precision": s["precision"],
            "promotions": s.get("promotions", 0),
            "demotions": s.get("demotions", 0),
            "tiers": {k: v for k, v in s.items() if k in ("host", "accel")},
            "decoder": type(self.decoder).__name__,
            "kernels": self._kernels(),
            "dense_precision": self.config.runtime.dense_precision,
            "dense_stored": getattr(self.decoder, "stored_weights", 0),  # projections / head computed as stored
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        } | ({"disk_io": self.loaded.disk_io.stats()} if self.loaded.disk_io is not None else {}) | (
            {"switching": self.switching.stats()} if self.switching is not None else {}) | (
            {self.executor_state.stats_key: self.executor_state.stats()} if self.executor_state is not None else {}
        ) | ({"prefetch": self.prefetcher.summary()} if self.prefetcher is not None else {}) | (
            {"native_step": self._fused.stats()} if self._fused is not None else {}
        ) | ({"memory": self._memory()} if self.loaded.memory is not None else {}) | self._routing_stats()

    def _memory(self) -> dict[str, Any]:
        """--memory: how the budget was spent (runtime/memory.py) and the process's resident bytes now and at peak."""
        assert self.loaded.memory is not None
        return self.loaded.memory.as_dict() | {"rss_bytes": memory.process_rss(), "peak_rss_bytes": memory.peak_rss(),
                                               "plan": self.loaded.memory.describe()}  # fmt: skip

    def close(self) -> None:
        """Write the trace, stop the background threads, close the store: all of them, whichever fails."""
        try:
            self.save_trace()
        finally:
            try:
                if self.switching is not None:
                    self.switching.close()
                if self.executor_state is not None:
                    self.executor_state.close()
            finally:
                self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _all_finite(logits: torch.Tensor) -> bool:
    """Whether logits hold no NaN / Inf: one float32 sum, no mask (a NaN or Inf anywhere makes the sum
    non-finite; finite logits cannot overflow it). A non-finite sum is confirmed element-wise (huge finite
    logits could overflow the sum)."""
    if bool(torch.isfinite(logits.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(logits).all())


def _finite_rows(exc: BaseException) -> list[int]:
    """The finite rows of a failed step's output: those of a NumericalError's logits [R, V] that it does not name
    (that forward ran to its end); none for any other failure (that forward did not)."""
    if not isinstance(exc, NumericalError) or not isinstance(exc.logits, torch.Tensor):
        return []
    bad = set(exc.rows)
    return [r for r in range(exc.logits.reshape(-1, exc.logits.shape[-1]).shape[0]) if r not in bad]


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """logits [V] -> token id: greedy at temperature 0, else temperature + nucleus (top-p)."""
    if cfg.temperature == 0:
        # numpy's argmax of an fp32 copy: the same index (the first maximum; logits are finite here), ~9 us for 32000
        # bf16 logits where torch.argmax on bf16 takes ~115 us (2% of a decode step)
        return int(np.argmax(logits.detach().float().cpu().numpy()))
    probs = torch.softmax(logits.float().cpu() / cfg.temperature, dim=-1)  # [V]
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen).item())
