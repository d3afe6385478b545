"""A client that disconnects cancels its generation and frees its place (streaming and not);
the server serves the next request."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx2

from moetier.runtime.engine import Engine
from serve.conftest import NAME, SlowRunner, wait_for


def _cancelled(base: str) -> float:
    for line in httpx2.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith('moetier_requests_finished_total{reason="cancelled"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no cancelled counter")


def test_stream_disconnect_cancels(engine: Engine, make_server: Callable[..., Any]) -> None:
    runner = SlowRunner(engine, max_batch=2, delay=0.01)  # never stops at EOS: 900 tokens take > 9 s
    base, app = make_server(max_batch=2, runner=runner)
    worker = app.state.worker
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx2.Client(base_url=base, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        assert worker.running == 1
    # the connection is closed: the generation is cancelled and its slot freed long before 900 tokens
    assert wait_for(lambda: worker.in_flight == 0 and runner.running == 0)
    assert runner.stats()["tokens_generated"] < 900
    assert _cancelled(base) == 1
    out = httpx2.post(f"{base}/v1/completions", json=body | {"stream": False, "max_tokens": 3}, timeout=30).json()
    assert out["usage"]["completion_tokens"] == 3


def test_non_stream_disconnect_cancels(engine: Engine, make_server: Callable[..., Any]) -> None:
    runner = SlowRunner(engine, max_batch=2, delay=0.01)
    base, app = make_server(max_batch=2, runner=runner)
    worker = app.state.worker
    payload = json.dumps({"model": NAME, "prompt": "ROMEO:", "max_tokens": 900, "temperature": 0}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)  # fmt: skip
        assert wait_for(lambda: runner.stats()["tokens_generated"] >= 5)
    assert wait_for(lambda: worker.in_flight == 0 and runner.running == 0)
    assert runner.stats()["tokens_generated"] < 900
    assert _cancelled(base) == 1
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx2.post(f"{base}/v1/chat/completions", json=chat, timeout=30).json()["usage"]["completion_tokens"] == 2


def _raw_post(base: str, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)  # fmt: skip
    return sock


def test_queued_request_disconnect_frees_its_queue_place(engine: Engine, make_server: Callable[..., Any]) -> None:
    runner = SlowRunner(engine, max_batch=1)
    runner.gate.clear()  # the worker blocks in step(): the second request stays queued
    base, app = make_server(max_batch=1, max_queue=1, runner=runner)
    worker = app.state.worker
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
    first = _raw_post(base, body)
    # the worker took the first job into the runner and is stuck in its step: whatever comes next stays queued
    assert runner.entered.wait(30) and worker.in_flight == 1
    second = _raw_post(base, body)
    assert wait_for(lambda: worker.in_flight == 2)
    assert httpx2.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 429
    second.close()  # the queued client leaves: its place is free with the worker still stuck (no step needed)
    assert wait_for(lambda: worker.in_flight == 1)
    assert runner.stats()["steps"] == 0  # freed while the worker still waits in its first step
    third = _raw_post(base, body)
    assert wait_for(lambda: worker.in_flight == 2)
    runner.gate.set()
    for sock in (first, third):
        reply = b""
        while b"completion_tokens" not in reply:
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        sock.close()
    assert wait_for(lambda: worker.in_flight == 0)
