"""The mover: one background thread that carries out precision switches in order.

`submit` queues moves and returns at once, so the forward pass never waits on a move
it did not ask for. The thread runs `run(move)` for each; a move that raises is
recorded in `errors` (and passed to `on_error`), the store keeps serving the last
registered version of that expert, and the thread goes on with the next move.
`drain()` waits until the queue is empty (for reproducible runs and shutdown).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from moetier.types import Move

_STOP = object()


class Mover:
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

    def submit(self, moves: Iterable[Move]) -> int:
        if not self._thread.is_alive():
            raise RuntimeError("the mover is closed")
        n = 0
        for move in moves:
            self._queue.put(move)
            n += 1
        return n

    @property
    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted move has run (or failed); False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

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
