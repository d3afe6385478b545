"""The one thread that owns the engine: it feeds requests to the BatchRunner and steps it.

Threading model (the runner is single-threaded, runtime/batch.py): HTTP handlers run on the
asyncio loop and never touch the engine or the runner. They `submit` a SeqRequest and get a
`Job` whose asyncio queue receives the runner's StepEvents (through
`loop.call_soon_threadsafe`), `cancel` a job (a disconnected client, a matched stop string), and
ask for a stats `snapshot` (answered by the worker between steps, so engine.stats() never races
a forward pass). The worker loops: take new jobs and cancellations, runner.step(), deliver
events; it sleeps on a condition while there is nothing to do.

Limits (`WorkerLimits`), checked by the worker between steps (so to within one step's time):
- `max_queue`: at most `max_batch + max_queue` jobs are in flight (submitted, not finished); past
  that `submit` raises APIError(429, code "queue_full") at once;
- `queue_timeout_s`: a job that has not started (no event yet: waiting for a slot or for KV budget)
  this long after its submission ends with APIError(503, code "queue_timeout"), retryable;
- `request_timeout_s`: a job not finished this long after its submission (queue wait included) is
  cancelled in the runner and ends with a terminal StepEvent(finish_reason="timeout") (the API turns
  it into a 504 when nothing was sent yet, else ends the stream with an error event).
Both time limits are measured on the worker's `clock` (default time.monotonic; tests pass a fake one, so a job's
age is the time they set, not what a busy machine took): `submit` stamps the job with it, `_expire` reads it.
Both are counted in ServerMetrics only ("queue_timeouts", "request_timeouts"); the snapshot's
"worker" section reads them there and the runner's figures from runner.stats() (metrics.WORKER_FIGURES).
A sequence the runner fails alone (StepEvent finish_reason "error", runtime/batch.py) ends its job with
APIError 503 (code "expert_read_error": a disk read of an expert failed; the message names the file
and the expert) or 500 (code "numerical_error", or "sequence_error" for anything else); the other jobs
go on (the runner counts it: its stats' sequence_errors). `health()` is "ok", "degraded" (the engine
reports recent read errors: still serving) or "unavailable" (the worker is not running).

Invariants:
- bounded: in-flight jobs never exceed `max_batch + max_queue`; nothing but the limits above and a
  request the runner refuses (APIError 400) refuses work;
- every job ends with exactly one terminal item on its queue: a finished StepEvent ("stop",
  "length", "cancelled", "timeout") or an exception (an APIError: the sequence failed, a queue
  timeout, the runner failed, the server stopped);
- a cancelled or timed-out job frees its place (slot or queue entry) before the worker's next step.
- counters first: the metrics and the running / in-flight counts a step changes are updated before
  its events are delivered, so whoever an event wakes never reads the counts from before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError, ExpertReadError, MoetierError, NumericalError
from moetier.runtime.batch import BatchRunner, SeqRequest, StepEvent
from moetier.serve.errors import APIError
from moetier.serve.metrics import ServerMetrics, worker_figures

log = logging.getLogger("moetier.serve")

Item = StepEvent | BaseException


@dataclass(frozen=True)
class WorkerLimits:
    max_queue: int = 64  # jobs that may wait for a slot beyond the runner's max_batch; more get 429
    queue_timeout_s: float | None = None  # longest wait for a slot (then 503 "queue_timeout"); None: no limit
    request_timeout_s: float | None = None  # longest time from submission to the end (then "timeout"); None: no limit

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("queue_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive (or None: no limit), got {value}")


@dataclass(eq=False)
class Job:
    """One request in flight; `events` is read on the asyncio loop, written from the worker."""

    req: SeqRequest
    loop: asyncio.AbstractEventLoop
    submitted: float  # time of submit on the worker's clock (Worker.clock), which the time limits count from
    events: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    finished: bool = False  # the terminal item was delivered (worker side)
    started: bool = False  # an event arrived (it holds a slot or has finished; worker side)

    def deliver(self, item: Item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    """See the module docstring; `clock` (seconds, monotonic) is what the time limits are measured on."""

    def __init__(self, runner: BatchRunner, limits: WorkerLimits, metrics: ServerMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not isinstance(limits, WorkerLimits):
            raise ConfigError(f"Worker takes WorkerLimits, got {type(limits).__name__}")
        self.runner, self.engine, self.limits, self.metrics = runner, runner.engine, limits, metrics
        self.clock = clock
        self.max_queue = limits.max_queue
        self.capacity = runner.max_batch + limits.max_queue
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._snaps: list[Future[dict[str, Any]]] = []
        self._jobs: dict[int, Job] = {}  # seq_id -> job (worker thread only)
        self._in_flight = 0
        self._running = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- handler side (asyncio loop) ---------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moetier-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot (in flight but not running)."""
        return max(0, self._in_flight - self._running)

    @property
    def running(self) -> int:
        return self._running

    def submit(self, req: SeqRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; APIError 429 when the queue is full, 503 when the worker is not running."""
        job = Job(req, loop, self.clock())
        with self._cond:
            if not self.alive:
                raise APIError(503, "the server is not running (shutting down or its worker failed)")
            if self._in_flight >= self.capacity:
                self.metrics.count("rejected")
                raise APIError(
                    429, f"the server is busy: {self._in_flight} requests in flight (--max-batch "
                    f"{self.runner.max_batch} running + --max-queue {self.max_queue} waiting); retry later",
                    None, "queue_full",
                )  # fmt: skip
            self._in_flight += 1
            self._inbox.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """End a job early (client gone, stop string); a no-op once it finished."""
        with self._cond:
            if job.finished:
                return
            if job in self._inbox:  # not yet handed to the runner: end it here
                self._inbox.remove(job)
                self._end(job, StepEvent(-1, None, True, "cancelled"))
                return
            self._cancels.append(job)
            self._cond.notify()

    def health(self) -> dict[str, Any]:
        """status "ok" | "degraded" (the engine's health says so: a recent read error) | "unavailable" (the worker
        is not running), the engine's health, and the running / queued counts. Cheap; any thread."""
        engine = self.engine.health()
        status = "unavailable" if not self.alive else "degraded" if engine.get("status") != "ok" else "ok"
        return {"status": status, "engine": engine, "running": self.running, "queued": self.queued}

    def snapshot(self) -> Future[dict[str, Any]]:
        """engine.stats(), runner.stats() and the limit figures ("worker": queue_timeouts, request_timeouts,
        sequence_errors, kv_waiting, kv_reserved_bytes, kv_budget_bytes, each read from its one store:
        metrics.WORKER_FIGURES), taken by the worker between steps."""
        fut: Future[dict[str, Any]] = Future()
        with self._cond:
            if not self.alive:
                fut.set_result(self._stats())
                return fut
            self._snaps.append(fut)
            self._cond.notify()
        return fut

    # -- worker thread -------------------------------------------------------------------
    def _end(self, job: Job, item: Item) -> None:
        """Deliver the terminal item; call with self._cond held."""
        if job.finished:
            return
        job.finished = True
        if isinstance(item, StepEvent) and item.finish_reason:  # counted before anyone can see the end
            self.metrics.count(f"finished_{item.finish_reason}")
        self._in_flight -= 1
        job.deliver(item)

    def _stats(self) -> dict[str, Any]:
        runner = self.runner.stats()
        limits = worker_figures(self.metrics.events_now(), runner)
        return {"engine": self.engine.stats(), "runner": runner, "worker": limits, "time": time.time()}

    def _run(self) -> None:
        runner = self.runner
        while True:
            # 1. wait for work; take new jobs, cancellations and stats requests
            with self._cond:
                while not (self._stop or self._inbox or self._cancels or self._snaps or not runner.idle()):
                    self._cond.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                snaps, self._snaps = self._snaps, []
            for fut in snaps:
                try:
                    fut.set_result(self._stats())
                except Exception as exc:  # stats must never kill the worker
                    fut.set_exception(exc)
            # 2. hand new jobs to the runner (a request it refuses ends with its error)
            for job in inbox:
                try:
                    job.seq_id = runner.add(job.req)
                    self._jobs[job.seq_id] = job
                except MoetierError as exc:
                    with self._cond:
                        self._end(job, APIError(400, str(exc)))
            for job in cancels:
                if job.seq_id is not None and job.seq_id in self._jobs:
                    runner.cancel(job.seq_id)
            self._expire()
            if runner.idle():
                continue
            # 3. one step; deliver its events
            try:
                events = runner.step()
            except Exception as exc:
                log.exception("the batch runner failed; ending its requests")
                self._fail_all(exc)
                continue
            self._deliver(events)
        self._fail_all(APIError(503, "the server is shutting down"))

    def _expire(self) -> None:
        """End the jobs past their limits: a queue timeout (not started) -> APIError 503, a request timeout ->
        StepEvent "timeout"; each is cancelled in the runner (its cancellation event then finds no job)."""
        qt, rt = self.limits.queue_timeout_s, self.limits.request_timeout_s
        if qt is None and rt is None:
            return
        now = self.clock()
        for seq_id, job in list(self._jobs.items()):
            waited = now - job.submitted
            item: Item
            if qt is not None and not job.started and waited > qt:
                self.metrics.count("queue_timeouts")
                item = APIError(503, f"no slot became free within the queue time limit of {qt:g} s "
                                f"({self.runner.running} running, {self.runner.pending} waiting); retry later",
                                None, "queue_timeout")  # fmt: skip
            elif rt is not None and waited > rt:
                self.metrics.count("request_timeouts")
                item = StepEvent(seq_id, None, True, "timeout")  # counted as finished_timeout by _end
            else:
                continue
            self.runner.cancel(seq_id)
            del self._jobs[seq_id]
            with self._cond:
                self._end(job, item)
                self._running = self.runner.running

    def _deliver(self, events: list[StepEvent]) -> None:
        tokens = sum(ev.token is not None for ev in events)
        if tokens:  # counts first: a handler (or client) woken by an event below must already see them
            self.metrics.add_tokens(tokens)
        with self._cond:
            self._running = self.runner.running
            for ev in events:
                job = self._jobs.get(ev.seq_id)
                if job is None:
                    continue
                job.started = True
                if ev.finished:
                    del self._jobs[ev.seq_id]
                    self._end(job, _sequence_error(ev) if ev.finish_reason == "error" else ev)
                else:
                    job.deliver(ev)

    def _fail_all(self, exc: BaseException) -> None:
        for seq_id in list(self._jobs):
            self.runner.cancel(seq_id)
        if not self.runner.idle():
            try:
                self.runner.step()  # reports (and forgets) the cancellations
            except Exception:
                log.exception("the batch runner failed while cancelling")
        with self._cond:
            for job in [*self._jobs.values(), *self._inbox]:
                self._end(job, exc)
            self._jobs.clear()
            self._inbox.clear()
            self._running = self.runner.running


def _sequence_error(ev: StepEvent) -> APIError:
    """The terminal APIError of a sequence the runner failed alone: 503 for a failed expert read (the file and
    the expert named), 500 for non-finite values or anything else."""
    exc = ev.error
    if isinstance(exc, ExpertReadError):
        where = f" (expert {exc.key} in {exc.path})" if exc.path and str(exc.path) not in str(exc) else ""
        return APIError(503, f"reading an expert's weights failed: {exc}{where}", None, "expert_read_error")
    if isinstance(exc, NumericalError):
        return APIError(500, f"the model produced non-finite values: {exc}", None, "numerical_error")
    return APIError(500, f"the generation failed: {exc}", None, "sequence_error")


__all__ = ["Job", "Worker", "WorkerLimits"]
