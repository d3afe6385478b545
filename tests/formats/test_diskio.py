"""formats/diskio.py and the ExpertReader reading through it: O_DIRECT reads at unaligned offsets and lengths are
byte-exact against buffered reads; where O_DIRECT is refused (EINVAL at open or at read, tmpfs) the reads fall
back to buffered + DONTNEED and say why; a layer call's experts read together (several in flight) equal those
read one at a time; EIO and a truncated file still raise ExpertReadError naming file and expert."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moetier.errors import CheckpointError, ExpertReadError
from moetier.formats.diskio import ALIGN, O_DIRECT, DiskIO, Span
from moetier.models.open import Opened, open_checkpoint
from moetier.store.source import FullSource, StoredSource
from moetier.types import ExpertKey

pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")


def _file(folder: Path, n: int = 3 * ALIGN + 123) -> tuple[Path, bytes]:
    data = os.urandom(n)
    path = folder / "blob.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("depth", [1, 3])
def test_unaligned_ranges_are_byte_exact(tmp_path: Path, depth: int) -> None:
    path, data = _file(tmp_path)
    io = DiskIO(direct=True, depth=depth, chunk=2 * ALIGN)
    fd = os.open(path, os.O_RDONLY)
    dfd = io.open_direct(fd, str(path))
    assert dfd is not None and io.mode == "O_DIRECT"
    try:
        cases = [(0, 10), (1, ALIGN), (ALIGN - 1, 2), (5, 2 * ALIGN + 7), (ALIGN, ALIGN), (100, len(data) - 100)]
        outs = [torch.zeros(n, dtype=torch.uint8) for _, n in cases]
        spans = [Span.of(fd, dfd, off, out) for (off, _), out in zip(cases, outs, strict=True)]
        assert io.read(spans) == [None] * len(cases)
        for (off, n), out in zip(cases, outs, strict=True):
            assert bytes(out.numpy()) == data[off : off + n]
        # a range past the end of the file is an EOF error for that span only
        short = torch.zeros(ALIGN, dtype=torch.uint8)
        ok = torch.zeros(8, dtype=torch.uint8)
        errs = io.read([Span.of(fd, dfd, len(data) - 10, short), Span.of(fd, dfd, 3, ok)])
        assert isinstance(errs[0], CheckpointError) and errs[1] is None and bytes(ok.numpy()) == data[3:11]
    finally:
        os.close(dfd)
        os.close(fd)
        io.close()


def test_refused_at_open_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = _file(tmp_path)
    real = os.open

    def no_direct(p: object, flags: int, *a: object) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(p, flags, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    io = DiskIO(direct=True)
    fd = real(path, os.O_RDONLY)
    try:
        assert io.open_direct(fd, str(path)) is None
        assert io.mode == "buffered+DONTNEED"
        assert "O_DIRECT refused" in str(io.fallback) and str(path) in str(io.fallback)
        out = torch.zeros(77, dtype=torch.uint8)
        assert io.read([Span.of(fd, None, 11, out)]) == [None] and bytes(out.numpy()) == data[11:88]
    finally:
        os.close(fd)


def test_refused_at_read_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = _file(tmp_path)
    io = DiskIO(direct=True, depth=2)
    fd = os.open(path, os.O_RDONLY)
    dfd = io.open_direct(fd, str(path))
    real = os.preadv

    def einval_on_direct(f: int, bufs: object, off: int, *a: object) -> int:
        if f == dfd:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(f, bufs, off, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "preadv", einval_on_direct)
    try:
        out = torch.zeros(3 * ALIGN, dtype=torch.uint8)
        assert io.read([Span.of(fd, dfd, 7, out, str(path))]) == [None]
        assert bytes(out.numpy()) == data[7 : 7 + 3 * ALIGN] and io.mode == "buffered+DONTNEED"
    finally:
        assert dfd is not None
        os.close(dfd)
        os.close(fd)
        io.close()


def test_tmpfs_refuses_o_direct(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    folder = shm / f"moetier-test-{os.getpid()}"
    folder.mkdir()
    try:
        path, data = _file(folder)
        io = DiskIO(direct=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            dfd = io.open_direct(fd, str(path))
            if dfd is not None:  # a kernel whose tmpfs accepts O_DIRECT (6.6+): nothing to fall back from
                os.close(dfd)
                pytest.skip("this tmpfs accepts O_DIRECT")
            out = torch.zeros(100, dtype=torch.uint8)
            assert io.read([Span.of(fd, None, 1, out)]) == [None] and bytes(out.numpy()) == data[1:101]
            assert io.stats()["mode"] == "buffered+DONTNEED" and io.stats()["fallback"]
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(folder)


def _reader(path: Path, io: DiskIO | None) -> Opened:
    o = open_checkpoint(path, "auto", torch.device("cpu"))
    if io is not None:
        o.reader.set_io(io)
    return o


@pytest.mark.parametrize(("variant", "depth"), [("fp32", 1), ("fp32", 4), ("bf16", 4)])
def test_expert_reads_equal_buffered_reads(tiny_ckpt: Callable[..., Path], variant: str, depth: int) -> None:
    """Tiny checkpoints put tensors at arbitrary offsets: every expert read through O_DIRECT (alone and as a layer
    call's batch) equals the old buffered read, for full and stored slots."""
    path = tiny_ckpt("qwen3_moe", variant)
    old, new = _reader(path, None), _reader(path, DiskIO(direct=True, depth=depth))
    try:
        assert new.reader.io is not None and new.reader.io.mode == "O_DIRECT"
        keys = list(old.reader.plans)
        for make in (lambda o: FullSource(o.reader, o.dtype), lambda o: StoredSource(o.reader, o.dtype)):
            a, b = make(old), make(new)
            pa, pb = a.make_pool(1, torch.device("cpu")), b.make_pool(len(keys), torch.device("cpu"))
            got = b.read_many([(k, pb.views[i]) for i, k in enumerate(keys)])
            assert all(isinstance(n, int) and n > 0 for n in got)
            for i, k in enumerate(keys):
                a.read_into(k, pa.views[0])
                assert torch.equal(pa.views[0].row, pb.views[i].row), k
                b.read_into(k, pb.views[0])
                assert torch.equal(pa.views[0].row, pb.views[0].row), k
        assert new.reader.io.stats()["bounced_bytes"] > 0  # tiny tensors sit at unaligned offsets
    finally:
        old.reader.close()
        new.reader.close()


def test_concurrent_readers_stay_exact(tiny_ckpt: Callable[..., Path]) -> None:
    """Two threads (the forward and the mover) reading through one reader and one DiskIO get the right bytes."""
    path = tiny_ckpt("qwen3_moe")
    ref, new = _reader(path, None), _reader(path, DiskIO(direct=True, depth=3))
    try:
        keys = list(ref.reader.plans)
        want = {}
        src = FullSource(ref.reader, ref.dtype)
        pool = src.make_pool(1, torch.device("cpu"))
        for k in keys:
            src.read_into(k, pool.views[0])
            want[k] = pool.views[0].row.clone()
        fsrc = FullSource(new.reader, new.dtype)
        bad: list[ExpertKey] = []

        def work(seed: int) -> None:
            p = fsrc.make_pool(4, torch.device("cpu"))
            order = keys[seed::2] * 3
            for i in range(0, len(order), 4):
                call = order[i : i + 4]
                fsrc.read_many([(k, p.views[j]) for j, k in enumerate(call)])
                bad.extend(k for j, k in enumerate(call) if not torch.equal(p.views[j].row, want[k]))

        threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not bad
    finally:
        ref.reader.close()
        new.reader.close()


def test_eio_and_truncation_name_file_and_expert(
    ckpt_copy: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ckpt_copy("qwen3_moe")
    o = _reader(path, DiskIO(direct=True, depth=2))
    try:
        src = FullSource(o.reader, o.dtype)
        pool = src.make_pool(2, torch.device("cpu"))
        keys = list(o.reader.plans)
        real = os.preadv

        def eio(fd: int, bufs: object, off: int, *a: object) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "preadv", eio)
        got = src.read_many([(keys[0], pool.views[0]), (keys[1], pool.views[1])])
        assert all(isinstance(g, ExpertReadError) for g in got)
        assert "model.safetensors" in str(got[0]) and f"expert {keys[0].expert} of layer {keys[0].layer}" in str(got[0])
        assert "Input/output error" in str(got[0])
        monkeypatch.setattr(os, "preadv", real)
        assert src.read_into(keys[0], pool.views[0]) > 0  # the descriptor was dropped and reopened
        # truncated in place: the last expert's bytes are gone
        last = max(keys, key=lambda k: max(r.offset for r in o.reader.plans[k]))
        end = min(r.offset for r in o.reader.plans[last])
        with open(path / "model.safetensors", "r+b") as f:
            f.truncate(end + 3)
        with pytest.raises(ExpertReadError, match=f"expert {last.expert} of layer {last.layer}.*truncated"):
            src.read_into(last, pool.views[0])
        got = src.read_many([(keys[0], pool.views[0]), (last, pool.views[1])])
        assert isinstance(got[0], int) and isinstance(got[1], ExpertReadError)
    finally:
        o.reader.close()


def test_staging_counts_bounce_buffers(tiny_ckpt: Callable[..., Path]) -> None:
    o = _reader(tiny_ckpt("qwen3_moe"), None)
    try:
        before = o.reader.staging_bytes
        io = DiskIO(direct=True, depth=3)
        o.reader.set_io(io)
        assert io.staging_bytes == 3 * (io.chunk + ALIGN) and o.reader.staging_bytes == before + io.staging_bytes
        assert io.chunk < 1 << 20  # a tiny model's bounce buffers are sized to its experts
        assert DiskIO(direct=False).staging_bytes == 0
        other = DiskIO(direct=True, depth=2)
        o.reader.set_io(other)  # replaces (and closes) the first
        assert o.reader.staging_bytes == before + other.staging_bytes == before + 2 * (io.chunk + ALIGN)
    finally:
        o.reader.close()
