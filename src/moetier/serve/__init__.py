"""moetier serve: an OpenAI-compatible HTTP server over one Engine (see app.py for the routes).

Modules: app (factory and routes), schemas (request bodies, unsupported parameters), prompts
(prompt ids, chat template, max_tokens), text (incremental detokenization, stop strings),
worker (the thread that owns the engine and the BatchRunner), respond (JSON bodies and SSE),
metrics (Prometheus text), errors (OpenAI error JSON).
"""

from __future__ import annotations

from moetier.serve.app import create_app

__all__ = ["create_app"]
