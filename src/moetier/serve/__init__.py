"""moetier serve: an OpenAI-compatible HTTP server over one Engine (see app.py for the routes).

Modules: app (factory and routes), config (ServeConfig: batch, limits, key, body limits), schemas
(request bodies, unsupported parameters), prompts (prompt ids, chat template, max_tokens), body
(streamed body limit, read timeout, JSON checks), auth (the API key), text (incremental
detokenization, stop strings), logprobs (OpenAI's logprobs shapes), worker (the thread that owns the
engine and the BatchRunner), respond (JSON bodies and SSE), metrics (Prometheus text), errors
(OpenAI error JSON), ray_deploy (the Ray Serve deployment).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moetier.serve.app import create_app
    from moetier.serve.config import ServeConfig

# Lazy, as moetier/__init__.py: Ray Serve's proxy imports moetier.serve.ray_proxy, which must not pull
# torch and the engine in through this package (the proxy has ~15 s to become ready).
_LAZY = {"create_app": "moetier.serve.app", "ServeConfig": "moetier.serve.config"}


def __getattr__(name: str) -> Any:
    """create_app and ServeConfig, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetier.serve' has no attribute {name!r}")


__all__ = ["ServeConfig", "create_app"]
