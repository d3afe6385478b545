"""`moetier serve --ray ADDRESS --replicas N`: N engine replicas behind the same OpenAI routes, on Ray Serve.

Each replica is one Ray actor (the `EngineReplica` deployment) that loads its own Engine from the same
checkpoint path and EngineConfig (so each has its own expert budgets, KV budget, queue and worker
thread) and serves `moetier.serve.create_app`'s FastAPI app through Ray Serve's FastAPI ingress. The
app is built in the replica (`__serve_build_asgi_app__`, after the engine is loaded) and Serve runs its
lifespan, which starts the app's worker thread (and stops it when the replica shuts down). Ray Serve's
HTTP proxy balances requests over the replicas; nothing here routes requests.

Invariants:
- Only this module imports `ray` (ray_proxy.py, which Serve's proxy loads, does not); `moetier serve`
  without `--ray` never loads it: cli/serve.py loads this module with importlib only for `--ray` (an
  optional heavy dependency, loaded lazily as moetier/__init__.py loads the engine).
- What travels to the replicas is one picklable frozen `ReplicaSpec`: the model path (made absolute; it
  must name the same checkpoint on every node), the EngineConfig, the app options and the replica's CPU
  count. torch in a replica uses exactly its `num_cpus` threads.
- `max_ongoing_requests` per replica is the app's own capacity (max_batch + max_queue) plus a few
  slots for /health and /metrics, so a full replica answers its own 429 instead of Serve queueing.
- A replica whose process dies loses only the requests in flight on it; Serve starts a replacement
  while the other replicas keep serving. The proxy middleware (ray_proxy.ReplicaLostGuard, installed
  through `runtime_env()`) turns each lost request into a clean error: a 502 OpenAI error body when
  nothing was sent yet, or an SSE error event and `data: [DONE]` when a stream had started. A replica
  whose worker thread died fails Serve's health check (`check_health`) and is replaced the same way.
- Every response carries `x-moetier-replica` (Serve's replica id) and `x-moetier-pid` (the replica's
  process id), so a client (or a test) can tell replicas apart.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from fastapi import FastAPI, Request, Response
from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from moetier.config import EngineConfig
from moetier.errors import ConfigError, MoetierError
from moetier.runtime.engine import Engine
from moetier.runtime.wire import load
from moetier.serve.app import create_app
from moetier.serve.config import ServeConfig

APP_NAME = "moetier"
PROBE_SLOTS = 8  # max_ongoing_requests beyond the app's own capacity: /health, /metrics, /v1/models
REPLICA_HEADER = "x-moetier-replica"
PID_HEADER = "x-moetier-pid"
# Ray Serve installs the proxy's ASGI middlewares from this import path, read in the proxy actor's environment
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "moetier.serve.ray_proxy:proxy_middlewares"  # a light module: no torch in the proxy


def make_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The replica's app: the one place that calls create_app."""
    return create_app(engine, config)


def capacity(config: ServeConfig) -> int:
    """Requests one replica's app holds at once before its own 429: running plus queued."""
    return config.batch.max_batch + config.limits.max_queue


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to load its engine and build its app; pickled to every replica."""

    model: str  # checkpoint folder, made absolute; the same path must hold the same checkpoint on every node
    engine: EngineConfig
    app: ServeConfig = field(default_factory=ServeConfig)  # the app options, as `moetier serve` builds them
    num_cpus: float = 1.0  # Ray CPUs reserved per replica; torch uses this many threads
    warmup_text: str | None = None  # --warmup FILE's text (read by the driver), run once per replica

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(Path(self.model).absolute()))  # replicas do not share our cwd
        if self.num_cpus < 1:
            raise ConfigError(f"each replica needs at least 1 CPU (torch threads), got num_cpus={self.num_cpus}")


class Replica:
    """One engine and its app in a Serve replica (a Ray actor); deployed as EngineReplica below."""

    def __init__(self, spec: ReplicaSpec) -> None:
        # 1. torch threads = this replica's CPUs (Ray also sets OMP_NUM_THREADS from num_cpus)
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        # 2. the engine: same path and config as every other replica, its own budgets
        self.spec = spec
        self.engine = load(Path(spec.model), spec.engine)
        if spec.warmup_text is not None:
            self.engine.warmup(spec.warmup_text)
        self.served: FastAPI | None = None  # not `app`: Serve's wrapper has that property

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Called by Serve after __init__; Serve then runs the app's lifespan (starting its worker)."""
        app = make_app(self.engine, self.spec.app)
        replica = serve.get_replica_context().replica_id.unique_id
        pid = str(os.getpid())

        @app.middleware("http")
        async def tag(request: Request, call_next: Any) -> Response:
            response: Response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            response.headers[PID_HEADER] = pid
            return response

        self.served = app
        return app

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose worker thread died is replaced."""
        if self.served is not None and not self.served.state.worker.alive:
            raise RuntimeError("the replica's engine worker thread is not running")

    def __del__(self) -> None:
        # Serve has already run the app's lifespan shutdown (worker stopped); the engine is ours to close
        with contextlib.suppress(Exception):
            self.engine.close()


# FastAPI ingress with the app built per replica (`__serve_build_asgi_app__`), as a Serve deployment
EngineReplica: Deployment = serve.deployment(name="EngineReplica")(serve.ingress()(Replica))


def runtime_env() -> dict[str, Any]:
    """The Ray runtime environment of the job that starts Serve: it points the proxy at
    proxy_middlewares (Serve's actors inherit it; a cluster's own environment may set it instead)."""
    return {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}


def deployment(spec: ReplicaSpec, replicas: int, num_gpus: float = 0.0) -> Deployment:
    """EngineReplica with its options: `replicas` actors, each with `spec.num_cpus` CPUs and `num_gpus`
    GPUs (a fraction shares a GPU), at most capacity + PROBE_SLOTS requests each."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {replicas}")
    if not (num_gpus >= 0):
        raise ConfigError(f"GPUs per replica must be >= 0, got {num_gpus}")
    return EngineReplica.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": spec.num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=capacity(spec.app) + PROBE_SLOTS,
        max_constructor_retry_count=3,  # a checkpoint that does not load fails the deployment soon
        health_check_period_s=5.0,
    )


def build(spec: ReplicaSpec, replicas: int, num_gpus: float = 0.0) -> Application:
    """The bound Serve application (what `serve.run` takes) of `replicas` engine replicas."""
    return deployment(spec, replicas, num_gpus).bind(spec)


def connect(address: str, num_cpus: int | None = None) -> bool:
    """ray.init for ADDRESS: "local" starts a local instance (with `num_cpus`, default all); "auto", an
    IP:port or ray://... joins a running cluster. Returns whether this call started Ray (a Ray already
    initialised in this process is used as it is)."""
    if ray.is_initialized():
        return False
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env())
        else:
            ray.init(address=address, runtime_env=runtime_env())
    except Exception as exc:
        raise ConfigError(f"cannot start or reach Ray at {address!r}: {exc}") from None
    return True


def deploy(spec: ReplicaSpec, replicas: int, host: str, port: int, num_gpus: float = 0.0) -> None:
    """Start Serve's HTTP proxy on host:port and deploy the app; returns when every replica is ready.
    MoetierError when the deployment fails (e.g. the checkpoint does not load on a node). Ray must be
    initialised with runtime_env() (connect does) for the proxy to carry ReplicaLostGuard."""
    # 1. Serve's proxy (if Serve already runs on the cluster, its proxy is kept as it is)
    app = build(spec, replicas, num_gpus)
    try:
        serve.start(http_options={"host": host, "port": port})
    except Exception as exc:
        raise MoetierError(f"cannot start Ray Serve's HTTP proxy on {host}:{port}: {exc}") from None
    # 2. the replicas: serve.run blocks until they are all ready, or fails after a few constructor retries
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except Exception as exc:
        raise MoetierError(f"the Ray Serve deployment of {spec.model} failed: {exc}{_why()}") from None


def _why() -> str:
    """The last line of the replicas' failure (e.g. the CheckpointError of a path missing on a node)."""
    with contextlib.suppress(Exception):
        message = serve.status().applications[APP_NAME].deployments["EngineReplica"].message
        lines = [line for line in message.strip().splitlines() if line.strip()]
        if lines:
            return f" ({lines[-1].strip()})"
    return ""


def run(
    spec: ReplicaSpec,
    address: str,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_gpus: float = 0.0,
    log: Callable[[str], None] = print,
) -> None:
    """`moetier serve --ray`: connect to Ray, deploy, serve until Ctrl-C, then delete the app (and shut
    Serve and the local Ray instance down where nothing else uses them)."""
    # 1. Ray: local instance or an existing cluster
    started = connect(address)
    try:
        # 2. deploy and wait for the replicas
        deploy(spec, replicas, host, port, num_gpus)
        log(f"serving {spec.app.model_name or Path(spec.model).name!r} with {replicas} Ray Serve replicas "
            f"on http://{host}:{port}/v1")  # fmt: skip
        # 3. block until Ctrl-C
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(1.0)
    finally:
        # 4. tear down what is ours: the app (replicas finish, stop their workers, close their engines), Serve
        #    too unless other apps run on it (a shared cluster), and Ray if this call started it
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
            if started or not serve.status().applications:
                serve.shutdown()
        if started:
            ray.shutdown()


__all__ = [
    "APP_NAME",
    "PID_HEADER",
    "REPLICA_HEADER",
    "EngineReplica",
    "Replica",
    "ReplicaSpec",
    "build",
    "capacity",
    "connect",
    "deploy",
    "deployment",
    "make_app",
    "run",
    "runtime_env",
]
