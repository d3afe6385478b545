"""The one thread that owns the engine: it feeds requests to the BatchRunner and steps it.

Threading model (the runner is single-threaded, runtime/batch.py): HTTP handlers run on the
asyncio loop and never touch the engine or the runner. They `submit` a SeqRequest and get a
`Job` whose asyncio queue receives the runner's StepEvents (through
`loop.call_soon_threadsafe`), `cancel` a job (a disconnected client, a matched stop string), and
ask for a stats `snapshot` (answered by the worker between steps, so engine.stats() never races
a forward pass). The worker loops: take new jobs and cancellations, runner.step(), deliver
events; it sleeps on a condition while there is nothing to do.

Invariants:
- bounded: at most `max_batch + max_queue` jobs are in flight (submitted, not finished); past
  that `submit` raises APIError(429) at once; nothing else refuses work;
- every job ends with exactly one terminal item on its queue: a finished StepEvent ("stop",
  "length", "cancelled") or an exception (the runner failed, the server stopped);
- a cancelled job frees its place (slot or queue entry) before the worker's next step.
- counters first: the metrics and the running / in-flight counts a step changes are updated before
  its events are delivered, so whoever an event wakes never reads the counts from before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError, MoetierError
from moetier.runtime.batch import BatchRunner, SeqRequest, StepEvent
from moetier.serve.errors import APIError
from moetier.serve.metrics import ServerMetrics

log = logging.getLogger("moetier.serve")

Item = StepEvent | BaseException


@dataclass(eq=False)
class Job:
    """One request in flight; `events` is read on the asyncio loop, written from the worker."""

    req: SeqRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    finished: bool = False  # the terminal item was delivered (worker side)

    def deliver(self, item: Item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    def __init__(self, runner: BatchRunner, max_queue: int, metrics: ServerMetrics) -> None:
        if max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
        self.runner, self.engine, self.max_queue, self.metrics = runner, runner.engine, max_queue, metrics
        self.capacity = runner.max_batch + max_queue
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
        job = Job(req, loop)
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

    def snapshot(self) -> Future[dict[str, Any]]:
        """engine.stats() and runner.stats(), taken by the worker between steps."""
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
        return {"engine": self.engine.stats(), "runner": self.runner.stats(), "time": time.time()}

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
                if ev.finished:
                    del self._jobs[ev.seq_id]
                    self._end(job, ev)
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


__all__ = ["Job", "Worker"]
