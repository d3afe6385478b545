"""The proxy side of `moetier serve --ray`: middleware Ray Serve's HTTP proxy runs around every request.

Ray Serve imports `proxy_middlewares` in each proxy actor from the import path in the environment
variable RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (ray_deploy.runtime_env sets it for the job that
starts Serve). This module is kept light (no torch, no ray, nothing of the engine) because the proxy
must start within Serve's proxy timeout and stays small.

Invariant (`ReplicaLostGuard`): a request whose replica died before finishing it ends with a clean
error, never a bare or cut-off response: OpenAI error JSON with status 502 and code "replica_lost"
when nothing was sent yet, or, for a server-sent-event stream already under way, an error event in
the same format app.py's own streams use, then `data: [DONE]`. Requests that finished, and responses
the replica itself ended, pass through unchanged.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moetier.serve.errors import error_body

REPLICA_LOST = "the replica serving this request stopped before finishing it; retry the request"


class ReplicaLostGuard:
    """ASGI middleware: finish a request the proxy left unfinished (its replica died)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # 1. watch what the proxy sends: started? an event stream? finished?
        started = sse = done = False

        async def watch(message: Message) -> None:
            nonlocal started, sse, done
            if message["type"] == "http.response.start":
                started = True
                sse = dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        # 2. run the proxy; what it leaves unfinished is finished here
        try:
            await self.app(scope, receive, watch)
        except Exception:
            if done or (started and not sse):
                raise
        if done:
            return
        error = error_body(502, REPLICA_LOST, None, "replica_lost")
        if not started:
            body = json.dumps(error).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 502, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif sse:
            event = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback: the middlewares wrapped around the proxy's app."""
    return [Middleware(ReplicaLostGuard)]


__all__ = ["REPLICA_LOST", "ReplicaLostGuard", "proxy_middlewares"]
