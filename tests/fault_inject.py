"""Fault injection shared by the fault tests: EIO on one expert's byte ranges of a checkpoint reader."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moetier.types import ExpertKey


@contextmanager
def eio_on(reader: Any, key: ExpertKey) -> Iterator[None]:
    """os.preadv fails with EIO for every byte range of expert `key` in `reader` (an ExpertReader), nothing else (with
    the reader's DiskIO, its requests for those bytes)."""
    ranges = [(r.offset, r.offset + r.nbytes) for r in reader.plans[key]]
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if any(lo <= offset < hi for lo, hi in ranges):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    # with O_DIRECT (formats/diskio.py) a read covers the aligned blocks around the wanted bytes, which a tiny
    # expert shares with its neighbours: fail the requests whose wanted bytes are the expert's instead
    io = getattr(reader, "io", None)
    job = io._job if io is not None else None

    def failing_job(span: Any, a: int, b: int) -> BaseException | None:
        if any(a < hi and lo < b for lo, hi in ranges):
            return OSError(errno.EIO, os.strerror(errno.EIO))
        assert job is not None
        return job(span, a, b)

    if io is not None:
        io._job = failing_job
    else:
        os.preadv = preadv  # type: ignore[assignment]
    try:
        yield
    finally:
        os.preadv = real
        if io is not None:
            del io._job
