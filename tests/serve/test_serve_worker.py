"""The serve worker (serve/worker.py) under its limits and faults, driven directly (no HTTP): a job waiting
past queue_timeout_s ends with APIError 503 "queue_timeout", one running past request_timeout_s with a
StepEvent "timeout" (its slot freed), a sequence the runner fails alone with APIError 503 (a failed expert read,
file and expert named) or 500 (non-finite values) while the others finish; health() and the snapshot's
worker counters say so. The time limits run on a FakeClock that the SlowRunner moves on one second per step:
a job's age is a count of steps, whatever the machine's load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from moetier.errors import ConfigError, ExpertReadError, NumericalError
from moetier.runtime.batch import BatchRunner, SeqRequest, StepEvent
from moetier.runtime.engine import Engine
from moetier.runtime.lean import LeanDecoder
from moetier.serve.errors import APIError
from moetier.serve.metrics import ServerMetrics
from moetier.serve.worker import Item, Job, Worker, WorkerLimits
from moetier.types import ExpertKey
from serve.conftest import FakeClock, SlowRunner, open_gate

PATH = "/models/x/model-00001-of-00002.safetensors"


@contextmanager
def running(runner: BatchRunner, limits: WorkerLimits, clock: Callable[[], float] = time.monotonic) -> Iterator[Worker]:
    worker = Worker(runner, limits, ServerMetrics(), clock)
    worker.start()
    try:
        yield worker
    finally:
        open_gate(runner)  # a test that failed with its gate shut: the worker can stop
        worker.stop()


async def collect(job: Job) -> list[Item]:
    """Every item of a job up to its terminal one."""
    items: list[Item] = []
    while True:
        item = await asyncio.wait_for(job.events.get(), 30)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def snapshot(worker: Worker) -> dict[str, Any]:
    return worker.snapshot().result(timeout=30)


def test_limits_are_validated(engine: Engine) -> None:
    for bad in ({"max_queue": -1}, {"queue_timeout_s": 0.0}, {"request_timeout_s": -2.0}):
        with pytest.raises(ConfigError, match="must be"):
            WorkerLimits(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="takes WorkerLimits"):
        Worker(BatchRunner(engine), 64, ServerMetrics())  # type: ignore[arg-type]


def test_queue_timeout_is_a_503_and_the_running_job_goes_on(engine: Engine) -> None:
    """Both jobs are submitted at the same fake time; the first takes the one slot in step 1 (so it never counts as
    queued) and holds it for 60 steps; the second has waited 3 steps (3 s > 2.5 s) after step 3."""
    clock = FakeClock()
    runner = SlowRunner(engine, max_batch=1, clock=clock)
    runner.gate.clear()  # no step (no tick of the clock) before both are submitted
    with running(runner, WorkerLimits(max_queue=4, queue_timeout_s=2.5), clock) as worker:

        async def main() -> tuple[list[Item], list[Item]]:
            loop = asyncio.get_running_loop()
            first = worker.submit(SeqRequest([5, 6, 7], 60), loop)  # holds the one slot for 60 steps
            second = worker.submit(SeqRequest([8, 9], 5), loop)
            runner.gate.set()
            return await asyncio.gather(collect(first), collect(second))

        first, second = asyncio.run(main())
        err = second[-1]
        assert len(second) == 1 and isinstance(err, APIError)
        assert (err.status, err.code) == (503, "queue_timeout") and "2.5 s" in err.message
        last = first[-1]
        assert isinstance(last, StepEvent) and last.finish_reason == "length" and len(first) == 60
        snap = snapshot(worker)
        assert snap["worker"]["queue_timeouts"] == 1 and snap["runner"]["pending"] == 0
        assert worker.metrics.events["queue_timeouts"] == 1  # the one store of the figure
        assert worker.in_flight == 0


def test_request_timeout_ends_the_job_and_frees_its_slot(engine: Engine) -> None:
    """One fake second per step, a 4.5 s limit: the long job is 5 s old after its 5th token and ends there; the short
    one (3 tokens, submitted after) finishes at most 4 steps after its submission (the long one's cancellation may
    take one), inside the limit."""
    clock = FakeClock()
    runner = SlowRunner(engine, max_batch=1, clock=clock)
    with running(runner, WorkerLimits(request_timeout_s=4.5), clock) as worker:

        async def main() -> tuple[list[Item], list[Item]]:
            loop = asyncio.get_running_loop()
            long = worker.submit(SeqRequest([5, 6, 7], 900), loop)  # 900 steps without the limit
            items = await collect(long)
            short = worker.submit(SeqRequest([8, 9], 3), loop)  # the slot is free again
            return items, await collect(short)

        long, short = asyncio.run(main())
        end = long[-1]
        assert isinstance(end, StepEvent) and (end.finish_reason, end.token, end.finished) == ("timeout", None, True)
        tokens = [ev.token for ev in long[:-1] if isinstance(ev, StepEvent)]
        assert len(long) == 6 and len(tokens) == 5 and None not in tokens  # 5 tokens, then the end
        assert isinstance(short[-1], StepEvent) and short[-1].finish_reason == "length" and len(short) == 3
        snap = snapshot(worker)
        assert snap["worker"]["request_timeouts"] == 1 and snap["runner"]["running"] == 0
        assert worker.metrics.events["finished_timeout"] == 1 == worker.metrics.events["request_timeouts"]


@pytest.mark.parametrize(
    ("exc", "status", "code", "named"),
    [
        (ExpertReadError(f"{PATH}: cannot read expert 3 of layer 1: Input/output error", ExpertKey(1, 3), PATH, (1,)),
         503, "expert_read_error", [PATH, "expert 3 of layer 1"]),
        (NumericalError("non-finite logits (NaN or Inf) in row(s) [1]: expert (1, 3) has NaN"), 500,
         "numerical_error", ["expert (1, 3)"]),
    ],
)  # fmt: skip
def test_sequence_failure_ends_only_its_job(engine: Engine, monkeypatch: pytest.MonkeyPatch, exc: Exception,
                                            status: int, code: str, named: list[str]) -> None:  # fmt: skip
    """Row 1 of the 3rd decode step of all three fails: that job gets the APIError, the other two finish."""
    lean = engine.decoder
    assert isinstance(lean, LeanDecoder)
    orig, seen = lean.finish_layer, []
    exc.__dict__["rows"] = (1,)

    def finish_layer(L: Any, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3 and L is lean.layers[0]:
            seen.append(1)
            if len(seen) == 3:
                raise exc
        return orig(L, x, att)

    monkeypatch.setattr(lean, "finish_layer", finish_layer)
    runner = SlowRunner(engine, max_batch=3)
    with running(runner, WorkerLimits()) as worker:

        async def main() -> list[list[Item]]:
            loop = asyncio.get_running_loop()
            jobs = [worker.submit(SeqRequest(p, 8), loop) for p in ([5, 6], [7, 8, 9, 11], [10])]  # no 3-row prefill
            return list(await asyncio.gather(*(collect(j) for j in jobs)))

        results = asyncio.run(main())
        snap = snapshot(worker)
        health = worker.health()
    bad = results[1][-1]
    assert isinstance(bad, APIError) and (bad.status, bad.code) == (status, code)
    assert all(n in bad.message for n in named)
    assert 3 <= len(results[1]) < 8  # its prefill's token, 2 or more decode steps (the jobs may start apart), the error
    for items in (results[0], results[2]):
        assert isinstance(items[-1], StepEvent) and items[-1].finish_reason == "length" and len(items) == 8
    assert snap["worker"]["sequence_errors"] == 1 and snap["runner"]["sequence_errors"] == 1
    assert health["status"] in ("ok", "degraded") and "engine" in health


def test_health(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(BatchRunner(engine), WorkerLimits(), ServerMetrics())
    assert worker.health()["status"] == "unavailable"  # not started
    worker.start()
    try:
        monkeypatch.setattr(engine, "health", lambda: {"status": "ok", "read_errors": 0})
        assert worker.health() == {"status": "ok", "engine": {"status": "ok", "read_errors": 0}, "running": 0,
                                   "queued": 0}  # fmt: skip
        monkeypatch.setattr(engine, "health", lambda: {"status": "degraded", "read_errors": 3})
        h = worker.health()
        assert h["status"] == "degraded" and h["engine"]["read_errors"] == 3
        snap = snapshot(worker)
        assert set(snap["worker"]) == {"queue_timeouts", "request_timeouts", "sequence_errors", "kv_waiting",
                                       "kv_reserved_bytes", "kv_budget_bytes"}  # fmt: skip
    finally:
        worker.stop()
    assert worker.health()["status"] == "unavailable"
