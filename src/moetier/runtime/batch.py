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
- with `BatchConfig.batch_invariant` a sequence's tokens do not depend on the batch at all (bf16
  included): each decode row is its own one-row forward (the B = 1 decode, the same code a sequence
  alone takes), so no matmul ever sees another sequence's rows. Cost: B forwards per decode step
  instead of one (experts are still fetched once per step while the cache holds them, but each row
  reads and computes them alone), i.e. the decode throughput of serial decoding;
- sampling is per request (its own torch.Generator when seeded), so a seeded request draws the
  same tokens whatever else is in the batch;
- logprobs are log_softmax of the raw logits in fp32 (before temperature / top_p); echo's prompt
  logprobs come from the prefill's logits of every prompt position (computed only when echo asks);
- a slot is held from admission to the end of the step in which its sequence finishes, or until
  `cancel`; `running <= max_batch` always;
- KV budget (`kv_budget_bytes`): a request reserves its whole KV cache at admission (prompt +
  max_new_tokens - 1 tokens, rounded up to KV_CHUNK as the slot really allocates it); it waits in
  pending (first come, first served) while the budget cannot take it, and add() refuses one that
  could never fit alone. Under a budget a slot's cache is released when its sequence ends, so the
  caches the slots hold are exactly the reserved bytes: `kv_cache_bytes <= kv_budget_bytes` always.
  Without a budget a slot keeps its cache for its next sequence (grown only when a longer one comes);
- per-sequence failure: an ExpertReadError or NumericalError raised by a step fails only the
  sequences of the rows it names (decode: row b is the step's b-th sequence; prefill: the sequence
  being prefilled) with a finish_reason "error" event; their slots are freed and the step is retried
  for the rest (KV writes are positional and SlotDecoder.decode advances positions only after the
  whole forward, so a retry rewrites the same cells). Every retry removes at least one sequence (an
  error naming no row of the step fails all of them), so a step ends after at most B tries. Non-finite
  logits are Engine.step's NumericalError (rows: the rows at fault, logits: the whole output): that
  forward ran to its end (positions moved on), so the named rows fail and the others are sampled from
  its logits, with no retry. Non-finite logits are never sampled;
- single-threaded: every method is called from one thread (the server's worker). The engine has
  one user at a time: while the runner has work it owns the decoder. In batched mode the slots
  have their own caches, so Engine.generate() in between does not disturb them; in serial mode
  the runner uses the engine's decoder itself, which generate() resets (the running sequence is
  then lost).

Every prefill and decode step is one Engine.step (trace step index, precision switching), with the
slot decoder's call as its forward in batched mode (batch_invariant: one Engine.step per row). A failed
forward's routing never reaches the trace (Engine.step takes it back): a retried step's rows are the
retry's alone, and a decode step's row b is its b-th sequence's token (`rows_are_tokens`), so a
NumericalError's finite rows, sampled here, keep their routing in the trace.

Modes: "batched" when the engine's decoder is the LeanDecoder (runtime/lean.py); otherwise
"serial": one sequence holds the one slot until it finishes, through the engine's decoder
(reset + forward), behind the same interface. Serial mode is batch invariant by construction; its KV
budget counts prompt + max_new_tokens - 1 tokens at the model's per-token KV size (the decoder's
own cache belongs to the engine).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from moetier.config import SamplingConfig
from moetier.errors import ConfigError, ExpertReadError, NumericalError
from moetier.runtime.engine import Engine, sample
from moetier.runtime.lean import LeanDecoder, kv_token_bytes

Attention = Literal["loop", "padded"]
KV_CHUNK = 256  # a slot's KV cache is sized in multiples of this many tokens
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
ECHO_CHUNK = 256  # echo scores the prompt this many positions at a time (a [ECHO_CHUNK, V] fp32 block at most)
SEQ_FAILURES = (ExpertReadError, NumericalError)  # errors that fail only the sequences they name
TopK = tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 8  # sequences decoded together (slots)
    attention: Attention = "loop"  # decode attention variant (module docstring)
    kv_budget_bytes: int | None = None  # KV cache bytes all slots may hold; None: unbounded
    batch_invariant: bool = False  # a prompt's tokens do not depend on what else is in the batch

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.attention not in ("loop", "padded"):
            raise ConfigError(f"attention must be 'loop' or 'padded', got {self.attention!r}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise ConfigError(f"kv_budget_bytes must be positive (or None: unbounded), got {self.kv_budget_bytes}")


@dataclass(frozen=True)
class SeqRequest:
    prompt_ids: list[int]  # non-empty
    max_new_tokens: int  # >= 1; 0 only with echo (prefill only: the prompt's logprobs, no token)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # per request; seed -> its own torch.Generator
    stop_ids: frozenset[int] | None = None  # None -> the engine's EOS ids; empty -> never stop early
    logprobs: int | None = None  # None: none; 0: the sampled token's logprob; k in 1..20: plus the top k
    echo: bool = False  # also report the prompt tokens' logprobs (the first prompt token's is None)


@dataclass(frozen=True)
class StepEvent:
    seq_id: int
    token: int | None  # None when finished without a new token (cancelled, error, timeout, echo-only)
    finished: bool
    # "stop" (hit a stop id; the stop token IS reported), "length", "cancelled", "error" (this sequence failed
    # alone: `error` says why), "timeout" (the server's request time limit, serve/worker.py)
    finish_reason: str | None
    logprob: float | None = None  # log_softmax of the raw logits (fp32) at the sampled token (logprobs set)
    top_logprobs: TopK = ()  # the top `logprobs` tokens, best first
    prompt_logprobs: tuple[float | None, ...] | None = None  # echo (first event): one per prompt token, first None
    prompt_top_logprobs: tuple[TopK, ...] | None = None  # echo with logprobs >= 1: per prompt token, first ()
    error: BaseException | None = None  # finish_reason "error": the sequence's failure


class SlotDecoder:
    """S independent sequences over a LeanDecoder's weights; slot s has its own KV cache
    [L, nkv, cap_s, hd] (k and v), sized on the slot's prefill to what its sequence may reach
    (`reserve`, rounded up to KV_CHUNK tokens, at most max_len) and kept for the slot's next sequence,
    grown (reallocated) only when a longer one comes, unless `release`d. So S slots of short requests
    do not cost S full-context caches (on CUDA torch.empty takes real memory).

    Invariants: a slot's sequence never outgrows its cache: decode raises ConfigError naming the slot
    before writing past it; decode advances the positions only after the whole forward (a failed step
    leaves them as they were, and its cache writes are rewritten by a retry)."""

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

    def cap_for(self, tokens: int) -> int:
        """The cache a sequence of `tokens` tokens gets: rounded up to KV_CHUNK, at most max_len."""
        return min(self.max_len, -(-tokens // KV_CHUNK) * KV_CHUNK)

    @property
    def token_bytes(self) -> int:
        """KV bytes per cached token (k and v, every layer): the lean decoder's (lean.kv_token_bytes)."""
        return self.lean.token_bytes

    def _reserve(self, slot: int, tokens: int) -> None:
        """Make slot's cache hold `tokens` (its old contents are dropped when it must grow)."""
        if tokens > self.max_len:
            raise ConfigError(f"sequence of {tokens} tokens exceeds the KV cache of {self.max_len}")
        if self.cap[slot] >= tokens:
            return
        lean = self.lean
        cap = self.cap_for(tokens)
        self.release(slot)  # the old cache goes back to the allocator first
        shape = (len(lean.layers), lean.nkv, cap, lean.hd)
        self.k[slot] = torch.empty(shape, dtype=lean.kv_dtype, device=lean.device)
        self.v[slot] = torch.empty(shape, dtype=lean.kv_dtype, device=lean.device)
        self.cap[slot] = cap

    def release(self, slot: int) -> None:
        """Drop slot's cache (its next prefill allocates one of the size it needs)."""
        self._check(slot)
        self.k[slot] = self.v[slot] = None
        self.cap[slot] = self.pos[slot] = 0

    def _cache(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[slot], self.v[slot]
        if k is None or v is None:
            raise ConfigError(f"slot {slot} has no sequence; prefill it first")
        return k, v

    def cache_bytes(self) -> int:
        """Bytes held by the slots' KV caches (k and v)."""
        return sum(2 * t.numel() * t.element_size() for t in self.k if t is not None)

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], reserve: int | None = None, hidden: bool = False) -> torch.Tensor:
        """Reset `slot`, size its cache for `reserve` tokens (default: max_len; at least the prompt) and
        run the prompt into it -> logits [V] of the last position, or (`hidden`) the last layer's output
        [T, H] of every position (lean.head turns rows of it into logits)."""
        self._check(slot)
        self._reserve(slot, max(len(ids), self.max_len if reserve is None else reserve))
        k, v = self._cache(slot)
        self.pos[slot] = 0
        out = self.lean.run(torch.tensor([ids], device=self.lean.device), 0, k, v, hidden=hidden)  # [T, H] / [1, V]
        self.pos[slot] = len(ids)
        return out if hidden else out[0]

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
        if lean.fused is not None:  # the native step: each row attends its own cache, exactly (no padding)
            out = lean.fused.run_rows(torch.tensor(tokens, device=lean.device), pos, caches)  # [B, V]
            for s in slots:
                self.pos[s] += 1
            return out
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
            if L.sinks is not None or L.window:  # GPT-OSS: sinks, sliding windows; each row on its own cache
                att = torch.cat([lean.attend(L, q[b : b + 1], kc[i], vc[i], pos[b]) for b, (kc, vc) in
                                 enumerate(caches)])  # fmt: skip
            elif mask is None:
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
        out = lean.head(x)  # [B, V]
        # 3. positions advance only now: a step that raised above left them (and a retry's cache cells) as they were
        for s in slots:
            self.pos[s] += 1
        return out


@dataclass
class _Seq:
    seq_id: int
    req: SeqRequest
    stop: frozenset[int]
    gen: torch.Generator | None
    kv_bytes: int  # KV bytes reserved while the sequence holds a slot
    slot: int = -1
    produced: list[int] = field(default_factory=list)
    done: str | None = None  # finish reason once finished


class BatchRunner:
    """Continuous batching over one engine; see the module docstring (single-threaded).

    Beyond the server's interface: `serial=True` forces serial mode on a lean engine. stats(): steps,
    decode_steps, mean_batch (rows per decode step), tokens_generated (first tokens included), prefill_tokens,
    mode, max_batch, batch_invariant, running, pending, kv_cache_bytes (held by the slots' caches; 0 in serial
    mode), kv_budget_bytes (0: unbounded), kv_reserved_bytes (reserved by the running sequences), kv_waiting
    (pending requests held back by the KV budget), sequence_errors (sequences failed alone).
    """

    def __init__(self, engine: Engine, config: BatchConfig | None = None, serial: bool = False) -> None:
        config = config if config is not None else BatchConfig()
        if not isinstance(config, BatchConfig):
            raise ConfigError(f"BatchRunner takes a BatchConfig, got {type(config).__name__}")
        self.engine, self.config, self.max_batch = engine, config, config.max_batch
        lean = engine.decoder if isinstance(engine.decoder, LeanDecoder) else None
        self.mode: Literal["batched", "serial"] = "batched" if lean is not None and not serial else "serial"
        batched = lean is not None and self.mode == "batched"
        self._slots = SlotDecoder(lean, config.max_batch, config.attention) if batched and lean is not None else None
        self._capacity = config.max_batch if self.mode == "batched" else 1
        self._free = list(range(self._capacity))[::-1]  # pop() gives the lowest slot
        self._pending: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}  # seq_id -> sequence holding a slot
        self._cancelled: list[int] = []  # to report at the next step
        self._next_id = 0
        self._vocab = int(getattr(engine.loaded.config, "vocab_size", 0) or 0)
        self._token_bytes = (  # KV bytes per token: the slots' caches, else the model's (lean.kv_token_bytes both)
            self._slots.token_bytes if self._slots is not None else kv_token_bytes(engine.loaded.config, engine.dtype)
        )
        self._reserved = 0  # KV bytes reserved by the running sequences
        self._kv_blocked = False  # the last admission stopped at the KV budget
        self._n = {"steps": 0, "decode_steps": 0, "decode_rows": 0, "tokens_generated": 0, "prefill_tokens": 0,
                   "sequence_errors": 0}  # fmt: skip

    # -- queue -------------------------------------------------------------------
    def kv_bytes_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV bytes a request reserves: prompt + every new token but the last (never fed back), in the slot
        cache's KV_CHUNK rounding (batched) or exactly (serial)."""
        tokens = max(prompt_tokens, prompt_tokens + max_new_tokens - 1)
        if self._slots is not None:
            tokens = self._slots.cap_for(tokens)
        return tokens * self._token_bytes

    def add(self, req: SeqRequest) -> int:
        """Validate and queue a request -> its seq_id (never refuses for lack of a free slot or of KV
        budget now; refuses one the KV budget could never take)."""
        # 1. the request itself
        ids = req.prompt_ids
        if not ids:
            raise ConfigError("prompt_ids is empty; a request needs at least one prompt token")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ConfigError("prompt_ids must be a list of int token ids")
        if self._vocab and (min(ids) < 0 or max(ids) >= self._vocab):
            bad = next(t for t in ids if not 0 <= t < self._vocab)
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary of {self._vocab} tokens")
        least = 0 if req.echo else 1
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < least:
            raise ConfigError(f"max_new_tokens must be at least {least}{'' if req.echo else ' (0 only with echo)'}, "
                              f"got {req.max_new_tokens}")  # fmt: skip
        if not isinstance(req.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a SamplingConfig, got {type(req.sampling).__name__}")
        lp = req.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs must be None or an int in 0..{MAX_TOP_LOGPROBS}, got {lp!r}")
        # 2. the limits: the context, the KV budget
        self.engine.check_fits(len(ids), max(1, req.max_new_tokens))
        need = self.kv_bytes_for(len(ids), req.max_new_tokens)
        budget = self.config.kv_budget_bytes
        if budget is not None and need > budget:
            raise ConfigError(
                f"a prompt of {len(ids)} tokens + {req.max_new_tokens} new tokens needs {need} bytes of KV cache, "
                f"more than the whole KV budget of {budget} bytes (lower max_tokens or raise the KV budget)"
            )
        # 3. queue it
        stop = frozenset(self.engine.eos_ids) if req.stop_ids is None else frozenset(req.stop_ids)
        seed = req.sampling.seed
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        seq = _Seq(self._next_id, req, stop, gen, need)
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
        running = self._running.get(seq_id)
        if running is not None:
            self._release(running)
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
        # 1. admit pending requests into free slots while the KV budget takes them (first come, first served);
        #    each prefill emits its sequence's first event
        batch = [s for s in self._running.values() if s.done is None]  # decoded in 2: not the fresh ones
        budget = self.config.kv_budget_bytes
        self._kv_blocked = False
        while self._pending and self._free:
            if budget is not None and self._reserved + self._pending[0].kv_bytes > budget:
                self._kv_blocked = True
                break
            seq = self._pending.popleft()
            seq.slot = self._free.pop()
            self._reserved += seq.kv_bytes
            self._running[seq.seq_id] = seq
            events.append(self._admit(seq))
        # 2. one decode step for every running sequence that did not just get its first event
        if batch:
            events.extend(self._decode_step(batch))
        # 3. free the finished
        for seq in [s for s in self._running.values() if s.done is not None]:
            self._release(seq)
        return events

    def _release(self, seq: _Seq) -> None:
        """seq leaves its slot: the slot is free, its KV reservation returned (and under a budget its cache)."""
        del self._running[seq.seq_id]
        self._free.append(seq.slot)
        self._reserved -= seq.kv_bytes
        if self._slots is not None and self.config.kv_budget_bytes is not None:
            self._slots.release(seq.slot)  # held bytes stay the reserved bytes

    def _fail(self, seq: _Seq, exc: BaseException) -> StepEvent:
        """End seq alone with `exc` (its slot is freed at the end of the step)."""
        seq.done = "error"
        self._n["sequence_errors"] += 1
        return StepEvent(seq.seq_id, None, True, "error", error=exc)

    @torch.inference_mode()
    def _admit(self, seq: _Seq) -> StepEvent:
        """Prefill seq into its slot (one Engine.step) -> its first event (a token, or the end: echo only,
        failure). A failure of the prefill is the sequence's alone, whatever rows it names."""
        # 1. the prefill: the last position's logits; echo: rows that give every position's (`head` of them)
        req = seq.req
        try:
            rows, head = self._prefill(seq, every=req.echo)  # [T, H or V] (echo) or [1, V]
            last = head(rows[-1:])[0]  # [V]
        except SEQ_FAILURES as exc:
            return self._fail(seq, exc)
        # 2. echo: the prompt tokens' logprobs (position t scores prompt token t + 1), ECHO_CHUNK positions at a time
        prompt_lp: tuple[float | None, ...] | None = None
        prompt_top: tuple[TopK, ...] | None = None
        if req.echo:
            got: list[float | None] = [None]
            tops: list[TopK] = [()]
            ids = req.prompt_ids
            for a in range(0, len(ids) - 1, ECHO_CHUNK):
                b = min(a + ECHO_CHUNK, len(ids) - 1)
                lps = F.log_softmax(head(rows[a:b]).float(), dim=-1)  # [b - a, V]
                target = torch.tensor(ids[a + 1 : b + 1], device=lps.device)  # [b - a]
                got.extend(lps.gather(1, target[:, None])[:, 0].tolist())
                if req.logprobs:
                    tops.extend(_top(row, req.logprobs) for row in lps)
            prompt_lp = tuple(got)
            prompt_top = tuple(tops) if req.logprobs else None
        # 3. the first token (none for echo with max_new_tokens 0)
        if req.max_new_tokens == 0:
            seq.done = "length"
            return StepEvent(seq.seq_id, None, True, "length", None, (), prompt_lp, prompt_top)
        ev = self._emit(seq, last)
        if req.echo:
            ev = StepEvent(ev.seq_id, ev.token, ev.finished, ev.finish_reason, ev.logprob, ev.top_logprobs,
                           prompt_lp, prompt_top)  # fmt: skip
        return ev

    def _emit(self, seq: _Seq, logits: torch.Tensor) -> StepEvent:
        """Sample seq's next token from logits [V] and decide whether it finished."""
        tok = sample(logits, seq.req.sampling, seq.gen)
        seq.produced.append(tok)
        self._n["tokens_generated"] += 1
        if tok in seq.stop:
            seq.done = "stop"
        elif len(seq.produced) >= seq.req.max_new_tokens:
            seq.done = "length"
        logprob: float | None = None
        top: TopK = ()
        if seq.req.logprobs is not None:
            lps = F.log_softmax(logits.float(), dim=-1)  # [V]
            logprob = float(lps[tok])
            top = _top(lps, seq.req.logprobs)
        return StepEvent(seq.seq_id, tok, seq.done is not None, seq.done, logprob, top)

    def _decode_step(self, batch: list[_Seq]) -> list[StepEvent]:
        """One token for each sequence of `batch` -> their events (tokens, errors): the shared forward (one per
        row when batch_invariant), retried without the sequences a failure names."""
        events: list[StepEvent] = []
        index = self._n["decode_steps"] + 1
        self._n["decode_steps"] += 1
        self._n["decode_rows"] += len(batch)
        groups = [[s] for s in batch] if self.config.batch_invariant else [batch]
        for rows in groups:
            while rows:  # each pass ends the step or removes >= 1 row: at most len(rows) passes
                try:
                    logits = self._decode(rows, index)  # [B, V]
                except SEQ_FAILURES as exc:
                    failed = set(_rows_of(exc, len(rows)) or range(len(rows)))  # none named: the whole group
                    events.extend(self._fail(rows[b], exc) for b in sorted(failed))
                    rest = [(b, s) for b, s in enumerate(rows) if b not in failed]
                    ran = exc.logits if isinstance(exc, NumericalError) else None  # that forward ran to its end
                    if isinstance(ran, torch.Tensor):  # positions moved on: keep the finite rows, do not retry
                        events.extend(self._emit(s, ran[b]) for b, s in rest)
                        break
                    rows = [s for _, s in rest]
                    continue
                events.extend(self._emit(s, logits[b]) for b, s in enumerate(rows))
                break
        return events

    def _prefill(self, seq: _Seq, every: bool = False) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """seq's prompt into its slot (one Engine.step) -> (rows, head): rows [1, V] (the last position's logits) or,
        `every`, rows [T, *] for every position, and head mapping rows [n, *] to their logits [n, V] (batched: the
        last layer's output [T, H] and lean.head; serial: the decoder's logits [T, V] and the identity). The
        slot's cache is sized for the prompt and every generated token but the last (which is never fed back)."""
        engine, ids = self.engine, seq.req.prompt_ids
        self._n["prefill_tokens"] += len(ids)
        slots = self._slots
        if slots is not None:
            reserve = len(ids) + seq.req.max_new_tokens - 1
            run: Callable[[], torch.Tensor] = lambda: slots.prefill(seq.slot, ids, reserve, hidden=every)  # noqa: E731
            out = engine.step(index=0, run=run)  # [T, H] or [V]
            return (out, slots.lean.head) if every else (out[None], _same)
        engine.decoder.reset()
        with torch.inference_mode():
            out = engine.step(_row(ids, engine), index=0, all_logits=every)  # [T or 1, V]
        return out, _same

    def _decode(self, batch: list[_Seq], index: int) -> torch.Tensor:
        """One token for each sequence of `batch` -> logits [B, V] (one Engine.step)."""
        engine, slots = self.engine, self._slots
        tokens = [s.produced[-1] for s in batch]
        if slots is not None:
            rows = [s.slot for s in batch]
            run: Callable[[], torch.Tensor] = lambda: slots.decode(rows, tokens)  # noqa: E731
            return engine.step(index=index, run=run, rows_are_tokens=True)
        with torch.inference_mode():  # serial: one sequence owns the engine's decoder
            return engine.step(_row(tokens, engine), index=index, rows_are_tokens=True)[-1:]

    def stats(self) -> dict[str, Any]:
        n = self._n
        return {
            "mode": self.mode,
            "max_batch": self.max_batch,
            "batch_invariant": self.config.batch_invariant,
            "steps": n["steps"],
            "decode_steps": n["decode_steps"],
            "mean_batch": n["decode_rows"] / n["decode_steps"] if n["decode_steps"] else 0.0,
            "tokens_generated": n["tokens_generated"],
            "prefill_tokens": n["prefill_tokens"],
            "running": self.running,
            "pending": self.pending,
            "kv_cache_bytes": self._slots.cache_bytes() if self._slots is not None else 0,
            "kv_budget_bytes": self.config.kv_budget_bytes or 0,
            "kv_reserved_bytes": self._reserved,
            "kv_waiting": len(self._pending) if self._kv_blocked else 0,
            "sequence_errors": n["sequence_errors"],
        }


def _row(ids: list[int], engine: Engine) -> torch.Tensor:
    """Token ids as the [1, T] row Engine.step takes (the serial path: T tokens of one sequence)."""
    return torch.tensor([ids], device=engine.device)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _top(lps: torch.Tensor, k: int) -> TopK:
    """The k best (token id, logprob) of one position's log-probabilities lps [V], best first."""
    vals, idx = torch.topk(lps, k)  # [k] each
    return tuple(zip(idx.tolist(), vals.tolist(), strict=True))


def _rows_of(exc: ExpertReadError | NumericalError, n: int) -> list[int]:
    """The rows of a step of n rows that a failure names (both errors declare `rows`): decode feeds the MoE
    [1, B, H], so flattened row r is the step's r-th sequence."""
    return sorted({int(r) for r in exc.rows if 0 <= int(r) < n})
