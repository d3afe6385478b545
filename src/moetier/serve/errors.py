"""OpenAI-style errors of the server: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Invariants: every failure a client can cause (malformed JSON, a missing or wrongly typed field, an
unsupported parameter, an unknown model or route, a full queue, a missing API key, a body too large
or too slow) reaches the client as this JSON with the right status and a message naming the problem;
nothing a client sends makes a handler raise past these handlers. Validation errors name the
offending field in `param` (dotted path). Retryable refusals (429, 503) carry `Retry-After: 1`; an
error may add its own headers (401: `WWW-Authenticate`; 408, and 413 found while reading a body:
`Connection: close`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("moetier.serve")

_TYPES = {404: "not_found_error", 429: "rate_limit_error"}  # others: invalid_request_error below 500, else server_error


class APIError(Exception):
    """An error answered to the client as OpenAI error JSON with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = ({"Retry-After": "1"} if exc.status in (429, 503) else {}) | exc.headers
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _loc(loc: Sequence[int | str]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages.0.content' (the leading 'body' dropped)."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)


def from_validation(errors: Sequence[Any]) -> APIError:
    """The first pydantic error as a 400 naming the field (OpenAI reports one problem at a time)."""
    first = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    param = _loc(first.get("loc", ()))
    kind = str(first.get("type", ""))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        msg = f"unsupported parameter {param!r}"
    elif kind == "missing":
        msg = f"missing required parameter {param!r}"
    elif param:
        msg = f"invalid value for {param!r}: {msg}"
    return APIError(400, msg, param or None, "missing_required_parameter" if kind == "missing" else None)


def validation_error(exc: ValidationError) -> APIError:
    return from_validation(exc.errors(include_url=False))


def install_handlers(app: FastAPI) -> None:
    """APIError, FastAPI's RequestValidationError, HTTP errors (404 route, 405 method) and anything
    unexpected (500, logged with its traceback) all answer OpenAI error JSON."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(from_validation(list(exc.errors())))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(APIError(exc.status_code, str(exc.detail)))

    async def on_other(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_other)


__all__ = ["APIError", "error_body", "error_response", "from_validation", "install_handlers", "validation_error"]
