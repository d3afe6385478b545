"""Fixtures of the server tests: the bundled engine (loaded once), and real uvicorn servers on
loopback (a free port, in a thread, started and stopped by the fixture) around create_app.

`SlowRunner` is a BatchRunner for tests that need a request to stay in flight: it never stops at
EOS (stop_ids empty) and each step sets `entered`, blocks while `gate` is clear (no timeout: make_server's
teardown, and `open_gate` in tests that drive a Worker directly, open it whatever the test did), waits `delay`
seconds and, given a `FakeClock`, moves it on by one second (so the worker's time limits count steps, not
whatever time a busy machine took). `HeldRunner` keeps the stop ids and admits nothing while its `gate` is
clear, so the requests sent meanwhile all start in one step: a batch whose composition does not depend on
when they arrived.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import uvicorn

from moetier.config import EngineConfig, RuntimeConfig
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest, StepEvent
from moetier.runtime.engine import Engine
from moetier.runtime.wire import load
from moetier.serve import ServeConfig, create_app
from moetier.serve.worker import WorkerLimits

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
NAME = "tiny-shakespeare-moe"


def config(max_batch: int = 8, max_queue: int = 64, **fields: object) -> ServeConfig:
    """A ServeConfig serving NAME; `fields` are ServeConfig's own (api_key=, max_body_bytes=, ...) or
    WorkerLimits' (queue_timeout_s=, request_timeout_s=)."""
    limit_keys = {"queue_timeout_s", "request_timeout_s"}
    limits = WorkerLimits(max_queue=max_queue, **{k: v for k, v in fields.items() if k in limit_keys})  # type: ignore[arg-type]
    own = {k: v for k, v in fields.items() if k not in limit_keys}
    return ServeConfig(model_name=NAME, batch=BatchConfig(max_batch=max_batch), limits=limits, **own)  # type: ignore[arg-type]


class FakeClock:
    """A monotonic clock that moves only when told (`advance`); a Worker's or ServerMetrics' `clock`. Written by
    one thread at a time (a float attribute: readers on other threads see the old or the new time)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowRunner(BatchRunner):
    STEP_S = 1.0  # the fake time one step takes (with a clock)

    def __init__(self, engine: Engine, max_batch: int = 8, delay: float = 0.0, clock: FakeClock | None = None) -> None:
        super().__init__(engine, BatchConfig(max_batch=max_batch))
        self.delay = delay
        self.clock = clock  # moved on by STEP_S after every step
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a step began: the jobs the worker took before it are in the runner

    def add(self, req: SeqRequest) -> int:
        return super().add(dataclasses.replace(req, stop_ids=frozenset()))

    def step(self) -> list[StepEvent]:
        self.entered.set()
        self.gate.wait()
        time.sleep(self.delay)
        events = super().step()
        if self.clock is not None:
            self.clock.advance(self.STEP_S)
        return events


class HeldRunner(BatchRunner):
    """Admits nothing while `gate` is clear: step() waits up to 10 ms for it and returns no event, so the worker goes on
    moving the requests it gets into pending; the first step after `gate.set()` admits them all (up to max_batch)."""

    def __init__(self, engine: Engine, max_batch: int = 8) -> None:
        super().__init__(engine, BatchConfig(max_batch=max_batch))
        self.gate = threading.Event()

    def step(self) -> list[StepEvent]:
        return super().step() if self.gate.wait(0.01) else []


def open_gate(runner: object) -> None:
    """Open the gate of a SlowRunner or HeldRunner (a no-op for other runners): a worker blocked in it goes on."""
    gate = getattr(runner, "gate", None)
    if isinstance(gate, threading.Event):
        gate.set()


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    # fp32: batched decoding equals decoding alone (in bf16 the row count of a matmul changes rounding)
    eng = load(MODEL, EngineConfig(runtime=RuntimeConfig(dtype="fp32")))
    yield eng
    eng.close()


@contextmanager
def serve(app: object) -> Iterator[str]:
    """Run `app` with uvicorn on a free loopback port in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture
def make_server(engine: Engine) -> Iterator[Callable[..., tuple[str, object]]]:
    """make_server(max_batch=8, max_queue=64, runner=None, clock=time.monotonic, **config fields) -> (base URL, app);
    stopped after the test (the fields as `config` takes them; `clock` as create_app takes it)."""
    stack: list[object] = []
    runners: list[BatchRunner] = []

    def start(max_batch: int = 8, max_queue: int = 64, runner: BatchRunner | None = None,
              clock: Callable[[], float] = time.monotonic, **fields: object) -> tuple[str, object]:  # fmt: skip
        app = create_app(engine, config(max_batch, max_queue, **fields), runner=runner, clock=clock)
        if runner is not None:
            runners.append(runner)
        ctx = serve(app)
        url = ctx.__enter__()
        stack.append(ctx)
        return url, app

    yield start
    for runner in runners:  # a test that failed with a gate shut: its worker goes on, and can stop
        open_gate(runner)
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)  # type: ignore[attr-defined]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds passed (its last value): a bound for a busy machine,
    not a measurement (a test that means "soon" says so with a bound of its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
