"""`moetier serve`: the OpenAI-compatible HTTP server (moetier.serve) on uvicorn.

Registered on the main app by cli/app.py (`register(app)`). Thin: it takes the same engine
flags as `moetier generate` (engine_flags.EngineFlags, mapped by `engine_config`), loads the engine
through EngineFlags.session, builds the app with moetier.serve.create_app and runs uvicorn, which
logs to stderr. Ctrl-C stops uvicorn gracefully (requests in flight end, the worker stops), then
the engine is closed (writing --trace if asked) and the command exits 0.

Invariants (as cli/app.py): bad flags or a bad checkpoint are one line `error: ...` on stderr and exit
2 before anything listens; a port already in use is the same.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Annotated

import typer
import uvicorn

from moetier.cli.console import consoles, register_command, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags
from moetier.cli.model_arg import open_model
from moetier.cli.options import Model
from moetier.errors import ConfigError
from moetier.serve import create_app

_SERVER = "Server"
Host = Annotated[str, typer.Option(rich_help_panel=_SERVER, help="Address to listen on.")]
Port = Annotated[int, typer.Option(min=0, max=65535, rich_help_panel=_SERVER, help="TCP port to listen on.")]
MaxBatch = Annotated[
    int, typer.Option(min=1, rich_help_panel=_SERVER, help="Most requests decoded together in one batch.")
]
MaxQueue = Annotated[
    int,
    typer.Option(min=0, rich_help_panel=_SERVER,
                 help="Most requests waiting for a batch slot; past it the server answers 429."),
]  # fmt: skip
ModelName = Annotated[
    str | None,
    typer.Option("--model-name", rich_help_panel=_SERVER,
                 help="Model id clients send; default: the hub id (owner/name) of a hub MODEL, else the checkpoint "
                      "folder's name."),
]  # fmt: skip
LogLevel = Annotated[str, typer.Option(rich_help_panel=_SERVER, help="uvicorn log level (info, warning, debug).")]


def _check_port(host: str, port: int) -> None:
    """ConfigError now, instead of a uvicorn traceback later, when host:port cannot be bound."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


@engine_flags
def serve_cmd(
    model: Model,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    max_batch: MaxBatch = 8,
    max_queue: MaxQueue = 64,
    model_name: ModelName = None,
    log_level: LogLevel = "info",
    flags: EngineFlags = DEFAULT_FLAGS,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    _, err = consoles(True)
    with user_errors():
        # 1. flags -> config, and the port, before the (slow) load
        config = flags.config()
        _check_port(host, port)
        # 2. MODEL (a hub id is fetched now), load, build the app, serve until Ctrl-C
        arg = open_model(model, err, flags.kernel_cache)
        config = arg.defaults(config)
        name = model_name or (arg.hub.repo_id if arg.hub is not None else None)
        with flags.session(arg.path, config, err, flags.trace) as engine:
            app = create_app(engine, model_name=name, max_batch=max_batch, max_queue=max_queue)
            err.print(f"serving {app.state.model_name!r} on http://{host}:{port}/v1", highlight=False)
            with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled gracefully
                uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        err.print("server stopped", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `moetier serve` to `app` (once)."""
    register_command(app, "serve", serve_cmd)


__all__ = ["register", "serve_cmd"]
