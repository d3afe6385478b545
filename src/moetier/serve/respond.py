"""Turning the jobs of one request into OpenAI responses: one JSON body, or server-sent events.

A request has one or more choices (one per prompt and sample, `n`), each its own job on the worker;
choice `index` is prompt_index * n + sample. Formats (OpenAI): completions -> object
"text_completion" (choices[i].text), chat -> "chat.completion" (choices[i].message) or
"chat.completion.chunk" (choices[i].delta; the first chunk of each choice carries the role).
Streams are `data: {json}\\n\\n` lines ending with `data: [DONE]\\n\\n`, chunks of different choices
interleaved as their tokens come; with stream_options.include_usage a last chunk with empty choices
carries the usage. finish_reason is "stop" (EOS or a stop string) or "length". usage counts each
prompt once and every generated token of every choice, the EOS included (never in the text).
Logprobs (serve/logprobs.py) follow the tokens: a chunk carries the entries of the tokens consumed
since the last chunk of its choice; with echo, a completion choice's text and logprobs start with the
prompt's.

Errors: a job that ends with an APIError (the worker's: queue timeout, a sequence that failed, the
server stopping) or with finish_reason "timeout" (504) or "error" (500) ends the whole request:
before the response started (every non-streaming request; a stream whose first event has not come:
`open_stream` waits for it) it is that error's status and JSON; after a stream started it is a last
`data: {"error": ...}` event, then `data: [DONE]`. The other choices' jobs are cancelled.

Disconnects: while waiting for the next event, a task watches the ASGI channel for
`http.disconnect`; when it fires, or the stream generator is closed or cancelled (starlette does so
when the client goes away), every unfinished job is cancelled through the worker, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from moetier.runtime.batch import StepEvent
from moetier.serve.errors import APIError
from moetier.serve.logprobs import TokenLogprob, TokenNames, chat_logprobs, completion_logprobs, event_entries
from moetier.serve.logprobs import text_length as logprob_text_length
from moetier.serve.text import TextStream
from moetier.serve.worker import Job, Worker


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass(eq=False)
class Choice:
    """One choice of a request: its job, its text, and what has been reported of it."""

    index: int
    job: Job
    text: TextStream
    prompt_ids: list[int]
    prompt_text: str = ""  # echo: sent before the generated text
    completion_tokens: int = 0
    finish: str | None = None  # set when the choice ended (its job may still need cancelling)
    started: bool = False  # its first event came
    pending: list[TokenLogprob] = field(default_factory=list)  # logprob entries not yet sent (streaming)
    offset: int = 0  # completions text_offset of the next reported token


@dataclass
class Call:
    """One generation request as the response side sees it."""

    worker: Worker
    choices: list[Choice]
    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    logprobs: int | None = None  # None: none asked; else the top-k per token
    echo: bool = False  # completions: the prompt (and its logprobs) first
    names: TokenNames | None = None  # token strings of logprobs (needed when logprobs is not None)
    request_timeout_s: float | None = None  # for the 504's message

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        prompt, done = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def cancel_unfinished(self) -> None:
        for c in self.choices:
            self.worker.cancel(c.job)  # a no-op for a job that already ended


Piece = tuple[Choice, str, str | None, list[TokenLogprob]]  # (choice, text delta, finish_reason or None, entries)


async def _watch(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _check(call: Call, item: StepEvent | BaseException) -> StepEvent:
    """The event, or the error a failed job ended with as an APIError."""
    if isinstance(item, APIError):
        raise item
    if isinstance(item, BaseException):
        raise APIError(500, f"generation failed: {type(item).__name__}: {item}") from item
    if item.finished and item.finish_reason == "timeout":
        limit = f" of {call.request_timeout_s:g} s" if call.request_timeout_s is not None else ""
        raise APIError(504, f"the request ran past the request time limit{limit} (--request-timeout)", None,
                       "request_timeout")  # fmt: skip
    if item.finished and item.finish_reason == "error":
        why = f"{type(item.error).__name__}: {item.error}" if item.error is not None else "unknown error"
        raise APIError(500, f"generation failed: {why}", None, "generation_failed")
    return item


def _advance(call: Call, c: Choice, ev: StepEvent) -> Piece:
    """What one event of choice `c` adds: text to send, the finish reason if it ended, logprob entries."""
    # 1. the first event: the echoed prompt (text and logprob entries)
    head = ""
    prompt = None
    if not c.started:
        c.started = True
        if call.echo:
            head = c.prompt_text
            prompt = c.prompt_ids
    entries = event_entries(ev, prompt) if call.logprobs is not None else []
    # 2. the token: counted always; text unless it is the stop token
    if ev.token is not None:
        c.completion_tokens += 1
    if ev.finished and ev.finish_reason == "stop":  # the stop token: counted, never shown
        c.finish = "stop"
        return c, head + c.text.finish(), "stop", entries
    delta = c.text.push(ev.token) if ev.token is not None else ""
    if c.text.stopped:  # a stop string matched: end here, cancel the rest of its generation
        c.finish = "stop"
        call.worker.cancel(c.job)
        return c, head + delta, "stop", entries
    if ev.finished:
        c.finish = "length" if ev.finish_reason == "length" else "stop"
        return c, head + delta + c.text.finish(), c.finish, entries
    return c, head + delta, None, entries


async def _pieces(call: Call, request: Request) -> AsyncGenerator[Piece, None]:
    """Every event of every choice as a Piece, in arrival order, until all choices ended; on any early exit
    (client gone, an error, the consumer closing the generator) the unfinished jobs are cancelled."""
    watcher = asyncio.ensure_future(_watch(request))
    getters: dict[Choice, asyncio.Future[Any]] = {}
    try:
        while True:
            live = [c for c in call.choices if c.finish is None]
            if not live:
                return
            for c in live:
                if c not in getters:
                    getters[c] = asyncio.ensure_future(c.job.events.get())
            done, _ = await asyncio.wait({*getters.values(), watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done and not (done - {watcher}):
                raise ClientGone
            for c in live:
                getter = getters.get(c)
                if getter is None or not getter.done():
                    continue
                del getters[c]
                yield _advance(call, c, _check(call, getter.result()))
    finally:
        watcher.cancel()
        for getter in getters.values():
            getter.cancel()
        call.cancel_unfinished()


def _completion_logprobs(call: Call, c: Choice, entries: list[TokenLogprob]) -> dict[str, Any]:
    assert call.names is not None
    out = completion_logprobs(entries, call.names, c.offset)
    c.offset += logprob_text_length(entries, call.names)
    return out


def _logprobs(call: Call, c: Choice, entries: list[TokenLogprob]) -> dict[str, Any] | None:
    if call.logprobs is None or call.names is None:
        return None
    if call.chat:
        return chat_logprobs(entries, call.names, call.logprobs)
    return _completion_logprobs(call, c, entries)


async def collect(call: Call, request: Request) -> dict[str, Any]:
    """The whole response body of a non-streaming request."""
    parts: dict[Choice, list[str]] = {c: [] for c in call.choices}
    entries: dict[Choice, list[TokenLogprob]] = {c: [] for c in call.choices}
    async for c, delta, _, ents in _pieces(call, request):
        parts[c].append(delta)
        entries[c] += ents
    choices = []
    for c in call.choices:
        text = "".join(parts[c])
        if call.chat:
            choice: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": c.index, "text": text}
        choices.append(choice | {"logprobs": _logprobs(call, c, entries[c]), "finish_reason": c.finish or "stop"})
    obj = "chat.completion" if call.chat else "text_completion"
    return call._head(obj) | {"choices": choices, "usage": call.usage()}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk(call: Call, c: Choice, delta: str | None, finish: str | None, entries: list[TokenLogprob] | None = None,
           role: bool = False) -> dict[str, Any]:  # fmt: skip
    if call.chat:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
        choice: dict[str, Any] = {"index": c.index, "delta": d}
    else:
        choice = {"index": c.index, "text": delta or ""}
    lp = _logprobs(call, c, entries) if entries else None
    choice |= {"logprobs": lp, "finish_reason": finish}
    return call._head("chat.completion.chunk" if call.chat else "text_completion") | {"choices": [choice]}


def _events(call: Call, piece: Piece) -> list[str]:
    """The SSE events of one piece: nothing while its text is held back (its logprob entries wait for the
    next chunk of the choice); chat sends the finish reason in a chunk of its own."""
    c, delta, finish, entries = piece
    c.pending += entries
    if not delta and finish is None:
        return []
    sent, c.pending = c.pending, []
    if call.chat and finish is not None:
        out = [_sse(_chunk(call, c, delta, None, sent))] if delta or sent else []
        return [*out, _sse(_chunk(call, c, None, finish))]
    return [_sse(_chunk(call, c, delta, finish, sent))]


async def open_stream(call: Call, request: Request) -> AsyncIterator[str]:
    """The SSE body of a streaming request, started: it waits for the first event, so an error before it
    (a queue timeout, a failed prefill, a time limit) raises here as an APIError (or ClientGone) and the
    caller answers it with its own status."""
    pieces = _pieces(call, request)
    try:
        first = await anext(pieces)
    except StopAsyncIteration:  # no choices (cannot happen: a request has at least one)
        first = None
    except BaseException:
        await pieces.aclose()
        raise
    return _stream(call, pieces, first)


async def _stream(call: Call, pieces: AsyncGenerator[Piece, None], first: Piece | None) -> AsyncIterator[str]:
    """Server-sent events of a streaming request; errors after the start become an error event."""
    try:
        if call.chat:
            for c in call.choices:
                yield _sse(_chunk(call, c, None, None, role=True))
        if first is not None:
            for event in _events(call, first):
                yield event
        async for piece in pieces:
            for event in _events(call, piece):
                yield event
        if call.include_usage:
            yield _sse(call._head("chat.completion.chunk" if call.chat else "text_completion")
                       | {"choices": [], "usage": call.usage()})  # fmt: skip
    except ClientGone:
        return
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"


__all__ = ["Call", "Choice", "ClientGone", "collect", "open_stream"]
