"""Requests to token ids: completion prompts, chat prompts, and the `max_tokens` each may use.

Chat template: the tokenizer's own (`tokenizer.chat_template`, rendered with
`add_generation_prompt=True`) when it has one; otherwise the documented plain template
`PLAIN_CHAT`: one line per message, `<Role>: <content>` with the role capitalised
(System, Developer, User, Assistant), each followed by a newline, then `Assistant:`
for the reply. Example: `System: Be brief.\\nUser: Hi\\nAssistant:`.

`max_tokens` defaults (and the limit): a prompt of P tokens in a context of C tokens can
take up to C - P + 1 new tokens (the last one is never fed back). Completions default to
`COMPLETION_MAX_TOKENS` = 16 (as OpenAI), capped at that limit; chat defaults to the rest of
the context (C - P + 1). An explicit value below 1 or above the limit is a 400 naming
`max_tokens` (or `max_completion_tokens`); a prompt that leaves no room is a 400 naming the prompt.
"""

from __future__ import annotations

from typing import Any

from moetier.serve.errors import APIError
from moetier.serve.schemas import ChatMessage

COMPLETION_MAX_TOKENS = 16
PLAIN_CHAT = "{Role}: {content}\n"  # per message; the prompt ends with "Assistant:"


def _vocab_check(ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param!r} is outside the vocabulary of {vocab} tokens", param)


def completion_ids(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]], vocab: int) -> list[int]:
    """A completion's prompt (a string, token ids, or a list of one of those) -> token ids."""
    one: Any = prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, f"'prompt' holds {len(prompt)} prompts; send one per request", "prompt")
        one = prompt[0]
    if isinstance(one, str):
        if tokenizer is None:
            raise APIError(400, "the model has no tokenizer; send 'prompt' as token ids", "prompt")
        ids = [int(t) for t in tokenizer.encode(one, add_special_tokens=False)]
    else:
        ids = [int(t) for t in one]
        _vocab_check(ids, vocab, "prompt")
    if not ids:
        raise APIError(400, "'prompt' is empty (no tokens after tokenization)", "prompt")
    return ids


def chat_text(tokenizer: Any, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation: the tokenizer's chat template, or PLAIN_CHAT."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return str(tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False))
        except Exception as exc:  # jinja raises TemplateError for e.g. roles that must alternate
            raise APIError(400, f"the model's chat template rejected the messages: {exc}", "messages") from exc
    lines = [PLAIN_CHAT.format(Role=m.role.capitalize(), content=m.text()) for m in messages]
    return "".join(lines) + "Assistant:"


def chat_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    if tokenizer is None:
        raise APIError(400, "the model has no tokenizer, so chat is not available; use /v1/completions", "messages")
    ids = [int(t) for t in tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False)]
    if not ids:
        raise APIError(400, "'messages' give an empty prompt", "messages")
    return ids


def max_new_tokens(
    requested: int | None, prompt_len: int, context: int, default: int | None, param: str, prompt_param: str
) -> int:
    """The new-token budget of a request (see the module docstring); APIError(400) when it cannot fit."""
    room = context - prompt_len + 1
    if room < 1:
        raise APIError(
            400, f"the prompt of {prompt_len} tokens is longer than the context of {context} tokens",
            prompt_param, "context_length_exceeded",
        )  # fmt: skip
    if requested is None:
        return min(default, room) if default is not None else room
    if requested < 1:
        raise APIError(400, f"'{param}' must be at least 1, got {requested}", param)
    if requested > room:
        raise APIError(
            400, f"'{param}' of {requested} plus the prompt of {prompt_len} tokens exceeds the context of "
            f"{context} tokens (at most {room} new tokens fit)", param, "context_length_exceeded",
        )  # fmt: skip
    return requested


__all__ = ["COMPLETION_MAX_TOKENS", "PLAIN_CHAT", "chat_ids", "chat_text", "completion_ids", "max_new_tokens"]
