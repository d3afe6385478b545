"""`create_app(engine, config, runner, clock)`: the FastAPI application of `moetier serve` (OpenAI-compatible).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text).

The app takes an already-loaded Engine (tests build one from a tiny checkpoint) and a ServeConfig
(serve/config.py), and owns a BatchRunner (runtime/batch.py, built from config.batch unless one is
given) driven by one worker thread (worker.py, with config.limits), started and stopped with the
app's lifespan; the engine itself stays the caller's to close. Handlers read the body within the
body limit and read timeout (body.py), then parse and check a request fully before it is queued, so
every client mistake is an OpenAI-style JSON error (errors.py) with a 4xx status: a missing or wrong
API key when the server has one (401, every route but /health; auth.py), a body over the limit
(413, as soon as it is known), a body that stalls (408), malformed JSON, JSON nested too deep, a
string that is not valid Unicode, or a body that is not an object (400), a missing, unknown or
wrongly typed field (400, naming it), an unsupported parameter (400, naming it; schemas.py), an
unknown model (404), a prompt or max_tokens that does not fit the context (400; prompts.py), more
sequences than the server can hold (400), a full queue (429). Limits the worker enforces answer
503 (queue wait, Retry-After) and 504 (request time); a sequence that fails alone 500.

`clock` (default time.monotonic) is the one the worker's time limits and the metrics' generation rate
are measured on (tests pass a fake one); body read timeouts are the event loop's.

Sampling defaults follow OpenAI: temperature 1, top_p 1; `seed` makes a request reproducible
whatever else is in the batch; with `n` > 1, sample i of each prompt uses seed + i. Greedy output
equals Engine.generate of the request alone in fp32; in bf16 a batch's row count can change
rounding unless config.batch.batch_invariant.

/health answers the worker's health (worker.Worker.health): status "ok" or "degraded" (recent
expert read errors, with the engine's error details) with 200, so a degraded replica that still
serves most requests stays in a load balancer; 503 only when the worker is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from moetier.serve.auth import OPEN_PATHS, key_error
from moetier.serve.body import BodyGone, decode_json, read_body
from moetier.serve.config import ServeConfig
from moetier.serve.errors import APIError, error_response, install_handlers, validation_error
from moetier.serve.logprobs import TokenNames
from moetier.serve.metrics import ServerMetrics, render
from moetier.serve.prompts import COMPLETION_MAX_TOKENS, chat_ids, completion_prompts, max_new_tokens
from moetier.serve.respond import Call, Choice, ClientGone, collect, open_stream
from moetier.serve.schemas import ChatRequest, CompletionRequest, check_supported, logprobs_k, stop_list
from moetier.serve.text import TextStream
from moetier.serve.worker import Worker

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
M = TypeVar("M", bound=BaseModel)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REFUSALS = {401: "refused_auth", 408: "refused_read_timeout", 413: "refused_body_too_large"}


def create_app(engine: Engine, config: ServeConfig | None = None, runner: BatchRunner | None = None,
               clock: Callable[[], float] = time.monotonic) -> FastAPI:  # fmt: skip
    """The server app for `engine` under `config` (default ServeConfig()); `runner` replaces the BatchRunner
    built from config.batch (tests pass instrumented ones); `clock` (monotonic seconds) is the worker's and the
    metrics' (tests pass a fake one)."""
    # 1. the engine side: runner, worker, tokenizer, limits
    config = config or ServeConfig()
    name = config.model_name or str(engine.info.path).rstrip("/").rsplit("/", 1)[-1]
    runner = runner or BatchRunner(engine, config.batch)
    metrics = ServerMetrics(clock)
    worker = Worker(runner, config.limits, metrics, clock)
    try:
        tokenizer: Any = engine.tokenizer
    except CheckpointError:
        tokenizer = None
    names = TokenNames(tokenizer)
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
    app.state.worker, app.state.metrics, app.state.model_name, app.state.config = worker, metrics, name, config
    install_handlers(app)

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        route = request.url.path if request.url.path in ROUTES else "other"
        if config.api_key is not None and request.url.path not in OPEN_PATHS:
            refused = key_error(request.headers.get("authorization"), config.api_key)
            if refused is not None:
                metrics.count("refused_auth")
                metrics.request(route, refused.status)
                return error_response(refused)
        try:
            response = await call_next(request)
        except Exception:
            metrics.request(route, 500)
            raise
        if response.status_code in (408, 413):
            metrics.count(_REFUSALS[response.status_code])
        metrics.request(route, response.status_code)
        return response

    # 2. request parsing shared by both generation routes
    async def parse(request: Request, model: type[M]) -> M:
        raw = await read_body(request, config.max_body_bytes, config.read_timeout_s)
        data = decode_json(raw)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def check_model(requested: str) -> None:
        if requested != name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {name!r}", "model",
                           "model_not_found")  # fmt: skip

    def check_room(sequences: int, n: int) -> None:
        if sequences > worker.capacity:
            param = "n" if n > 1 else "prompt"
            raise APIError(
                400, f"the request asks for {sequences} sequences (prompts x n); this server holds at most "
                f"{worker.capacity} in flight (--max-batch + --max-queue)", param,
            )  # fmt: skip

    async def run(
        request: Request, req: CompletionRequest | ChatRequest, prompts: list[tuple[list[int], str]], limits: list[int]
    ) -> Response:
        # 3. one job per prompt and sample, then answer in one body or as a stream
        chat, n = isinstance(req, ChatRequest), req.n or 1
        k = logprobs_k(req)
        echo = isinstance(req, CompletionRequest) and bool(req.echo)
        check_room(len(prompts) * n, n)
        loop, stops = asyncio.get_running_loop(), stop_list(req.stop)
        choices: list[Choice] = []
        try:
            for ids, text in prompts:
                for i in range(n):
                    sampling = SamplingConfig(
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, seed=None if req.seed is None else req.seed + i,
                    )  # fmt: skip
                    limit = limits[len(choices) // n]
                    seq = SeqRequest(ids, limit, sampling, logprobs=k, echo=echo and (k is not None or limit == 0))
                    job = worker.submit(seq, loop)
                    stream = TextStream(tokenizer, ids, stops) if tokenizer is not None else _NoText(ids)
                    choices.append(Choice(len(choices), job, stream, ids, text if echo else ""))
        except APIError:
            for c in choices:
                worker.cancel(c.job)
            raise
        metrics.add_prompt_tokens(sum(len(ids) for ids, _ in prompts))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        call = Call(worker, choices, chat, name, sum(len(ids) for ids, _ in prompts), include_usage, k, echo, names,
                    config.limits.request_timeout_s)  # fmt: skip
        try:
            if req.stream:
                body = await open_stream(call, request)
                return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(await collect(call, request))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    def prompt_text(ids: list[int], text: str | None) -> str:
        if text is not None:
            return text
        return str(tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None else ""

    # 4. routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = await parse(request, CompletionRequest)
        except BodyGone:
            return Response(status_code=499)
        check_model(req.model)
        check_supported(req)
        prompts = completion_prompts(tokenizer, req.prompt, vocab)
        if req.stop is not None and tokenizer is None:
            raise APIError(400, "'stop' strings need the model's tokenizer", "stop")
        minimum = 0 if req.echo else 1
        limits = [
            max_new_tokens(req.max_tokens, len(ids), context, COMPLETION_MAX_TOKENS, "max_tokens", "prompt", minimum)
            for ids, _ in prompts
        ]  # fmt: skip
        texts = [(ids, prompt_text(ids, text) if req.echo else "") for ids, text in prompts]
        return await run(request, req, texts, limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            req = await parse(request, ChatRequest)
        except BodyGone:
            return Response(status_code=499)
        check_model(req.model)
        check_supported(req)
        ids = chat_ids(tokenizer, req.messages)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        limit = max_new_tokens(requested, len(ids), context, None, param, "messages")
        return await run(request, req, [(ids, "")], [limit])

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
        state = dict(worker.health())
        body = {"status": state.pop("status", "unavailable"), "model": name, "running": worker.running,
                "queued": worker.queued} | state  # fmt: skip
        return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)

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
