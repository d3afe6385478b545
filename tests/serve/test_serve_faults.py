"""Faults a client (or the engine) can cause, each injected: a lone surrogate, JSON nested 100k deep, a
1 GiB body (declared, and streamed without a length), a client that stalls mid-body, a missing or wrong
API key, a degraded or dead worker, the request and queue time limits, a sequence that fails alone. Every
one gets an OpenAI-style error with the right status (never a 500 for bad input, never a buffered body),
is counted in /metrics, and the server goes on serving. Wall-clock bounds are loose (a busy machine stalls for
seconds): what a test means is in the status it gets, and the worker's time limits run on a FakeClock that the
SlowRunner moves on one second per step."""

from __future__ import annotations

import json
import select
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest

from moetier.errors import ExpertReadError
from moetier.runtime.batch import StepEvent
from moetier.runtime.engine import Engine
from moetier.serve.errors import APIError
from moetier.serve.respond import _check
from serve.conftest import NAME, FakeClock, SlowRunner, wait_for

OK = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _assert_error(resp: httpx2.Response, status: int, param: str | None = None, words: str = "") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    return err


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response read from a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(body) < size:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _metric(base: str, name: str, headers: dict[str, str] | None = None) -> float:
    for line in httpx2.get(f"{base}/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


@pytest.fixture
def base(make_server: Callable[..., Any]) -> str:
    url, _ = make_server(max_body_bytes=1 << 20, read_timeout_s=0.5)
    return str(url)


def test_lone_surrogates_are_400_naming_the_field(base: str) -> None:
    post = lambda path, body: httpx2.post(f"{base}{path}", content=json.dumps(body).encode(),  # noqa: E731
                                          headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    _assert_error(post("/v1/completions", OK | {"prompt": "ROMEO\ud800:"}), 400, "prompt", "surrogate")
    _assert_error(post("/v1/completions", OK | {"prompt": ["ok", "x\udfff"]}), 400, "prompt.1", "surrogate")
    _assert_error(post("/v1/completions", OK | {"stop": ["\ud83d"]}), 400, "stop.0", "surrogate")
    _assert_error(post("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a\ud800b"}]}),
                  400, "messages.0.content", "surrogate")  # fmt: skip
    parts = [{"type": "text", "text": "\udc00"}]
    _assert_error(post("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": parts}]}),
                  400, "messages.0.content.0.text", "surrogate")  # fmt: skip
    _assert_error(post("/v1/completions", OK | {"metadata": {"\ud800": "x"}}), 400, None, "surrogate")
    # a valid pair (an emoji escaped as two surrogates) is text, and is served
    assert post("/v1/completions", OK | {"prompt": "ROMEO \ud83d\ude00:"}).status_code == 200


def test_json_nested_deep_is_400(base: str) -> None:
    headers = {"content-type": "application/json"}
    for depth in (100, 5000, 100_000):
        deep = "[" * depth + "]" * depth
        body = f'{{"model": "{NAME}", "prompt": "x", "metadata": {{"a": {deep}}}}}'
        resp = httpx2.post(f"{base}/v1/completions", content=body.encode(), headers=headers, timeout=30)
        _assert_error(resp, 400, None, "deeper than")
        _assert_error(httpx2.post(f"{base}/v1/completions", content=deep.encode(), headers=headers, timeout=30),
                      400, None, "deeper than")  # fmt: skip
    assert httpx2.post(f"{base}/v1/completions", json=OK | {"metadata": {"a": {"b": [1, [2]]}}}).status_code == 200


def test_declared_body_over_the_limit_is_413_at_once(base: str) -> None:
    with _connect(base) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1073741824\r\n\r\n" + b'{"model": ')  # fmt: skip
        t0 = time.monotonic()
        status, _, body = _response(sock)
        # answered without waiting for the 1 GiB (which never comes: waiting would be a 408 after 0.5 s)
        assert status == 413 and time.monotonic() - t0 < 30
        assert json.loads(body)["error"]["code"] == "request_too_large"
    _assert_error(httpx2.post(f"{base}/v1/completions", json=OK | {"prompt": "x" * (2 << 20)}, timeout=30), 413,
                  None, "exceeds")  # fmt: skip
    assert httpx2.post(f"{base}/v1/completions", json=OK, timeout=30).status_code == 200


def test_streamed_body_over_the_limit_is_413_before_it_ends(base: str) -> None:
    """Chunked (no length): the server answers once 1 MiB has come, long before the 1 GiB the client would send."""
    sent = 0
    with _connect(base) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        piece = b"x" * (64 << 10)
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        try:
            while sent < 1 << 30 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(piece)
        except OSError:  # the server closed after its answer
            pass
        status, headers, _ = _response(sock)
    assert status == 413 and headers.get("connection") == "close"
    assert sent < 64 << 20  # the server stopped reading a little past its limit
    assert _metric(base, 'moetier_requests_refused_total{reason="body_too_large"}') >= 1
    assert httpx2.post(f"{base}/v1/completions", json=OK, timeout=30).status_code == 200


def test_a_client_that_stalls_mid_body_gets_408(base: str) -> None:
    payload = json.dumps(OK).encode()
    with _connect(base) as sock:
        t0 = time.monotonic()  # before the server can start its 0.5 s: a stall here cannot shorten `waited`
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload[:10])  # fmt: skip
        status, headers, body = _response(sock)
        waited = time.monotonic() - t0
        assert status == 408 and 0.5 <= waited < 30, waited
        assert json.loads(body)["error"]["code"] == "request_timeout" and headers.get("connection") == "close"
        assert sock.recv(1024) == b""  # and the connection is closed
    assert _metric(base, 'moetier_requests_refused_total{reason="read_timeout"}') == 1
    assert httpx2.post(f"{base}/v1/completions", json=OK, timeout=30).status_code == 200


def test_api_key_on_every_route_but_health(make_server: Callable[..., Any]) -> None:
    url, _ = make_server(api_key="s3cret-key")
    good = {"Authorization": "Bearer s3cret-key"}
    assert httpx2.get(f"{url}/health").status_code == 200  # open: load balancers probe without the key
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing")):  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Bearer s3cret-key-and-more"}):  # fmt: skip
            resp = httpx2.request(method, f"{url}{path}", headers=headers, json=OK, timeout=30)
            err = _assert_error(resp, 401)
            assert err["code"] == "invalid_api_key" and "s3cret" not in resp.text and "wrong" not in resp.text
            assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx2.get(f"{url}/v1/models", headers=good).status_code == 200
    assert httpx2.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret-key"}).status_code == 200
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret-key", max_retries=0, timeout=30)
    assert ok.completions.create(model=NAME, prompt="ROMEO:", max_tokens=2).usage is not None
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert _metric(url, 'moetier_requests_refused_total{reason="auth"}', good) == 21
    assert _metric(url, 'moetier_requests_total{route="/v1/models",status="401"}', good) == 5


def test_health_reports_the_worker(make_server: Callable[..., Any]) -> None:
    url, app = make_server()
    worker = app.state.worker  # type: ignore[attr-defined]
    body = httpx2.get(f"{url}/health").json()
    assert body["status"] == "ok" and body["model"] == NAME
    degraded = {
        "status": "degraded",
        "engine": {
            "status": "degraded",
            "read_errors": 3,
            "last_error": "model.safetensors: EIO",
            "last_error_time": 1.0,
        },
    }
    real = worker.health
    worker.health = lambda: degraded
    resp = httpx2.get(f"{url}/health")
    assert resp.status_code == 200 and resp.json()["status"] == "degraded"  # still in the load balancer
    assert resp.json()["engine"]["read_errors"] == 3 and resp.json()["model"] == NAME
    worker.health = real
    worker.stop()  # a dead worker: 503
    resp = httpx2.get(f"{url}/health")
    assert resp.status_code == 503 and resp.json()["status"] == "unavailable"


def test_metrics_show_the_limits(make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    text = httpx2.get(f"{url}/metrics").text
    for name in ("moetier_queue_timeouts_total", "moetier_request_timeouts_total", "moetier_sequence_errors_total",
                 "moetier_kv_reserved_bytes", "moetier_kv_budget_bytes", "moetier_kv_waiting",
                 'moetier_requests_refused_total{reason="auth"}',
                 'moetier_requests_finished_total{reason="timeout"}'):  # fmt: skip
        assert f"\n{name} " in text, name


def test_request_time_limit_is_504_or_an_error_event(engine: Engine, make_server: Callable[..., Any]) -> None:
    """A 4.5 s limit on a clock that moves 1 s per step: a request of 900 tokens (it never stops at EOS) ends after
    its 5th token, which a stream has started to send by then (its 1st token comes in step 1)."""
    clock = FakeClock()
    runner = SlowRunner(engine, max_batch=2, clock=clock)
    url, app = make_server(max_batch=2, runner=runner, clock=clock, request_timeout_s=4.5)
    body = OK | {"max_tokens": 900}
    err = _assert_error(httpx2.post(f"{url}/v1/completions", json=body, timeout=30), 504, None, "4.5 s")
    assert err["code"] == "request_timeout" and "time limit" in err["message"]
    with httpx2.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=30) as resp:
        assert resp.status_code == 200  # it started: the limit ends it with an error event
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert any("choices" in json.loads(e) for e in events[:-2])
    assert wait_for(lambda: app.state.worker.in_flight == 0)  # type: ignore[attr-defined]
    assert _metric(url, "moetier_request_timeouts_total") == 2
    assert runner.stats()["tokens_generated"] <= 10  # 5 tokens each at most (4 for the stream if it came in the
    # cancelling step of the first, which moves the clock too): ended by the limit, not by max_tokens


def test_queue_time_limit_is_503_with_retry_after(engine: Engine, make_server: Callable[..., Any]) -> None:
    """A 2.5 s queue limit on a clock that moves 1 s per step: the first request starts in step 1 (never queued past
    the limit) and holds the one slot for 900 steps (> 18 s); each later one ends after its 3rd step of waiting."""
    clock = FakeClock()
    runner = SlowRunner(engine, max_batch=1, delay=0.02, clock=clock)
    url, app = make_server(max_batch=1, runner=runner, clock=clock, queue_timeout_s=2.5)
    with _connect(url) as first:  # holds the one slot for 900 tokens
        payload = json.dumps(OK | {"max_tokens": 900}).encode()
        first.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)  # fmt: skip
        assert wait_for(lambda: runner.running == 1)
        resp = httpx2.post(f"{url}/v1/completions", json=OK, timeout=30)
        err = _assert_error(resp, 503)
        assert err["code"] == "queue_timeout" and resp.headers["retry-after"] == "1"
        stream = httpx2.post(f"{url}/v1/completions", json=OK | {"stream": True}, timeout=30)
        assert stream.status_code == 503  # nothing was sent yet: a stream gets the status too
    assert wait_for(lambda: app.state.worker.in_flight == 0)  # type: ignore[attr-defined]
    assert _metric(url, "moetier_queue_timeouts_total") == 2


class FailingRunner(SlowRunner):
    """A sequence fails alone after `after` tokens (as an expert read error would), the others go on."""

    def __init__(self, engine: Engine, after: int) -> None:
        super().__init__(engine, max_batch=4, delay=0.01)
        self.after, self.seen = after, Counter[int]()

    def step(self) -> list[StepEvent]:
        out = []
        for ev in super().step():
            self.seen[ev.seq_id] += ev.token is not None
            if not ev.finished and self.seen[ev.seq_id] >= self.after:
                self.cancel(ev.seq_id)
                err = ExpertReadError("reading expert (1, 2) from /ckpt/model-00002.safetensors failed: [Errno 5] EIO",
                                      (1, 2), "/ckpt/model-00002.safetensors")  # fmt: skip
                ev = StepEvent(ev.seq_id, None, True, "error", error=err)
            out.append(ev)
        return out


def test_a_failed_sequence_is_a_5xx_naming_the_file(engine: Engine, make_server: Callable[..., Any]) -> None:
    url, app = make_server(max_batch=4, runner=FailingRunner(engine, after=3))
    resp = httpx2.post(f"{url}/v1/completions", json=OK | {"max_tokens": 20}, timeout=30)
    assert resp.status_code in (500, 503) and "model-00002.safetensors" in resp.json()["error"]["message"]
    with httpx2.stream("POST", f"{url}/v1/completions", json=OK | {"max_tokens": 20, "stream": True},
                       timeout=30) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "model-00002.safetensors" in json.loads(events[-2])["error"]["message"]
    assert wait_for(lambda: app.state.worker.in_flight == 0)  # type: ignore[attr-defined]
    assert httpx2.get(f"{url}/health").status_code == 200


def test_terminal_events_become_errors() -> None:
    from moetier.serve.respond import Call

    call = Call(worker=None, choices=[], chat=False, model=NAME, prompt_tokens=0, request_timeout_s=2.5)  # type: ignore[arg-type]
    with pytest.raises(APIError) as err:
        _check(call, StepEvent(1, None, True, "timeout"))
    assert err.value.status == 504 and "2.5 s" in err.value.message and err.value.code == "request_timeout"
    with pytest.raises(APIError) as err:
        _check(call, StepEvent(1, None, True, "error", error=ExpertReadError("expert (0, 1): /m/a.safetensors: EIO")))
    assert err.value.status == 500 and "/m/a.safetensors" in err.value.message
    refused = APIError(503, "waited too long", None, "queue_timeout")
    with pytest.raises(APIError) as err:
        _check(call, refused)
    assert err.value is refused
    ev = StepEvent(1, 5, False, None)
    assert _check(call, ev) is ev


def test_a_client_that_leaves_mid_body_is_not_a_server_error(make_server: Callable[..., Any]) -> None:
    base, _ = make_server(read_timeout_s=60.0)
    with _connect(base) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"model": ')  # fmt: skip
        time.sleep(0.1)
    gone = 'moetier_requests_total{route="/v1/completions",status="499"} 1'
    assert wait_for(lambda: gone in httpx2.get(f"{base}/metrics", timeout=30).text)  # long before the 408 (60 s)
    text = httpx2.get(f"{base}/metrics", timeout=30).text
    assert 'status="500"' not in text and 'reason="read_timeout"} 0' in text
    assert httpx2.post(f"{base}/v1/completions", json=OK, timeout=30).status_code == 200
