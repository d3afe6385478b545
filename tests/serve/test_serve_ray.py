"""`moetier serve --ray` (serve/ray_deploy.py, serve/ray_proxy.py): 2 engine replicas of the bundled
model on a local Ray instance (2 CPUs), behind Ray Serve's HTTP proxy.

The Ray tests share one Serve application (module fixture `url`): a load test through the proxy
(both replicas serve, same greedy text from either), then a replica's process killed with SIGKILL
mid-load: only its in-flight requests fail, each cleanly (502 OpenAI error JSON, or an SSE stream
ending with an error event and [DONE]; client timeouts catch a hang), the other replica keeps
serving, and Serve's replacement serves again. The guard itself is also tested without Ray on fake
ASGI apps. Skipped when ray[serve] is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import requests  # noqa: E402  (ray[serve] depends on it)
from starlette.types import Message, Receive, Scope, Send  # noqa: E402

from moetier.config import EngineConfig, RuntimeConfig  # noqa: E402
from moetier.errors import ConfigError  # noqa: E402
from moetier.serve import ray_deploy  # noqa: E402
from moetier.serve.config import ServeConfig  # noqa: E402
from moetier.serve.ray_proxy import REPLICA_LOST, ReplicaLostGuard  # noqa: E402
from serve.conftest import MODEL, NAME  # noqa: E402

TIMEOUT = (10.0, 60.0)  # connect, read (between chunks): a request that hangs fails the test


# ---------------------------------------------------------------- the proxy guard, without Ray


def _guard(inner: Callable[[Scope, Receive, Send], Any]) -> list[Message]:
    """Messages the client gets when ReplicaLostGuard wraps `inner` (an ASGI app)."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(ReplicaLostGuard(inner)(scope, receive, send))
    return sent


def _start(ctype: bytes) -> Message:
    return {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}


def test_guard_answers_502_when_the_replica_died_before_answering() -> None:
    async def silent(scope: Scope, receive: Receive, send: Send) -> None:
        return None  # the proxy's end of a request whose replica died before the response started

    async def raising(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("actor died")

    for inner in (silent, raising):
        sent = _guard(inner)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[0]["status"] == 502
        assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"
        error = json.loads(sent[1]["body"])["error"]
        assert error["code"] == "replica_lost" and error["message"] == REPLICA_LOST
        assert error["type"] == "server_error"
        assert sent[1]["more_body"] is False


def test_guard_ends_a_cut_stream_with_an_error_event() -> None:
    first = b'data: {"choices": [{"text": "a"}]}\n\n'

    async def cut(scope: Scope, receive: Receive, send: Send) -> None:
        await send(_start(b"text/event-stream; charset=utf-8"))
        await send({"type": "http.response.body", "body": first, "more_body": True})

    sent = _guard(cut)
    assert sent[1]["body"] == first
    assert sent[-1]["more_body"] is False
    events = [e for e in sent[-1]["body"].decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "replica_lost"


def test_guard_passes_finished_responses_unchanged() -> None:
    messages: list[Message] = [
        _start(b"text/event-stream"),
        {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True},
        {"type": "http.response.body", "body": b"", "more_body": False},
    ]

    async def whole(scope: Scope, receive: Receive, send: Send) -> None:
        for m in messages:
            await send(m)

    assert _guard(whole) == messages

    async def cut_json(scope: Scope, receive: Receive, send: Send) -> None:
        await send(_start(b"application/json"))
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        raise RuntimeError("actor died")

    with pytest.raises(RuntimeError, match="actor died"):  # a started non-stream body cannot be mended
        _guard(cut_json)


# ---------------------------------------------------------------- the deployment's options


def _spec() -> ray_deploy.ReplicaSpec:
    return ray_deploy.ReplicaSpec(str(MODEL), EngineConfig(runtime=RuntimeConfig(dtype="fp32")),
                                  ServeConfig(model_name=NAME))  # fmt: skip


def test_deployment_options_follow_the_app_capacity() -> None:
    spec = _spec()
    dep = ray_deploy.deployment(spec, 3, num_gpus=0.5)
    assert dep.num_replicas == 3
    assert dep.max_ongoing_requests >= spec.app.batch.max_batch + spec.app.limits.max_queue
    assert dep.ray_actor_options["num_cpus"] == spec.num_cpus
    assert dep.ray_actor_options["num_gpus"] == 0.5
    with pytest.raises(ConfigError, match="replicas"):
        ray_deploy.deployment(spec, 0)
    with pytest.raises(ConfigError, match="CPU"):
        ray_deploy.ReplicaSpec(str(MODEL), spec.engine, num_cpus=0.5)
    relative = ray_deploy.ReplicaSpec("models/tiny-shakespeare-moe", spec.engine)
    assert relative.model == str(Path.cwd() / "models/tiny-shakespeare-moe")  # replicas run elsewhere
    env = ray_deploy.runtime_env()["env_vars"]
    assert env[ray_deploy.PROXY_CALLBACK_ENV] == "moetier.serve.ray_proxy:proxy_middlewares"


@pytest.mark.slow
def test_serve_without_ray_does_not_load_ray() -> None:
    code = "import sys, moetier.cli.serve, moetier.serve; assert 'ray' not in sys.modules, 'ray was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------- 2 replicas on a local Ray instance


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """Serve's proxy URL of 2 replicas of the bundled model (fp32: same greedy text on any replica)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             runtime_env=ray_deploy.runtime_env())  # fmt: skip
    try:
        port = _free_port()
        ray_deploy.deploy(_spec(), 2, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class Outcome:
    stream: bool
    chat: bool = False
    status: int | None = None
    pid: str | None = None
    text: str = ""
    error: dict[str, Any] | None = None
    done: bool = False  # a stream's `data: [DONE]` arrived
    exception: str | None = None  # the client failed: a cut connection, a timeout (hang)
    started: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.exception is None and self.status == 200 and self.error is None and (self.done or not self.stream)


def _request(base: str, out: Outcome, max_tokens: int = 32, prompt: str = "ROMEO:") -> Outcome:
    """One greedy request through the proxy, filling `out` (out.started is set when headers arrive)."""
    chat = out.chat
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": NAME, "max_tokens": max_tokens, "temperature": 0, "stream": out.stream}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    try:
        with requests.post(base + route, json=body, stream=out.stream, timeout=TIMEOUT) as resp:
            out.status, out.pid = resp.status_code, resp.headers.get(ray_deploy.PID_HEADER)
            out.started.set()
            if not out.stream:
                data = resp.json()
                out.error = data.get("error")
                if out.error is None:
                    choice = data["choices"][0]
                    out.text = choice["message"]["content"] if chat else choice["text"]
                return out
            for line in resp.iter_lines():
                if not line:
                    continue
                payload = line.decode().removeprefix("data: ")
                if payload == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    out.error = event["error"]
                    continue
                choice = event["choices"][0]
                out.text += (choice["delta"].get("content") or "") if chat else choice["text"]
    except Exception as exc:
        out.exception = f"{type(exc).__name__}: {exc}"
    finally:
        out.started.set()
    return out


Started = tuple[list[Outcome], ThreadPoolExecutor, list[Any]]


def _load(base: str, n: int, max_tokens: int, chat: bool = False) -> Started:
    """Start `n` concurrent requests, half streaming (with `chat`, every other pair as chat)."""
    outs = [Outcome(stream=i % 2 == 0, chat=chat and (i // 2) % 2 == 1) for i in range(n)]
    pool = ThreadPoolExecutor(max_workers=n)
    futures = [pool.submit(_request, base, out, max_tokens) for out in outs]
    return outs, pool, futures


def _finish(pool: ThreadPoolExecutor, futures: list[Any]) -> None:
    for fut in futures:
        fut.result(timeout=180)
    pool.shutdown()


def _replicas_running() -> int:
    status = serve.status().applications[ray_deploy.APP_NAME]
    return int(status.deployments["EngineReplica"].replica_states.get("RUNNING", 0))


@pytest.mark.slow
def test_load_through_the_proxy_reaches_both_replicas(url: str) -> None:
    # 1. the service answers through Serve's proxy, tagged with the replica
    health = requests.get(url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] in ("ok", "degraded")
    assert health.headers[ray_deploy.PID_HEADER].isdigit()
    assert requests.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == NAME
    # 2. 16 concurrent requests, half streaming, completions and chat: all complete, on both replicas
    outs, pool, futures = _load(url, 16, max_tokens=24, chat=True)
    _finish(pool, futures)
    assert all(o.ok for o in outs), [(o.status, o.error, o.exception) for o in outs if not o.ok]
    assert len({o.pid for o in outs}) == 2
    # 3. one model, whatever the replica: greedy text is the same for the same request
    for chat in (False, True):
        texts = {o.text for o in outs if o.chat == chat}
        assert len(texts) == 1 and next(iter(texts))


@pytest.mark.slow
def test_a_killed_replica_loses_only_its_in_flight_requests(url: str) -> None:
    # 1. long greedy requests (no EOS for "ROMEO:"), half streaming; kill the replica of a started stream
    outs, pool, futures = _load(url, 16, max_tokens=200)
    deadline = time.monotonic() + 120
    victim: str | None = None
    while victim is None and time.monotonic() < deadline:
        victim = next((o.pid for o in outs if o.stream and o.started.is_set() and o.pid), None)
        time.sleep(0.02)
    assert victim is not None, "no stream started"
    os.kill(int(victim), signal.SIGKILL)
    _finish(pool, futures)
    # 2. every request either completed or failed cleanly; failures are the victim's only
    assert all(o.exception is None for o in outs), [o.exception for o in outs if o.exception]
    lost = [o for o in outs if not o.ok]
    assert lost, "the killed replica had requests in flight"
    for o in lost:
        assert o.error is not None and o.error["code"] == "replica_lost", o
        if o.status == 200:  # a stream under way on the victim ends with the error event, then [DONE]
            assert o.stream and o.pid == victim and o.done
        else:  # nothing sent yet (either kind): an OpenAI error body
            assert o.status == 502 and o.pid is None
    survivors = [o for o in outs if o.pid is not None and o.pid != victim]
    assert survivors and all(o.ok for o in survivors)
    # 3. the other replica keeps serving while Serve replaces the dead one
    survivor = survivors[0].pid
    for o in [_request(url, Outcome(stream=i % 2 == 0), max_tokens=4) for i in range(4)]:
        assert o.ok and o.pid == survivor, o
    # 4. the replacement comes up and serves. Serve's status is no signal for this: its controller notices
    #    the death only at the next health check (health_check_period_s), so until then it still counts
    #    the victim as RUNNING. What is checked is the replacement itself answering, within a deadline, and
    #    every request answered meanwhile (by the survivor, until the proxy routes to the replacement).
    deadline = time.monotonic() + 180
    pids: set[str | None] = set()
    while not pids - {victim, survivor}:
        assert time.monotonic() < deadline, f"no replacement answered within 180 s (answered: {pids})"
        outs, pool, futures = _load(url, 4, max_tokens=4)
        _finish(pool, futures)
        assert all(o.ok for o in outs), [(o.status, o.error, o.exception) for o in outs if not o.ok]
        pids |= {o.pid for o in outs}
        time.sleep(0.2)
    assert victim not in pids
    assert _replicas_running() == 2  # the replacement answered, so Serve counts it RUNNING
