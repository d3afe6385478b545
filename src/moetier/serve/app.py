"""`create_app(engine, ...)`: the FastAPI application of `moetier serve` (OpenAI-compatible).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text).

The app takes an already-loaded Engine (tests build one from a tiny checkpoint) and owns a
BatchRunner (runtime/batch.py) driven by one worker thread (worker.py), started and stopped with
the app's lifespan; the engine itself stays the caller's to close. Handlers parse and check a
request fully before it is queued, so every client mistake is an OpenAI-style JSON error
(errors.py) with a 4xx status: malformed JSON or a body that is not an object (400), a missing,
unknown or wrongly typed field (400, naming it), an unsupported parameter (400, naming it;
schemas.py), an unknown model (404), a body over 8 MiB (413), a prompt or max_tokens that does not
fit the context (400; prompts.py), a full queue (429). Sampling defaults follow OpenAI: temperature
1, top_p 1; `seed` makes a request reproducible whatever else is in the batch. Greedy output equals
Engine.generate of the request alone in fp32; in bf16 a batch's row count can change rounding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from moetier.config import SamplingConfig
from moetier.errors import CheckpointError
from moetier.runtime.batch import BatchRunner, SeqRequest
from moetier.runtime.engine import Engine
from moetier.serve.errors import APIError, install_handlers, validation_error
from moetier.serve.metrics import ServerMetrics, render
from moetier.serve.prompts import COMPLETION_MAX_TOKENS, chat_ids, completion_ids, max_new_tokens
from moetier.serve.respond import Call, ClientGone, collect, stream
from moetier.serve.schemas import ChatRequest, CompletionRequest, check_supported, stop_list
from moetier.serve.text import TextStream
from moetier.serve.worker import Worker

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 8 << 20  # larger bodies get 413
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    engine: Engine,
    model_name: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    runner: BatchRunner | None = None,
) -> FastAPI:
    """The server app for `engine`, served as `model_name` (default: the checkpoint folder's name)."""
    # 1. the engine side: runner, worker, tokenizer, limits
    name = model_name or str(engine.info.path).rstrip("/").rsplit("/", 1)[-1]
    runner = runner or BatchRunner(engine, max_batch=max_batch)
    metrics = ServerMetrics()
    worker = Worker(runner, max_queue, metrics)
    try:
        tokenizer: Any = engine.tokenizer
    except CheckpointError:
        tokenizer = None
    vocab = int(getattr(engine.loaded.config, "vocab_size", 0) or 0) or 1 << 62
    context = engine.max_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="moetier", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.model_name = worker, metrics, name
    install_handlers(app)

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        route = request.url.path if request.url.path in ROUTES else "other"
        try:
            response = await call_next(request)
        except Exception:
            metrics.request(route, 500)
            raise
        metrics.request(route, response.status_code)
        return response

    # 2. request parsing shared by both generation routes
    async def parse(request: Request, model: type[M]) -> M:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body of {len(raw)} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        return req

    def check_model(requested: str) -> None:
        if requested != name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {name!r}", "model",
                           "model_not_found")  # fmt: skip

    async def run(request: Request, req: CompletionRequest | ChatRequest, ids: list[int], limit: int) -> Response:
        # 3. queue the generation, then answer in one body or as a stream
        sampling = SamplingConfig(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        )  # fmt: skip
        job = worker.submit(SeqRequest(ids, limit, sampling), asyncio.get_running_loop())
        metrics.add_prompt_tokens(len(ids))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        text = TextStream(tokenizer, ids, stop_list(req.stop)) if tokenizer is not None else _NoText(ids)
        call = Call(worker, job, text, isinstance(req, ChatRequest), name, len(ids), include_usage)
        if req.stream:
            return StreamingResponse(stream(call, request), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            return JSONResponse(await collect(call, request))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    # 4. routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        check_model(req.model)
        check_supported(req)
        ids = completion_ids(tokenizer, req.prompt, vocab)
        if req.stop is not None and tokenizer is None:
            raise APIError(400, "'stop' strings need the model's tokenizer", "stop")
        limit = max_new_tokens(req.max_tokens, len(ids), context, COMPLETION_MAX_TOKENS, "max_tokens", "prompt")
        return await run(request, req, ids, limit)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        check_model(req.model)
        check_supported(req)
        ids = chat_ids(tokenizer, req.messages)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        limit = max_new_tokens(requested, len(ids), context, None, param, "messages")
        return await run(request, req, ids, limit)

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "moetier", "max_model_len": context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": name, "running": worker.running,
                "queued": worker.queued}  # fmt: skip
        return JSONResponse(body, status_code=200 if ok else 503)

    last_snap: dict[str, Any] = {}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        with contextlib.suppress(TimeoutError):  # a very long step: the previous figures
            snap: dict[str, Any] = await asyncio.wait_for(asyncio.wrap_future(worker.snapshot()), timeout=5.0)
            last_snap.update(snap)
        body = render(metrics, last_snap, worker.running, worker.queued)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _NoText(TextStream):
    """A model without a tokenizer: token ids in, no text out (usage still counts)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        super().__init__(None, prompt_ids, [])

    def _decode(self, ids: list[int]) -> str:
        return ""


__all__ = ["create_app"]
