"""Log-probabilities in OpenAI's response shapes, from the runner's per-token figures.

The runner (runtime/batch.py) reports, per sampled token, its logprob (log_softmax of the raw fp32
logits, before temperature and top_p) and the top-k (token id, logprob) pairs; with echo, the same
for every prompt token on the sequence's first event (the first prompt token has none: None).
This module turns those into:

- completions (`logprobs: k`, OpenAI's legacy shape): `{"tokens": [str], "token_logprobs":
  [float | None], "top_logprobs": [{str: float} | None], "text_offset": [int]}`. Each top_logprobs
  dict holds the k best tokens and always the chosen one (so up to k + 1 entries, as OpenAI
  documents); a token whose logprob is None (the first echoed prompt token) has None there.
  `text_offset[i]` is where token i starts in the choice's `text` (the echoed prompt included),
  counted over the token strings as vLLM does;
- chat (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}] (k best)}], "refusal": None}`.

Token strings (`TokenNames`): the token's own text (a SentencePiece word marker as a space); a token
that is not whole UTF-8 on its own (a byte-level or byte-fallback piece of a multi-byte character) is
`bytes:\\xNN...` as OpenAI writes it, and `bytes` is always the token's raw UTF-8 bytes, so the bytes
of a sequence's tokens concatenate to its text. Without a tokenizer a token is `token_id:N`.
Dict keys that collide (two ids with one string) keep the better logprob.

Invariants: logprobs are passed through unchanged (the float the runner computed), except -inf,
reported as LOGPROB_FLOOR (-9999.0, as OpenAI does: JSON has no infinity); NaN is never reported
(APIError 500: the model produced non-finite values).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moetier.runtime.batch import StepEvent
from moetier.serve.errors import APIError

LOGPROB_FLOOR = -9999.0  # reported for -inf
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI: 5 for completions, 20 for chat)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_SP_SPACE = "\u2581"  # SentencePiece's word marker
TopK = tuple[tuple[int, float], ...]


def _byte_unicode() -> dict[str, int]:
    """The reversible byte <-> printable character map of byte-level BPE (GPT-2 style): character -> byte.
    Printable Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_DECODER = _byte_unicode()


@dataclass(frozen=True)
class TokenLogprob:
    """One reported token: its id, its logprob (None: the first prompt token) and the top-k, best first."""

    token: int
    logprob: float | None
    top: TopK = ()


def _finite(x: float) -> float:
    if math.isnan(x):
        raise APIError(500, "the model produced a NaN log-probability (non-finite logits)", None, "numerical_error")
    return LOGPROB_FLOOR if x == -math.inf else float(x)


def event_entries(ev: StepEvent, prompt_ids: Sequence[int] | None) -> list[TokenLogprob]:
    """The entries one event brings: the prompt's (when `prompt_ids` is given: echo, first event), then the
    sampled token's (when the event has one with a logprob)."""
    out: list[TokenLogprob] = []
    if prompt_ids is not None:
        lps = ev.prompt_logprobs
        if lps is None:
            raise APIError(500, "echo with logprobs: the runner reported no prompt logprobs")
        if len(lps) != len(prompt_ids):
            raise APIError(500, f"the runner reported {len(lps)} prompt logprobs for {len(prompt_ids)} prompt tokens")
        tops = ev.prompt_top_logprobs or ((),) * len(lps)
        out += [TokenLogprob(t, lp, top) for t, lp, top in zip(prompt_ids, lps, tops, strict=True)]
    if ev.token is not None and ev.logprob is not None:
        out.append(TokenLogprob(ev.token, ev.logprob, ev.top_logprobs))
    return out


class TokenNames:
    """Token id -> (string, raw bytes) for logprob output, cached per id (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _raw(self, token: int) -> bytes:
        tok = self.tok
        piece = tok.convert_ids_to_tokens(token)
        piece = piece if isinstance(piece, str) else ""
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        text = str(tok.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        if "\ufffd" in text and piece and all(c in _BYTE_DECODER for c in piece):  # a byte-level piece
            return bytes(_BYTE_DECODER[c] for c in piece)
        if piece.startswith(_SP_SPACE) and not text.startswith(" "):  # decode drops a leading word marker
            text = " " + text
        return text.encode("utf-8", "surrogatepass")

    def get(self, token: int) -> tuple[str, bytes]:
        hit = self._cache.get(token)
        if hit is None:
            if self.tok is None:
                name = f"token_id:{token}"
                hit = (name, name.encode())
            else:
                raw = self._raw(token)
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                hit = (name, raw)
            self._cache[token] = hit
        return hit

    def name(self, token: int) -> str:
        return self.get(token)[0]


def completion_logprobs(entries: Sequence[TokenLogprob], names: TokenNames, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object of `entries`; the first token starts at `offset` in the text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        name = names.name(e.token)
        offsets.append(offset)
        offset += len(name)
        tokens.append(name)
        if e.logprob is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        lp = _finite(e.logprob)
        token_logprobs.append(lp)
        top: dict[str, float] = {}
        for tid, tlp in e.top:
            top.setdefault(names.name(tid), _finite(tlp))  # best first: a colliding later string is worse
        top.setdefault(name, lp)  # the chosen token is always there
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def text_length(entries: Sequence[TokenLogprob], names: TokenNames) -> int:
    """Characters the entries' token strings take (the next text_offset moves on by this)."""
    return sum(len(names.name(e.token)) for e in entries)


def chat_logprobs(entries: Sequence[TokenLogprob], names: TokenNames, top_k: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object of `entries` with `top_k` alternatives per token."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        name, raw = names.get(token)
        return {"token": name, "logprob": _finite(logprob), "bytes": list(raw)}

    content = []
    for e in entries:
        if e.logprob is None:  # chat never echoes; a prompt entry cannot get here
            continue
        content.append(one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top[:top_k]]})
    return {"content": content, "refusal": None}


__all__ = [
    "LOGPROB_FLOOR",
    "MAX_LOGPROBS",
    "TokenLogprob",
    "TokenNames",
    "chat_logprobs",
    "completion_logprobs",
    "event_entries",
    "text_length",
]
