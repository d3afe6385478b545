"""Token ids to text for the server: incremental detokenization and OpenAI `stop` strings.

`TextStream.push(token)` returns the text that may be sent now. Invariants:
- never a broken character: a token that ends inside a multi-byte UTF-8 sequence (decoded as
  U+FFFD) is held until the next token completes it (vLLM's prefix/read-offset scheme, O(1) per
  token: only the ids since the last complete piece are decoded);
- the first generated tokens are decoded after a few prompt ids, so tokenizers that drop a word's
  leading space at the start of a decode (SentencePiece) still give the right text;
- `stop` strings follow OpenAI: generation ends at the first occurrence of any of them, and the
  stop string itself is never sent. Text that could be the start of a stop string is held back
  until it is known not to be one; `finish()` releases what is held when the sequence ends.
- special tokens (EOS) are skipped in the text.
"""

from __future__ import annotations

from typing import Any

PROMPT_CONTEXT = 4  # prompt ids decoded before the first generated one


class TextStream:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])  # decode context, then the generated ids
        self.prefix = 0  # ids[prefix:read] decode to text already in self.text
        self.read = len(self.ids)
        self.stops = [s for s in stops if s]
        self.text = ""  # generated text so far (cut at a stop string once one matched)
        self.sent = 0  # characters of self.text already returned
        self.stopped = False  # a stop string matched: the caller ends the generation

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True)) if ids else ""

    def push(self, token: int) -> str:
        """Add one generated token; the text now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: the rest of the text (an unfinished character as U+FFFD)."""
        if not self.stopped and self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix : self.read])
            after = self._decode(self.ids[self.prefix :])
            self.text += after[len(before) :]
            self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # 1. a stop string in the unsent text (or straddling the sent boundary) ends the sequence there
        if self.stops and not self.stopped:
            longest = max(len(s) for s in self.stops)
            start = max(0, self.sent - longest + 1)
            hits = [p for p in (self.text.find(s, start) for s in self.stops) if p >= 0]
            if hits:
                cut = max(min(hits), self.sent)
                self.text, self.stopped = self.text[:cut], True
                return self._take(cut)
        # 2. hold back a tail that may still grow into a stop string
        hold = 0 if final or self.stopped else self._partial_stop()
        return self._take(len(self.text) - hold)

    def _partial_stop(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out


__all__ = ["TextStream"]
