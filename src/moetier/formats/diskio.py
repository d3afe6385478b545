"""Disk reads that use the disk: byte ranges of checkpoint files read with O_DIRECT, several in flight.

`DiskIO.read(spans)` fills CPU memory (pool slots, staging) from file byte ranges. Spans that follow each
other in one file (an expert's tensors) are merged; each range is cut at multiples of `chunk` bytes of the
file (so a request's aligned envelope never exceeds one chunk) and the requests of every span of the call
are read by `depth` threads at once (`os.preadv` releases the GIL), so a layer call with several misses
keeps several requests in the device's queue instead of one. CHUNK (1 MiB) and DEPTH (8) were chosen by
benchmarks/disk_reads.py (docs/benchmarks.md, "Cold expert reads").

With `direct` the reads bypass the page cache (O_DIRECT): nothing read stays in memory the process did
not ask for (a cgroup memory limit counts page cache), and a cold read streams at the device's speed.
O_DIRECT needs the file offset, the length and the buffer address aligned to ALIGN bytes; a checkpoint
tensor sits at any offset, so a piece is read as its aligned enclosing range into an aligned bounce
buffer (one per request in flight, `chunk` + ALIGN bytes) and the wanted bytes are copied out with `ctypes.memmove`
(which releases the GIL too); a piece whose file offset, length and destination address are all
aligned is read straight into its destination. Where the filesystem refuses O_DIRECT (tmpfs: EINVAL
at open; some filesystems at read) the reads fall back to buffered `preadv` straight into the
destination followed by `posix_fadvise(DONTNEED)` of the range, and `fallback` says why (shown in
Engine.stats()["disk_io"]). Without `direct` the reads are buffered and the page cache keeps them (a
warm rerun reads from memory), still `depth` in flight.

Invariants: a read either fills every byte of its span or reports an error for it (EIO, or
`CheckpointError("unexpected end of file")` for a file shorter than the span); a span's error never
affects another span; `staging_bytes` (the bounce buffers) is all the memory reads use beyond their
destinations; the bounce buffers are allocated once and never shared by two reads at a time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.errors import CheckpointError

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and addresses (the page size: any logical block size fits)
CHUNK = 1 << 20  # bytes per request at most (`fit` caps it at one expert); chosen by benchmarks/disk_reads.py
DEPTH = 8  # requests in flight (same)
EOF = "unexpected end of file"
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


@dataclass
class Span:
    """One contiguous byte range of one file and where its bytes go, in file order: `dests` are (address,
    nbytes) pairs of CPU memory whose sizes sum to `nbytes`."""

    fd: int  # buffered descriptor
    dfd: int | None  # O_DIRECT descriptor of the same file, or None (buffered reads)
    offset: int
    nbytes: int
    dests: list[tuple[int, int]] = field(default_factory=list)
    name: str = ""  # the file, for messages

    @classmethod
    def of(cls, fd: int, dfd: int | None, offset: int, dest: torch.Tensor, name: str = "") -> Span:
        """The span filling one contiguous CPU tensor (any dtype and shape) from `offset`."""
        if dest.device.type != "cpu" or not dest.is_contiguous():
            raise ValueError(f"a disk read needs a contiguous CPU destination, got {dest.device} {tuple(dest.shape)}")
        n = dest.numel() * dest.element_size()
        return cls(fd, dfd, offset, n, [(dest.data_ptr(), n)], name)


def _view(addr: int, n: int) -> memoryview:
    """Writable bytes at a raw CPU address (a slot's, a bounce buffer's) for os.preadv."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


class DiskIO:
    """Reads spans of files, O_DIRECT with bounce buffers (or buffered), `depth` requests in flight. Thread-safe:
    a call takes a bounce buffer per request from a shared queue, so two threads may read at once."""

    def __init__(self, direct: bool = True, depth: int = DEPTH, chunk: int = CHUNK) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if chunk < ALIGN or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}, got {chunk}")
        self.direct = direct and bool(O_DIRECT)
        self.depth, self.chunk = depth, chunk
        self.fallback: str | None = None if self.direct or not direct else "this platform has no O_DIRECT"
        # one bounce buffer per request in flight; the chunk cut keeps every aligned envelope within one
        self.staging_bytes = depth * (chunk + ALIGN) if self.direct else 0
        self._bufs: queue.SimpleQueue[tuple[torch.Tensor, int]] = queue.SimpleQueue()
        self._made = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.requests = self.bytes = self.bounced_bytes = 0

    def fit(self, largest: int) -> None:
        """Before any read: no span (after merging, one expert's ranges) will exceed about `largest` bytes, so a chunk
        of its aligned size plus one block holds a request's envelope (a tiny model's bounce buffers stay small)."""
        self.chunk = min(self.chunk, -(-largest // ALIGN) * ALIGN + ALIGN)
        self.staging_bytes = self.depth * (self.chunk + ALIGN) if self.direct else 0

    @property
    def mode(self) -> str:
        """"O_DIRECT", "buffered+DONTNEED" (O_DIRECT wanted, refused) or "buffered"."""
        if self.direct and self.fallback is None:
            return "O_DIRECT"
        return "buffered+DONTNEED" if self.direct else "buffered"

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, "fallback": self.fallback, "depth": self.depth, "chunk": self.chunk,
                "requests": self.requests, "bytes": self.bytes, "bounced_bytes": self.bounced_bytes,
                "staging_bytes": self.staging_bytes}  # fmt: skip

    def open_direct(self, fd: int, path: str) -> int | None:
        """An O_DIRECT descriptor of the file `fd` has open (the same file even if `path` was renamed over since:
        /proc/self/fd), or None when direct reads are off or refused (the reason kept in `fallback`)."""
        if not self.direct or self.fallback is not None:
            return None
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | O_DIRECT)
        except FileNotFoundError:  # no /proc: the path itself
            pass
        except OSError as exc:
            self._refused(exc, path)
            return None
        try:
            return os.open(path, os.O_RDONLY | O_DIRECT)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            self._refused(exc, path)
            return None

    def _refused(self, exc: OSError, path: str) -> None:
        with self._lock:
            if self.fallback is None:
                self.fallback = f"{path}: O_DIRECT refused ({exc.strerror or exc}); buffered reads + DONTNEED"

    def read(self, spans: Sequence[Span]) -> list[BaseException | None]:
        """Fill every span; per span None, or the error that stopped it (OSError, CheckpointError(EOF)). Spans that
        follow each other in one file (an expert's tensors) are read as one range."""
        merged, owner = _coalesce(spans)
        got = self._read(merged)
        return [got[owner[i]] for i in range(len(spans))]

    def _read(self, spans: Sequence[Span]) -> list[BaseException | None]:
        jobs: list[tuple[int, int, int]] = []  # (span, start, end) file offsets
        for i, s in enumerate(spans):
            c, end = s.offset, s.offset + s.nbytes
            while c < end:
                nxt = min(end, (c // self.chunk + 1) * self.chunk)
                jobs.append((i, c, nxt))
                c = nxt
        errors: list[BaseException | None] = [None] * len(spans)
        if len(jobs) <= 1 or self.depth == 1:
            results = [self._job(spans[i], a, b) for i, a, b in jobs]
        else:
            if self._pool is None:
                with self._lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="moetier-disk")
            results = list(self._pool.map(lambda j: self._job(spans[j[0]], j[1], j[2]), jobs))
        for (i, _, _), err in zip(jobs, results, strict=True):
            if err is not None and errors[i] is None:
                errors[i] = err
        return errors

    def _job(self, s: Span, a: int, b: int) -> BaseException | None:
        """Read file bytes [a, b) of span `s` into their destinations; the error instead of raising it."""
        try:
            if s.dfd is not None and self.fallback is None:
                try:
                    self._direct(s, a, b)
                    return None
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._refused(exc, s.name or f"descriptor {s.fd}")  # refused at read: buffered from now on
            self._buffered(s, a, b)
            return None
        except (OSError, CheckpointError) as exc:
            return exc

    def _parts(self, s: Span, a: int, b: int) -> list[tuple[int, int, int]]:
        """(file offset, address, nbytes) of the destinations of file bytes [a, b) of `s`."""
        out, at = [], s.offset
        for addr, n in s.dests:
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                out.append((lo, addr + lo - at, hi - lo))
            at += n
            if at >= b:
                break
        return out

    def _buffered(self, s: Span, a: int, b: int) -> None:
        total = pread_exact(s.fd, [_view(addr, n) for _, addr, n in self._parts(s, a, b)], a, EOF)
        if self.direct:  # O_DIRECT refused: leave no page cache behind
            os.posix_fadvise(s.fd, a, total, os.POSIX_FADV_DONTNEED)
        self._count(total, 0)

    def _direct(self, s: Span, a: int, b: int) -> None:
        assert s.dfd is not None
        parts = self._parts(s, a, b)
        if a % ALIGN == 0 and all(addr % ALIGN == 0 and n % ALIGN == 0 for _, addr, n in parts):
            views = [_view(addr, n) for _, addr, n in parts]  # aligned: straight into the destinations
            done = 0
            while done < b - a:
                n = os.preadv(s.dfd, after(views, done), a + done)
                if n <= 0 or n % ALIGN:
                    raise CheckpointError(EOF)
                done += n
            self._count(b - a, 0)
            return
        a0, a1 = a - a % ALIGN, -(-b // ALIGN) * ALIGN  # the aligned envelope, within one chunk
        buf, base = self._take()
        try:
            _read_full(s.dfd, _view(base, a1 - a0), a0, b - a0)
            for off, addr, n in parts:
                ctypes.memmove(addr, base + off - a0, n)
        finally:
            self._bufs.put((buf, base))
        self._count(b - a, b - a)

    def _take(self) -> tuple[torch.Tensor, int]:
        """A free bounce buffer (at most `depth` are ever made): the tensor and its aligned address."""
        with self._lock:
            if self._made < self.depth and self._bufs.empty():
                self._made += 1
                buf = torch.empty(self.chunk + ALIGN, dtype=torch.uint8)  # [chunk + ALIGN]: aligned inside
                self._bufs.put((buf, buf.data_ptr() + (-buf.data_ptr()) % ALIGN))
        return self._bufs.get()

    def _count(self, n: int, bounced: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += n
            self.bounced_bytes += bounced

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _coalesce(spans: Sequence[Span]) -> tuple[list[Span], list[int]]:
    """Spans merged where one starts in the same file where the previous ends; and each span's merged index."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].fd, spans[i].offset))
    merged: list[Span] = []
    owner = [0] * len(spans)
    for i in order:
        s = spans[i]
        last = merged[-1] if merged else None
        if last is not None and last.fd == s.fd and last.offset + last.nbytes == s.offset:
            last.nbytes += s.nbytes
            last.dests += s.dests
        else:
            merged.append(Span(s.fd, s.dfd, s.offset, s.nbytes, list(s.dests), s.name))
        owner[i] = len(merged) - 1
    return merged, owner


def _read_full(fd: int, view: memoryview, offset: int, need: int) -> None:
    """O_DIRECT read of `view` (aligned) at `offset` until at least `need` bytes are in; a shorter file is EOF."""
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
        if n % ALIGN:  # a short read ends at the file's end
            break
    if done < need:
        raise CheckpointError(EOF)


def pread_exact(fd: int, views: list[memoryview], offset: int, eof_message: str) -> int:
    """Fill `views` from `fd` at `offset`, resuming short reads; CheckpointError(eof_message) at EOF."""
    done, total = 0, sum(len(v) for v in views)
    while done < total:
        n = os.preadv(fd, after(views, done), offset + done)
        if n <= 0:
            raise CheckpointError(eof_message)
        done += n
    return done


def after(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers of `views` after their first `n` bytes (to resume a short read)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out
