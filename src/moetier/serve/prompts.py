"""Requests to token ids: completion prompts, chat prompts, and the `max_tokens` each may use.

Chat template: the tokenizer's own (`tokenizer.chat_template`, rendered with
`add_generation_prompt=True`) when it has one; otherwise the documented plain template
`PLAIN_CHAT`: one line per message, `<Role>: <content>` with the role capitalised
(System, Developer, User, Assistant), each followed by a newline, then `Assistant:`
for the reply. Example: `System: Be brief.\\nUser: Hi\\nAssistant:`.

Completion prompts: a string, a list of strings, token ids or a list of token id lists; each is one
prompt (a choice per prompt and sample), at most MAX_PROMPTS in one request. Token ids are checked
against the vocabulary; an empty prompt is a 400 naming it (`prompt` or `prompt.i`).

`max_tokens` defaults (and the limit): a prompt of P tokens in a context of C tokens can
take up to C - P + 1 new tokens (the last one is never fed back). Completions default to
`COMPLETION_MAX_TOKENS` = 16 (as OpenAI), capped at that limit; chat defaults to the rest of
the context (C - P + 1). An explicit value below the minimum (1; 0 for a completion with echo,
which scores the prompt alone) or above the limit is a 400 naming `max_tokens` (or
`max_completion_tokens`); a prompt that leaves no room is a 400 naming the prompt.
"""

from __future__ import annotations

from typing import Any

from moetier.serve.errors import APIError
from moetier.serve.schemas import ChatMessage

COMPLETION_MAX_TOKENS = 16
MAX_PROMPTS = 1024  # prompts in one completions request
PLAIN_CHAT = "{Role}: {content}\n"  # per message; the prompt ends with "Assistant:"


def _vocab_check(ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param!r} is outside the vocabulary of {vocab} tokens", param)


def completion_prompts(
    tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]], vocab: int
) -> list[tuple[list[int], str | None]]:
    """A completion's prompts (see the module docstring) -> (token ids, text or None when sent as ids) each."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items: list[Any] = list(prompt) if many else [prompt]
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    out: list[tuple[list[int], str | None]] = []
    for i, one in enumerate(items):
        param = f"prompt.{i}" if many else "prompt"
        if isinstance(one, str):
            if tokenizer is None:
                raise APIError(400, "the model has no tokenizer; send 'prompt' as token ids", param)
            ids, text = [int(t) for t in tokenizer.encode(one, add_special_tokens=False)], one
        else:
            ids, text = [int(t) for t in one], None
            _vocab_check(ids, vocab, param)
        if not ids:
            raise APIError(400, f"'{param}' is empty (no tokens after tokenization)", param)
        out.append((ids, text))
    return out


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
    requested: int | None,
    prompt_len: int,
    context: int,
    default: int | None,
    param: str,
    prompt_param: str,
    minimum: int = 1,
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
    if requested < minimum:
        why = " (0 only with echo)" if minimum == 1 and param == "max_tokens" and prompt_param == "prompt" else ""
        raise APIError(400, f"'{param}' must be at least {minimum}{why}, got {requested}", param)
    if requested > room:
        raise APIError(
            400, f"'{param}' of {requested} plus the prompt of {prompt_len} tokens exceeds the context of "
            f"{context} tokens (at most {room} new tokens fit)", param, "context_length_exceeded",
        )  # fmt: skip
    return requested


__all__ = ["COMPLETION_MAX_TOKENS", "MAX_PROMPTS", "PLAIN_CHAT", "chat_ids", "chat_text", "completion_prompts",
           "max_new_tokens"]  # fmt: skip
