"""Turning a job's StepEvents into OpenAI responses: one JSON body, or server-sent events.

Formats (OpenAI): completions -> object "text_completion" (choices[0].text), chat ->
"chat.completion" (choices[0].message) or "chat.completion.chunk" (choices[0].delta; the first
chunk carries the role). Streams are `data: {json}\\n\\n` lines ending with `data: [DONE]\\n\\n`;
with stream_options.include_usage a last chunk with empty choices carries the usage. finish_reason
is "stop" (EOS or a stop string) or "length". usage counts prompt tokens and every generated
token, the EOS included (the EOS is never in the text).

Disconnects: while waiting for the next event, a task watches the ASGI channel for
`http.disconnect`; when it fires, or the stream generator is closed or cancelled (starlette does so
when the client goes away), the job is cancelled through the worker, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from moetier.runtime.batch import StepEvent
from moetier.serve.errors import APIError
from moetier.serve.text import TextStream
from moetier.serve.worker import Job, Worker


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass
class Call:
    """One generation request as the response side sees it."""

    worker: Worker
    job: Job
    text: TextStream
    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.completion_tokens = 0

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


async def _watch(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(job: Job, watcher: asyncio.Task[None]) -> StepEvent:
    """The job's next event; ClientGone if the client went first; the worker's error re-raised."""
    getter = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter not in done:
        getter.cancel()
        raise ClientGone
    item = getter.result()
    if isinstance(item, APIError):
        raise item
    if isinstance(item, BaseException):
        raise APIError(500, f"generation failed: {type(item).__name__}: {item}") from item
    return item


async def _pieces(call: Call, request: Request) -> AsyncIterator[tuple[str, str | None]]:
    """(text delta, finish_reason or None) until the generation ends; cancels the job on any early exit."""
    watcher = asyncio.ensure_future(_watch(request))
    ended = False
    try:
        while True:
            ev = await _next(call.job, watcher)
            if ev.token is not None:
                call.completion_tokens += 1
            if ev.finished and ev.finish_reason == "stop":  # the stop token: counted, never shown
                ended = True
                yield call.text.finish(), "stop"
                return
            delta = call.text.push(ev.token) if ev.token is not None else ""
            if call.text.stopped:  # a stop string matched: end here, cancel the rest
                yield delta, "stop"
                return
            if ev.finished:
                ended = True
                reason = "length" if ev.finish_reason == "length" else "stop"
                yield delta + call.text.finish(), reason
                return
            if delta:
                yield delta, None
    finally:
        watcher.cancel()
        if not ended:
            call.worker.cancel(call.job)


async def collect(call: Call, request: Request) -> dict[str, Any]:
    """The whole response body of a non-streaming request."""
    parts: list[str] = []
    reason = "stop"
    async for delta, finish in _pieces(call, request):
        parts.append(delta)
        if finish is not None:
            reason = finish
    text = "".join(parts)
    if call.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice |= {"logprobs": None, "finish_reason": reason}
    obj = "chat.completion" if call.chat else "text_completion"
    return call._head(obj) | {"choices": [choice], "usage": call.usage()}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk(call: Call, delta: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
    if call.chat:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
        choice: dict[str, Any] = {"index": 0, "delta": d}
    else:
        choice = {"index": 0, "text": delta or ""}
    choice |= {"logprobs": None, "finish_reason": finish}
    return call._head("chat.completion.chunk" if call.chat else "text_completion") | {"choices": [choice]}


async def stream(call: Call, request: Request) -> AsyncIterator[str]:
    """Server-sent events of a streaming request; errors after the start become an error event."""
    try:
        if call.chat:
            yield _sse(_chunk(call, None, None, role=True))
        async for delta, finish in _pieces(call, request):
            if call.chat and finish is not None:  # chat: content, then a chunk with only the reason
                if delta:
                    yield _sse(_chunk(call, delta, None))
                yield _sse(_chunk(call, None, finish))
            elif delta or finish is not None:
                yield _sse(_chunk(call, delta, finish))
        if call.include_usage:
            yield _sse(call._head("chat.completion.chunk" if call.chat else "text_completion")
                       | {"choices": [], "usage": call.usage()})  # fmt: skip
    except ClientGone:
        return
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


__all__ = ["Call", "ClientGone", "collect", "stream"]
