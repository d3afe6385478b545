"""Engine: a loaded model plus generation, perplexity and statistics.

`moetier.load(path, config)` returns one. The engine picks its decoder: the lean
decoder (runtime/lean.py) for families whose attention it implements, else the
transformers modules with TieredMoE blocks (runtime/decode_hf.py). Both produce the
reference model's logits.

Wiring beyond the decoder: router scores to the cache policy and cross-layer prefetch
(runtime/prefetch.py), hybrid CPU-GPU execution when a scheduler is set on CUDA
(runtime/hybrid.py), precision switching (runtime/precision.py).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from moetier.config import EngineConfig, SamplingConfig
from moetier.errors import CheckpointError, ConfigError
from moetier.kernels.small_rows import small_rows
from moetier.runtime.decode_hf import HFDecoder
from moetier.runtime.loader import LoadedModel, ModelInfo, open_model
from moetier.runtime.precision import Switching
from moetier.store.dynamic import DynamicStore
from moetier.traces import TraceRecorder


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


def load(path: str | os.PathLike[str], config: EngineConfig | None = None) -> Engine:
    """Open a local Hugging Face MoE checkpoint folder with tiered experts."""
    cfg = config or EngineConfig()
    loaded = open_model(path, cfg)
    try:
        return Engine(loaded, cfg)
    except BaseException:
        loaded.store.close()  # release the checkpoint's file descriptors
        raise


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded, self.config = loaded, config
        self.info: ModelInfo = loaded.info
        self.store = loaded.store
        self.device, self.dtype = loaded.device, loaded.dtype
        self.decoder: Decoder = self._pick_decoder()
        self.switching: Switching | None = None
        if isinstance(self.store, DynamicStore):
            self.switching = Switching(
                self.store, self.store.per_layer, self.info.num_experts, config.precision, loaded.blocks
            )
        from moetier.runtime.prefetch import wire

        self.prefetcher = wire(loaded, config)
        self.hybrid = None
        if config.scheduler.name is not None and self.device.type == "cuda":
            from moetier.runtime.hybrid import wire_hybrid

            self.hybrid = wire_hybrid(loaded, config, self.prefetcher.pricing if self.prefetcher else None)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.recorder: TraceRecorder | None = None
        self._trace_path: Path | None = None

    def _pick_decoder(self) -> Decoder:
        if self.config.runtime.lean and self.loaded.family.lean_attention:
            from moetier.runtime.lean import LeanDecoder, lean_supported

            if lean_supported(self.loaded):
                return LeanDecoder(self.loaded, self.config.runtime.max_seq_len)
        return HFDecoder(self.loaded.model, self.loaded.config)

    # -- tokenizer -------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
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
        scoring = self.loaded.family.scoring
        recorder = self.recorder

        def hook(layer: int, ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor) -> None:
            scores = None
            if recorder.with_scores:
                probs = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), -1)
                scores = probs.tolist()
            recorder.record(layer, ids.tolist(), weights.float().tolist(), scores)

        for block in self.loaded.blocks:
            block.route_hooks.append(hook)

    def save_trace(self) -> Path | None:
        if self.recorder is None or self._trace_path is None:
            return None
        return self.recorder.save(self._trace_path)

    def _set_step(self, step: int) -> None:
        if self.recorder is not None:
            self.recorder.step = step

    # -- compute ---------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [1, T, V] for a fresh sequence (no cache kept)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ConfigError(f"logits() takes input_ids of shape [1, T], got {list(input_ids.shape)}")
        self.decoder.reset()
        return self._forward(input_ids.to(self.device), all_logits=True).unsqueeze(0)

    def _forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """One decoder call, with the matmul kernel chosen for its row count (runtime/kernels.py)."""
        with small_rows(ids.shape[1], self.dtype, self.device):
            out = self.decoder.forward(ids, all_logits)
        if self.switching is not None:
            self.switching.after_forward()
        return out

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
        with small_rows(len(ids), self.dtype, self.device):
            self.decoder.forward(torch.tensor([ids], device=self.device))
        self.switching.after_forward(force=True)
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
        eos = self._eos_ids if stop_at_eos else set()
        out: list[int] = []
        self.decoder.reset()
        t0 = time.perf_counter()
        self._set_step(0)
        logits = self._forward(torch.tensor([ids], device=self.device))[-1]  # [V]
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
            self._set_step(step + 1)
            logits = self._forward(torch.tensor([[tok]], device=self.device))[-1]
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
        limit = min(int(getattr(self.loaded.config, "max_position_embeddings", 1024)), 1024, self._max_len())
        if window > self._max_len():
            raise ConfigError(f"window of {window} tokens exceeds the KV cache of {self._max_len()} tokens")
        window = window or limit
        starts = range(0, len(ids) - 1, window)
        nll, count = 0.0, 0
        for n_done, start in enumerate(starts):
            chunk = ids[start : start + window + 1]
            if len(chunk) < 2:
                break
            self._set_step(start // window)
            logits = self.logits(torch.tensor([chunk[:-1]]))[0].float()  # [T, V]
            target = torch.tensor(chunk[1:], device=logits.device)
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            count += len(chunk) - 1
            if on_window is not None:
                on_window(n_done + 1, len(starts))
        return EvalResult(ppl=math.exp(nll / count), tokens=count, nll=nll / count, stats=self.stats())

    @functools.cached_property
    def _eos_ids(self) -> set[int]:
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
            "hybrid": self.hybrid is not None,
            "disk_bytes": s["disk_bytes"],
            "h2d_bytes": s["h2d_bytes"],
            "peak_host_expert_bytes": s["host"]["peak_resident_bytes"],
            "peak_accel_expert_bytes": s["accel"]["peak_resident_bytes"] if "accel" in s else 0,
            "staging_bytes": s["staging_bytes"],
            "precision": s["precision"],
            "promotions": s.get("promotions", 0),
            "demotions": s.get("demotions", 0),
            "tiers": {k: v for k, v in s.items() if k in ("host", "accel")},
            "decoder": type(self.decoder).__name__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        } | ({"switching": self.switching.stats()} if self.switching is not None else {}) | (
            {"sparsity": self.loaded.sparsity.stats()} if self.loaded.sparsity is not None else {}
        ) | ({"prefetch": self.prefetcher.summary()} if self.prefetcher is not None else {}) | (
            {"hybrid_stats": self.hybrid.stats()} if self.hybrid is not None else {}
        )

    def close(self) -> None:
        self.save_trace()
        if self.switching is not None:
            self.switching.close()
        if self.hybrid is not None:
            self.hybrid.executor.close()
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """logits [V] -> token id: greedy at temperature 0, else temperature + nucleus (top-p)."""
    if cfg.temperature == 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / cfg.temperature, dim=-1)  # [V]
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen).item())
