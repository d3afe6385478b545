"""Step 4 of `moetier profile` (runtime/profile.py): disk read bandwidth of a temp file, cold and through
the page cache, and the latency of a 4 KiB page-cache read.

Cold means O_DIRECT (bypassing the page cache) or, where that is refused (tmpfs), reading after
posix_fadvise(DONTNEED) dropped the file's pages; the method used is reported. The page-cache figure is
the best of `opts.rounds` passes after one pass that loads the file.
Invariants: the temp file (in `opts.tmp_dir`, else the system temp folder) is removed, also on error;
every file descriptor opened is closed.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class DiskOptions(Protocol):
    """What the disk step reads of runtime/profile.ProfileOptions (a protocol: no import of profile.py)."""

    @property
    def disk_mb(self) -> int: ...
    @property
    def tmp_dir(self) -> Path | None: ...
    @property
    def rounds(self) -> int: ...


def _read_all(fd: int, buf: mmap.mmap, size: int) -> int:
    done = 0
    while done < size:
        n = os.preadv(fd, [buf], done)
        if n <= 0:
            break
        done += n
    return done


def disk_bandwidth(opts: DiskOptions) -> dict[str, Any]:
    """Cold read (O_DIRECT, else fadvise DONTNEED) and page-cache read of a temp file: bytes/s, method, and the
    latency of a 4 KiB page-cache read. The file is removed afterwards."""
    size, chunk = opts.disk_mb << 20, 4 << 20
    folder = Path(opts.tmp_dir) if opts.tmp_dir else Path(tempfile.gettempdir())
    fd_w, path = tempfile.mkstemp(prefix="moetier-profile-", dir=folder)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        block = os.urandom(chunk)
        with os.fdopen(fd_w, "wb") as f:
            for _ in range(size // chunk or 1):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(path)
        # 4a. cold: O_DIRECT bypasses the page cache; where refused (tmpfs), drop the file's pages first
        method = "O_DIRECT"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            try:
                t0 = time.perf_counter()
                got = _read_all(fd, buf, size)
                cold_s = time.perf_counter() - t0
            finally:
                os.close(fd)
        except OSError:
            got = 0
        if got < size:
            method = "posix_fadvise(DONTNEED)"
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                _read_all(fd, buf, size)
                cold_s = time.perf_counter() - t0
            finally:
                os.close(fd)
        # 4b. page cache: read once to load it, then time the best of a few passes, and 4 KiB reads
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_all(fd, buf, size)
            warm_s = min(_timed(lambda: _read_all(fd, buf, size)) for _ in range(max(1, opts.rounds)))
            small = mmap.mmap(-1, 4096)
            offsets = list(range(0, size - 4096, max(4096, (size // 256) & ~4095)))[:256]
            t0 = time.perf_counter()
            for off in offsets:
                os.preadv(fd, [small], off)
            lat = (time.perf_counter() - t0) / max(1, len(offsets))
            small.close()
        finally:
            os.close(fd)
    finally:
        buf.close()
        os.unlink(path)
    return {"cold_bw": size / cold_s, "cold_method": method, "cached_bw": size / warm_s, "cached_latency_s": lat,
            "file_bytes": size, "folder": str(folder)}  # fmt: skip


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


__all__ = ["disk_bandwidth"]
