"""The mover: one background thread that carries out precision switches in order.

`submit` queues moves and returns at once, so the forward pass never waits on a move
it did not ask for. The thread runs `run(move)` for each; a move that raises is
recorded in `errors` (and passed to `on_error`), the store keeps serving the last
registered version of that expert, and the thread goes on with the next move.
`drain()` waits until the queue is empty (for reproducible runs and shutdown).

`SwitchPipeline` is the mover of dynamic precision with several switches in flight (DynaExq 3.3-3.4:
"SSD prefetch, DRAM buffering, H2D transfers, and demotions proceed concurrently"): one dispatcher
thread begins each move in submission order (reserving its slot, store/dynamic.py `begin_switch`,
waiting there for a slot an earlier move frees), then hands the fill and registration to one of
`workers` threads. Beginning in plan order keeps the plan feasible (each begin waits only on moves
already begun, which never wait); `workers` bounds the switches in flight. With one worker it is the
Mover: one switch at a time.

`PrefetchLoads` runs an ExpertStore's background prefetches on one Mover (see its docstring
and store/store.py for the slot and provenance invariants).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moetier.types import ExpertKey, Move, MoveKind, Tier

_STOP = object()


class _MoveQueue:
    """What Mover and SwitchPipeline share: a queue of moves one dispatcher thread takes in order;
    `pending` counts moves submitted and not yet done (registered or failed)."""

    _queue: queue.Queue[object]
    _thread: threading.Thread
    _what = "mover"

    def submit(self, moves: Iterable[Move]) -> int:
        if not self._thread.is_alive():
            raise RuntimeError(f"the {self._what} is closed")
        n = 0
        for move in moves:
            self._queue.put(move)
            n += 1
        return n

    @property
    def pending(self) -> int:
        """Moves submitted and not yet registered or failed."""
        return self._queue.unfinished_tasks

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted move has run (or failed); False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)


class Mover(_MoveQueue):
    def __init__(
        self,
        run: Callable[[Move], object],
        on_error: Callable[[Move, BaseException], None] | None = None,
        name: str = "moetier-mover",
    ) -> None:
        self._run, self._on_error = run, on_error
        self._queue: queue.Queue[object] = queue.Queue()
        self.errors: list[str] = []
        self.done = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                assert isinstance(item, Move)
                try:
                    self._run(item)
                    self.done += 1
                except Exception as exc:  # keep serving: the old version stays registered
                    where = f"{item.kind} {tuple(item.key)} to {item.precision}"
                    self.errors.append(f"{where}: {type(exc).__name__}: {exc}")
                    if self._on_error is not None:
                        self._on_error(item, exc)
            finally:
                self._queue.task_done()

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)


class SwitchPipeline(_MoveQueue):
    """Moves begun in order on one thread, finished on up to `workers` threads (see the module docstring).

    `begin(move)` returns a ticket (or None: nothing to do) and may block until an earlier move frees
    what it needs; `finish(ticket)` does the work and must not wait on later moves. A move whose begin
    or finish raises is recorded in `errors` and passed to `on_error`; the pipeline goes on."""

    _what = "switch pipeline"

    def __init__(
        self,
        begin: Callable[[Move], object | None],
        finish: Callable[[Any], object],
        workers: int = 1,
        on_error: Callable[[Move, BaseException], None] | None = None,
        name: str = "moetier-switch",
    ) -> None:
        if workers < 1:
            raise ValueError(f"a switch pipeline needs at least one worker, got {workers}")
        self._begin, self._finish, self._on_error = begin, finish, on_error
        self.workers = workers
        self._queue: queue.Queue[object] = queue.Queue()
        self._slots = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.errors: list[str] = []
        self.done = 0
        self._count = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _failed(self, move: Move, exc: BaseException) -> None:
        with self._count:
            self.errors.append(f"{move.kind} {tuple(move.key)} to {move.precision}: {type(exc).__name__}: {exc}")
        if self._on_error is not None:
            self._on_error(move, exc)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            assert isinstance(item, Move)
            self._slots.acquire()  # at most `workers` in flight
            try:
                ticket = self._begin(item)
            except Exception as exc:  # keep serving: the old version stays registered
                ticket = None
                self._failed(item, exc)
            if ticket is None:
                self._slots.release()
                self._queue.task_done()
                continue
            self._pool.submit(self._work, item, ticket)

    def _work(self, move: Move, ticket: object) -> None:
        try:
            self._finish(ticket)
            with self._count:
                self.done += 1
        except Exception as exc:
            self._failed(move, exc)
        finally:
            self._slots.release()
            self._queue.task_done()

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self._pool.shutdown(wait=True)


class PrefetchLoads:
    """Background prefetch loads into slots an ExpertStore reserved (store.prefetch).

    One Mover thread. Each load fills its reserved compute-tier slot outside the store lock
    (disk -> host slot on a CPU machine; on a GPU machine the host copy is acquired, read from
    disk first if needed, and copied on a side CUDA stream), then registers it under the lock.
    A failed load frees its slot, counts in `store.prefetch_failed` (and, a failed read, in
    `store.faults`), and is recorded in `mover.errors`; the store keeps serving, and a later forward
    that needs the key loads it on demand (raising ExpertReadError if the read fails again).
    """

    def __init__(self, store: Any) -> None:  # an ExpertStore (not imported: store.py imports this module)
        self.store = store
        self.mover = Mover(self._run, name="moetier-prefetch")
        self._stream: Any = None

    def issue(self, keys: Iterable[ExpertKey], protect: Collection[ExpertKey]) -> list[ExpertKey]:
        """Reserve a compute-tier slot per key now (in the caller's thread), queue the loads."""
        st = self.store
        issued: list[ExpertKey] = []
        with st._lock:
            state = st.compute
            exclude = set(protect) | state.prefetched
            for key in keys:
                if key in state.slots or key in state.inflight:
                    continue
                slot = state.take_slot(exclude=exclude, demand=False)  # never a transient slot
                if slot is None:
                    break
                state.inflight[key] = slot
                state.peak_slots = max(state.peak_slots, len(state.slots) + len(state.inflight))
                issued.append(key)
            st.prefetch_issued += len(issued)
        src, dst = (Tier.DISK, Tier.HOST) if st.accel is None else (Tier.HOST, Tier.ACCEL)
        self.mover.submit(Move(MoveKind.PREFETCH, k, src, dst, st.precision, st.slot_bytes) for k in issued)
        return issued

    def _run(self, move: Move) -> None:
        st, key = self.store, move.key
        state = st.compute
        with st._lock:
            slot = state.inflight[key]
        try:
            if st.accel is None:
                try:
                    n = st.source.read_into(key, state.pool.views[slot])
                except BaseException as exc:
                    err = st.read_failed(key, exc)  # counted in the store's faults (Engine.health)
                    if err is None or err is exc:
                        raise
                    raise err from exc
                with st._lock:
                    st.disk_bytes += n
            else:
                self._copy_to_accel(key, slot)  # a failed disk read is counted by the host acquire
        except BaseException:
            with st._cv:
                del state.inflight[key]
                state.free.append(slot)  # never register a partial expert
                st.prefetch_failed += 1
                st._cv.notify_all()
            raise  # the Mover records the error; later forwards load the key on demand
        with st._cv:
            del state.inflight[key]
            state.insert(key, slot)
            state.prefetched.add(key)
            st._cv.notify_all()

    def _copy_to_accel(self, key: ExpertKey, slot: int) -> None:
        """GPU machine: host -> GPU on a side stream, fully written before it registers.
        UNVERIFIED: written without a GPU to run it on."""
        import torch

        st = self.store
        host_views = st.acquire(key, Tier.HOST)  # disk -> host if needed; pinned while copying
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(st.device)
            with torch.cuda.stream(self._stream):
                st.accel.pool.views[slot].row.copy_(host_views.row, non_blocking=True)
            self._stream.synchronize()
            with st._lock:
                st.h2d_bytes += st.slot_bytes
        finally:
            st.release(key, Tier.HOST)
