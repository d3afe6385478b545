"""`moetier serve`: the OpenAI-compatible HTTP server (moetier.serve) on uvicorn.

Registered on the main app by cli/app.py (`register(app)`). Thin: it takes the same engine
flags as `moetier generate` (engine_flags.EngineFlags, mapped by `engine_config`) and the server's
own, mapped onto one ServeConfig by `serve_config` (the one place a config is built from the flags),
loads the engine through EngineFlags.session, builds the app with moetier.serve.create_app and runs
uvicorn, which logs to stderr. Ctrl-C stops uvicorn gracefully (requests in flight end, the worker
stops), then the engine is closed (writing --trace if asked) and the command exits 0.

The API key comes from --api-key or, without it, the environment variable MOETIER_API_KEY (the flag
wins; the value is never printed). uvicorn's own connection limits are set from the server's:
idle keep-alive connections close after KEEP_ALIVE_S, at most `connection_limit` connections are
open at once (uvicorn answers 503 past it), and a stop waits GRACEFUL_S for requests in flight.

Invariants (as cli/app.py): bad flags or a bad checkpoint are one line `error: ...` on stderr and exit
2 before anything listens; a port already in use is the same.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from rich.console import Console

from moetier.cli.console import consoles, read_text, register_command, user_errors
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags
from moetier.cli.model_arg import open_model
from moetier.cli.options import Model, size_flag
from moetier.config import CacheConfig, EngineConfig
from moetier.errors import ConfigError
from moetier.policies import AUTO, cache_policy_for_batch
from moetier.runtime.batch import BatchConfig
from moetier.serve import ServeConfig, create_app
from moetier.serve.config import API_KEY_ENV, MAX_BODY_BYTES, READ_TIMEOUT_S
from moetier.serve.worker import WorkerLimits

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
_RAY = "Replicas (Ray Serve)"
RayAddress = Annotated[
    str | None,
    typer.Option("--ray", metavar="ADDRESS", rich_help_panel=_RAY,
                 help="Serve --replicas engine replicas on Ray Serve behind one HTTP proxy on --host/--port: local "
                      "(start Ray here), auto (the cluster this machine joined with `ray start`), HOST:6379 or "
                      "ray://HOST:10001. Needs pip install 'moetier[serve-ray]'."),
]  # fmt: skip
Replicas = Annotated[
    int,
    typer.Option(min=1, rich_help_panel=_RAY,
                 help="--ray: engine replicas, each loading the model with its own budgets, batch and queue."),
]  # fmt: skip
ReplicaCpus = Annotated[
    float, typer.Option(min=1, rich_help_panel=_RAY, help="--ray: CPUs Ray reserves per replica (its torch threads).")
]
ReplicaGpus = Annotated[
    float, typer.Option(min=0, rich_help_panel=_RAY, help="--ray: GPUs per replica; 0.5 puts two replicas on one GPU.")
]
_LIMITS = "Server limits"
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", metavar="KEY", envvar=API_KEY_ENV, show_default=False, rich_help_panel=_LIMITS,
                 help="Require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); default: no "
                      "key. The flag wins over the environment variable."),
]  # fmt: skip
KvBudget = Annotated[
    int | None,
    typer.Option("--kv-budget", parser=size_flag, metavar="SIZE", rich_help_panel=_LIMITS,
                 help="KV-cache bytes all running requests may reserve (prompt + max_tokens each); a request waits "
                      "until it fits, one that can never fit alone gets 400. Default: unbounded, or a quarter of "
                      "--memory when that is set (counted in it). 512MiB, 2GiB, ..."),
]  # fmt: skip
QueueTimeout = Annotated[
    float | None,
    typer.Option("--queue-timeout", min=0.001, metavar="SECONDS", rich_help_panel=_LIMITS,
                 help="Longest a request waits for a batch slot; past it 503 with Retry-After. Default: no limit."),
]  # fmt: skip
RequestTimeout = Annotated[
    float | None,
    typer.Option("--request-timeout", min=0.001, metavar="SECONDS", rich_help_panel=_LIMITS,
                 help="Longest a request may take from its arrival to its end (queue wait included); past it 504 (or "
                      "an error event in a stream that started). Default: no limit."),
]  # fmt: skip
BatchInvariant = Annotated[
    bool,
    typer.Option("--batch-invariant", rich_help_panel=_LIMITS,
                 help="A prompt's tokens do not depend on the rest of the batch (bf16 included): each decode row is "
                      "its own forward, so decoding runs at about serial speed."),
]  # fmt: skip
MaxBody = Annotated[
    int | None,
    typer.Option("--max-body", parser=size_flag, metavar="SIZE", rich_help_panel=_LIMITS,
                 help="Largest request body; past it 413, as soon as it is known (the body is never held whole). "
                      "Default: 8MiB."),
]  # fmt: skip
ReadTimeout = Annotated[
    float,
    typer.Option("--read-timeout", min=0.001, metavar="SECONDS", rich_help_panel=_LIMITS,
                 help="Time a client has to send the whole request body; past it 408."),
]  # fmt: skip
KEEP_ALIVE_S = 5  # uvicorn closes an idle keep-alive connection after this long
GRACEFUL_S = 5  # a stop waits this long for requests in flight


def _check_port(host: str, port: int) -> None:
    """ConfigError now, instead of a uvicorn traceback later, when host:port cannot be bound."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve_config(
    model_name: str | None,
    max_batch: int,
    max_queue: int,
    api_key: str | None,
    kv_budget: int | None,
    queue_timeout: float | None,
    request_timeout: float | None,
    batch_invariant: bool,
    max_body: int | None,
    read_timeout: float,
) -> ServeConfig:
    """The server's flags -> one ServeConfig (the only place they are mapped; ConfigError on a bad value)."""
    max_body = MAX_BODY_BYTES if max_body is None else max_body
    if max_body < 1:
        raise ConfigError(f"--max-body must be at least 1 byte, got {max_body}")
    batch = BatchConfig(max_batch=max_batch, kv_budget_bytes=kv_budget, batch_invariant=batch_invariant)
    limits = WorkerLimits(max_queue=max_queue, queue_timeout_s=queue_timeout, request_timeout_s=request_timeout)
    key = api_key.strip() if api_key is not None else None
    if api_key is not None and not key:
        raise ConfigError(f"--api-key (or {API_KEY_ENV}) is empty; leave it unset to serve without a key")
    return ServeConfig(model_name=model_name, batch=batch, limits=limits, api_key=key, max_body_bytes=max_body,
                       read_timeout_s=read_timeout)  # fmt: skip


def connection_limit(config: ServeConfig) -> int:
    """Most open connections uvicorn keeps: every request the worker can hold, 4 times over (clients that
    send slowly, keep-alive, streams finishing), and never fewer than 64 (/health and /metrics probes)."""
    return max(64, 4 * (config.batch.max_batch + config.limits.max_queue))


@engine_flags
def serve_cmd(
    model: Model,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    max_batch: MaxBatch = 8,
    max_queue: MaxQueue = 64,
    model_name: ModelName = None,
    log_level: LogLevel = "info",
    api_key: ApiKey = None,
    kv_budget: KvBudget = None,
    queue_timeout: QueueTimeout = None,
    request_timeout: RequestTimeout = None,
    batch_invariant: BatchInvariant = False,
    max_body: MaxBody = None,
    read_timeout: ReadTimeout = READ_TIMEOUT_S,
    ray_address: RayAddress = None,
    replicas: Replicas = 1,
    replica_cpus: ReplicaCpus = 1.0,
    replica_gpus: ReplicaGpus = 0.0,
    flags: EngineFlags = DEFAULT_FLAGS,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    _, err = consoles(True)
    with user_errors():
        # 1. flags -> config, and the port, before the (slow) load
        config = flags.config()
        if flags.cache_policy == AUTO:  # batched decode keeps a stable set: mrs-admit above one sequence
            config = replace(config, cache=CacheConfig(policy=cache_policy_for_batch(max_batch)))
        if flags.memory is not None:  # --memory covers the running requests' KV caches: a KV budget inside it
            kv_budget = kv_budget if kv_budget is not None else flags.memory // 4
            config = replace(config, budgets=replace(config.budgets, kv_bytes=kv_budget))
        serve = serve_config(model_name, max_batch, max_queue, api_key, kv_budget, queue_timeout, request_timeout,
                             batch_invariant, max_body, read_timeout)  # fmt: skip
        if ray_address is None and (replicas != 1 or replica_cpus != 1.0 or replica_gpus != 0.0):
            raise ConfigError("--replicas, --replica-cpus and --replica-gpus need --ray ADDRESS")
        _check_port(host, port)
        # 2. MODEL (a hub id is fetched now), load, build the app, serve until Ctrl-C
        arg = open_model(model, err, flags.kernel_cache)
        config = arg.defaults(config)
        if serve.model_name is None and arg.hub is not None:
            serve = replace(serve, model_name=arg.hub.repo_id)
        if ray_address is not None:
            _serve_ray(ray_address, replicas, replica_cpus, replica_gpus, arg.path, config, serve, host, port, flags,
                       err)  # fmt: skip
            return
        with flags.session(arg.path, config, err, flags.trace) as engine:
            app = create_app(engine, serve)
            key = " (API key required)" if serve.api_key is not None else ""
            err.print(f"serving {app.state.model_name!r} on http://{host}:{port}/v1{key}", highlight=False)
            with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled gracefully
                uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_S,
                            timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=connection_limit(serve))  # fmt: skip
        err.print("server stopped", highlight=False)


def _serve_ray(
    address: str,
    replicas: int,
    cpus: float,
    gpus: float,
    path: Path,
    config: EngineConfig,
    serve: ServeConfig,
    host: str,
    port: int,
    flags: EngineFlags,
    err: Console,
) -> None:
    """--ray: the app in `replicas` Ray Serve replicas (serve/ray_deploy.py) until Ctrl-C."""
    # 1. what replicas cannot do, before connecting
    if flags.trace is not None:
        raise ConfigError("--trace is not supported with --ray (every replica would write the same file)")
    if flags.warmup is not None and flags.precision != "dynamic":
        raise ConfigError("--warmup needs --precision dynamic")
    # 2. Ray is an optional heavy dependency: its module loads only for --ray (importlib, as moetier/__init__.py)
    try:
        ray_deploy: Any = importlib.import_module("moetier.serve.ray_deploy")
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve: pip install 'moetier[serve-ray]' ({exc})") from None
    # 3. deploy, serve until Ctrl-C, tear down
    warmup = read_text(flags.warmup) if flags.warmup is not None else None
    spec = ray_deploy.ReplicaSpec(str(path), config, serve, num_cpus=cpus, warmup_text=warmup)
    ray_deploy.run(spec, address, replicas, host, port, num_gpus=gpus,
                   log=lambda line: err.print(line, highlight=False))  # fmt: skip
    err.print("server stopped", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `moetier serve` to `app` (once)."""
    register_command(app, "serve", serve_cmd)


__all__ = ["connection_limit", "register", "serve_cmd", "serve_config"]
