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
    """os.preadv fails with EIO for every byte range of expert `key` in `reader` (an ExpertReader), nothing else."""
    ranges = [(r.offset, r.offset + r.nbytes) for r in reader.plans[key]]
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if any(lo <= offset < hi for lo, hi in ranges):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    os.preadv = preadv  # type: ignore[assignment]
    try:
        yield
    finally:
        os.preadv = real
