"""Batched multi-request decoding: many sequences, each with its own KV cache, one MoE call per step.

`BatchRunner` is what the server drives. Requests are added at any time (they queue); each
`step()` admits pending requests into free slots (prefilling each, which yields its first token),
then runs ONE decode step for every other running sequence together. In that step every layer's
attention reads each sequence's own cache at its own position, while the MLP/MoE block gets all B
sequences' rows at once ([1, B, H]), so an expert routed by several sequences is fetched and
computed once per step: the expert work of a step is shared across requests.

Invariants:
- each sequence's logits equal (fp32 allclose) those of decoding it alone with Engine.generate:
  prefill is the lean decoder's own code on the slot's cache; a decode row differs from a
  single-sequence decode only in the row count of its matmuls;
- sampling is per request (its own torch.Generator when seeded), so a seeded request draws the
  same tokens whatever else is in the batch;
- a slot is held from admission to the end of the step in which its sequence finishes, or until
  `cancel`; `running <= max_batch` always;
- single-threaded: every method is called from one thread (the server's worker). The engine has
  one user at a time: while the runner has work it owns the decoder. In batched mode the slots
  have their own caches, so Engine.generate() in between does not disturb them; in serial mode
  the runner uses the engine's decoder itself, which generate() resets (the running sequence is
  then lost).

Every prefill and decode step is one Engine.step (trace step index, precision switching), with the
slot decoder's call as its forward in batched mode.

Modes: "batched" when the engine's decoder is the LeanDecoder (runtime/lean.py); otherwise
"serial": one sequence holds the one slot until it finishes, through the engine's decoder
(reset + forward), behind the same interface.

Decode attention is a loop over the batch's sequences (one SDPA each over its own cache slice,
the same call as single-sequence decoding). `attention="padded"` is the alternative: one SDPA over
the caches stacked to the longest sequence with a key mask [B, 1, 1, Lmax]. On the bundled model
on CPU (1 thread, B = 2..8) the two were within +-6% per decode step, neither ahead throughout
(attention is a small part of a step; the MoE dominates), so the default stays the loop, whose
cost does not grow with the longest sequence and which copies no cache. Padded is likely the
better choice on CUDA (one kernel launch instead of B); not measured here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from moetier.config import SamplingConfig
from moetier.errors import ConfigError
from moetier.runtime.engine import Engine, sample
from moetier.runtime.lean import LeanDecoder

Attention = Literal["loop", "padded"]
KV_CHUNK = 256  # a slot's KV cache is sized in multiples of this many tokens


@dataclass(frozen=True)
class SeqRequest:
    prompt_ids: list[int]  # non-empty
    max_new_tokens: int  # >= 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # per request; seed -> its own torch.Generator
    stop_ids: frozenset[int] | None = None  # None -> the engine's EOS ids; empty -> never stop early


@dataclass(frozen=True)
class StepEvent:
    seq_id: int
    token: int | None  # None only when finished without a new token (cancelled)
    finished: bool
    finish_reason: str | None  # "stop" (hit a stop id; the stop token IS reported), "length", "cancelled"


class SlotDecoder:
    """S independent sequences over a LeanDecoder's weights; slot s has its own KV cache
    [L, nkv, cap_s, hd] (k and v), sized on the slot's prefill to what its sequence may reach
    (`reserve`, rounded up to KV_CHUNK tokens, at most max_len) and kept for the slot's next sequence,
    grown (reallocated) only when a longer one comes. So S slots of short requests do not cost S
    full-context caches (on CUDA torch.empty takes real memory).

    Invariant: a slot's sequence never outgrows its cache: decode raises ConfigError naming the slot
    before writing past it."""

    def __init__(self, lean: LeanDecoder, slots: int, attention: Attention = "loop") -> None:
        if slots < 1:
            raise ConfigError(f"a slot decoder needs at least 1 slot, got {slots}")
        if attention not in ("loop", "padded"):
            raise ConfigError(f"attention must be 'loop' or 'padded', got {attention!r}")
        self.lean, self.slots, self.attention = lean, slots, attention
        self.max_len = lean.max_len
        self.k: list[torch.Tensor | None] = [None] * slots  # per slot [L, nkv, cap, hd]
        self.v: list[torch.Tensor | None] = [None] * slots
        self.cap = [0] * slots  # tokens each slot's cache holds at most
        self.pos = [0] * slots  # tokens held by each slot's cache

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ConfigError(f"slot {slot} out of range 0..{self.slots - 1}")

    def _reserve(self, slot: int, tokens: int) -> None:
        """Make slot's cache hold `tokens` (its old contents are dropped when it must grow)."""
        if tokens > self.max_len:
            raise ConfigError(f"sequence of {tokens} tokens exceeds the KV cache of {self.max_len}")
        if self.cap[slot] >= tokens:
            return
        lean = self.lean
        cap = min(self.max_len, -(-tokens // KV_CHUNK) * KV_CHUNK)
        self.k[slot] = self.v[slot] = None  # the old cache goes back to the allocator first
        shape = (len(lean.layers), lean.nkv, cap, lean.hd)
        self.k[slot] = torch.empty(shape, dtype=lean.dtype, device=lean.device)
        self.v[slot] = torch.empty(shape, dtype=lean.dtype, device=lean.device)
        self.cap[slot] = cap

    def _cache(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[slot], self.v[slot]
        if k is None or v is None:
            raise ConfigError(f"slot {slot} has no sequence; prefill it first")
        return k, v

    def cache_bytes(self) -> int:
        """Bytes held by the slots' KV caches (k and v)."""
        return sum(2 * t.numel() * t.element_size() for t in self.k if t is not None)

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], reserve: int | None = None) -> torch.Tensor:
        """Reset `slot`, size its cache for `reserve` tokens (default: max_len; at least the prompt) and
        run the prompt into it -> logits [V] of the last position."""
        self._check(slot)
        self._reserve(slot, max(len(ids), self.max_len if reserve is None else reserve))
        k, v = self._cache(slot)
        self.pos[slot] = 0
        out = self.lean.run(torch.tensor([ids], device=self.lean.device), 0, k, v)  # [1, V]
        self.pos[slot] = len(ids)
        return out[0]

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence, each at its own position -> logits [B, V]."""
        # 1. checks and per-row positions
        if len(slots) != len(tokens) or not slots or len(set(slots)) != len(slots):
            raise ConfigError(f"decode takes distinct slots and one token each, got {slots} and {tokens}")
        caches = []
        for s in slots:
            self._check(s)
            caches.append(self._cache(s))  # prefilled?
            if self.pos[s] + 1 > self.cap[s]:
                raise ConfigError(f"slot {s}: sequence of {self.pos[s] + 1} tokens exceeds its KV cache of "
                                  f"{self.cap[s]} (reserved at prefill; the model's limit is {self.max_len})")
        pos = [self.pos[s] for s in slots]
        lean, B = self.lean, len(slots)
        nh, hd = lean.nh, lean.hd
        pos_t = torch.tensor(pos, device=lean.device)  # [B]
        cos, sin = lean.cos[pos_t][:, None], lean.sin[pos_t][:, None]  # [B, 1, hd]
        mask = None
        if self.attention == "padded":
            lmax = max(pos) + 1
            mask = (torch.arange(lmax, device=lean.device)[None] <= pos_t[:, None])[:, None, None]  # [B, 1, 1, Lmax]
        # 2. layers: attention per sequence, the MLP/MoE over all B rows at once
        x = F.embedding(torch.tensor(tokens, device=lean.device), lean.embed)  # [B, H]
        for i, L in enumerate(lean.layers):
            q, k, v = lean.qkv(L, lean.norm(x, L.in_norm), cos, sin)  # [B, nh, hd], [B, nkv, hd] x2
            for b, (kc, vc) in enumerate(caches):
                kc[i, :, pos[b]] = k[b]  # [nkv, hd] into [nkv, cap, hd] at the row's position
                vc[i, :, pos[b]] = v[b]
            if mask is None:
                outs = [
                    F.scaled_dot_product_attention(
                        q[b, :, None][None],  # [1, nh, 1, hd]
                        kc[i, None, :, : pos[b] + 1],  # [1, nkv, pos+1, hd]
                        vc[i, None, :, : pos[b] + 1],
                        enable_gqa=nh != lean.nkv,
                    ).reshape(nh * hd)
                    for b, (kc, vc) in enumerate(caches)
                ]
                att = torch.stack(outs)  # [B, nh * hd]
            else:
                lmax = mask.shape[-1]
                # zero padding, not the caches' unwritten rows: a masked NaN would still poison the sum
                kp = q.new_zeros((B, lean.nkv, lmax, hd))  # [B, nkv, Lmax, hd]
                vp = q.new_zeros((B, lean.nkv, lmax, hd))
                for b, (kc, vc) in enumerate(caches):
                    kp[b, :, : pos[b] + 1] = kc[i, :, : pos[b] + 1]
                    vp[b, :, : pos[b] + 1] = vc[i, :, : pos[b] + 1]
                att = F.scaled_dot_product_attention(
                    q[:, :, None], kp, vp, attn_mask=mask, enable_gqa=nh != lean.nkv
                ).reshape(B, nh * hd)  # [B, nh, 1, hd] -> [B, nh * hd]
            x = lean.finish_layer(L, x, att)  # MoE on [1, B, H]: the shared expert work
        for s in slots:
            self.pos[s] += 1
        return lean.head(x)  # [B, V]


@dataclass
class _Seq:
    seq_id: int
    req: SeqRequest
    stop: frozenset[int]
    gen: torch.Generator | None
    slot: int = -1
    produced: list[int] = field(default_factory=list)
    done: str | None = None  # finish reason once finished


class BatchRunner:
    """Continuous batching over one engine; see the module docstring (single-threaded).

    Beyond the server's interface: `serial=True` forces serial mode on a lean engine, `attention`
    picks the decode attention variant. stats(): steps, decode_steps, mean_batch (rows per decode
    step), tokens_generated (first tokens included), prefill_tokens, mode, max_batch, running, pending,
    kv_cache_bytes (held by the slots' caches; 0 in serial mode).
    """

    def __init__(self, engine: Engine, max_batch: int = 8, serial: bool = False, attention: Attention = "loop") -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        self.engine, self.max_batch = engine, max_batch
        lean = engine.decoder if isinstance(engine.decoder, LeanDecoder) else None
        self.mode: Literal["batched", "serial"] = "batched" if lean is not None and not serial else "serial"
        self._slots = SlotDecoder(lean, max_batch, attention) if lean is not None and self.mode == "batched" else None
        self._capacity = max_batch if self.mode == "batched" else 1
        self._free = list(range(self._capacity))[::-1]  # pop() gives the lowest slot
        self._pending: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}  # seq_id -> sequence holding a slot
        self._cancelled: list[int] = []  # to report at the next step
        self._next_id = 0
        self._vocab = int(getattr(engine.loaded.config, "vocab_size", 0) or 0)
        self._n = {"steps": 0, "decode_steps": 0, "decode_rows": 0, "tokens_generated": 0, "prefill_tokens": 0}

    # -- queue -------------------------------------------------------------------
    def add(self, req: SeqRequest) -> int:
        """Validate and queue a request -> its seq_id (never refuses for lack of a free slot)."""
        ids = req.prompt_ids
        if not ids:
            raise ConfigError("prompt_ids is empty; a request needs at least one prompt token")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ConfigError("prompt_ids must be a list of int token ids")
        if self._vocab and (min(ids) < 0 or max(ids) >= self._vocab):
            bad = next(t for t in ids if not 0 <= t < self._vocab)
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary of {self._vocab} tokens")
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {req.max_new_tokens}")
        if not isinstance(req.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a SamplingConfig, got {type(req.sampling).__name__}")
        self.engine.check_fits(len(ids), req.max_new_tokens)
        stop = frozenset(self.engine.eos_ids) if req.stop_ids is None else frozenset(req.stop_ids)
        seed = req.sampling.seed
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        seq = _Seq(self._next_id, req, stop, gen)
        self._next_id += 1
        self._pending.append(seq)
        return seq.seq_id

    def cancel(self, seq_id: int) -> None:
        """Drop a pending or running sequence now (its slot is freed); the next step() reports it."""
        for seq in self._pending:
            if seq.seq_id == seq_id:
                self._pending.remove(seq)
                self._cancelled.append(seq_id)
                return
        running = self._running.pop(seq_id, None)
        if running is not None:
            self._free.append(running.slot)
            self._cancelled.append(seq_id)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def idle(self) -> bool:
        """Nothing running or pending (and no cancellation left to report: step() would return [])."""
        return not self._running and not self._pending and not self._cancelled

    # -- stepping ----------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Report cancellations, admit + prefill, one shared decode step, free the finished."""
        events = [StepEvent(s, None, True, "cancelled") for s in self._cancelled]
        self._cancelled = []
        self._n["steps"] += 1
        # 1. admit pending requests into free slots; each prefill emits its sequence's first token
        batch = [s for s in self._running.values() if s.done is None]  # decoded in 2: not the fresh ones
        while self._pending and self._free:
            seq = self._pending.popleft()
            seq.slot = self._free.pop()
            self._running[seq.seq_id] = seq
            events.append(self._emit(seq, self._prefill(seq)))
        # 2. one decode step for every running sequence that did not just get its first token
        if batch:
            logits = self._decode(batch)  # [B, V]
            self._n["decode_steps"] += 1
            self._n["decode_rows"] += len(batch)
            events.extend(self._emit(s, logits[b]) for b, s in enumerate(batch))
        # 3. free the finished
        for seq in [s for s in self._running.values() if s.done is not None]:
            del self._running[seq.seq_id]
            self._free.append(seq.slot)
        return events

    def _emit(self, seq: _Seq, logits: torch.Tensor) -> StepEvent:
        """Sample seq's next token from logits [V] and decide whether it finished."""
        tok = sample(logits, seq.req.sampling, seq.gen)
        seq.produced.append(tok)
        self._n["tokens_generated"] += 1
        if tok in seq.stop:
            seq.done = "stop"
        elif len(seq.produced) >= seq.req.max_new_tokens:
            seq.done = "length"
        return StepEvent(seq.seq_id, tok, seq.done is not None, seq.done)

    def _prefill(self, seq: _Seq) -> torch.Tensor:
        """seq's prompt into its slot -> logits [V] of the last position (one Engine.step). The slot's cache is
        sized for the prompt and every generated token but the last (which is never fed back)."""
        engine, ids = self.engine, seq.req.prompt_ids
        self._n["prefill_tokens"] += len(ids)
        slots = self._slots
        if slots is not None:
            reserve = len(ids) + seq.req.max_new_tokens - 1
            return engine.step(index=0, run=lambda: slots.prefill(seq.slot, ids, reserve=reserve))
        engine.decoder.reset()
        with torch.inference_mode():
            return engine.step(_row(ids, engine), index=0)[-1]

    def _decode(self, batch: list[_Seq]) -> torch.Tensor:
        """One token for each sequence of `batch` -> logits [B, V] (one Engine.step)."""
        engine, slots = self.engine, self._slots
        tokens = [s.produced[-1] for s in batch]
        index = self._n["decode_steps"] + 1
        if slots is not None:
            rows = [s.slot for s in batch]
            return engine.step(index=index, run=lambda: slots.decode(rows, tokens))
        with torch.inference_mode():  # serial: one sequence owns the engine's decoder
            return engine.step(_row(tokens, engine), index=index)[-1:]

    def stats(self) -> dict[str, Any]:
        n = self._n
        return {
            "mode": self.mode,
            "max_batch": self.max_batch,
            "steps": n["steps"],
            "decode_steps": n["decode_steps"],
            "mean_batch": n["decode_rows"] / n["decode_steps"] if n["decode_steps"] else 0.0,
            "tokens_generated": n["tokens_generated"],
            "prefill_tokens": n["prefill_tokens"],
            "running": self.running,
            "pending": self.pending,
            "kv_cache_bytes": self._slots.cache_bytes() if self._slots is not None else 0,
        }


def _row(ids: list[int], engine: Engine) -> torch.Tensor:
    """Token ids as the [1, T] row Engine.step takes (the serial path: T tokens of one sequence)."""
    return torch.tensor([ids], device=engine.device)
