"""Reads one expert from the safetensors files straight into a pool slot.

Each expert's pieces are located once at open (file, byte offset, dtype, shape) and
validated against the config: a missing, mis-shaped or wrongly typed expert tensor
raises CheckpointError naming it. A read is `os.preadv` into the slot's own memory
when the stored dtype and layout already match the slot; otherwise it goes through
one staging buffer allocated at start (dtype cast, transpose, de-interleave). No
file is mapped into the process, so reading never leaves a whole file resident. A fused tensor
stored [E * rows, ...] (the experts stacked along its rows: DBRX's w1 / v1 / w2) is read as the
[E, rows, ...] it is byte for byte.

An encoded expert tensor (a quantised checkpoint, formats/encoded.py) is read part by part
into the staging buffer (for a fused tensor [E, ...], the expert's slice of every part),
decoded by its codec to float32, then the family op is applied while copying into the slot
piece: the slot holds the dequantised expert in the compute dtype. `staging_bytes` counts the
raw parts plus DECODE_WORKSPACE float32 copies of the decoded slice (the codec's output and
its temporaries), so budgets include the decode's transient memory.

`read_tensor(loc)` reads one whole tensor (decoded for an encoded one) for the non-expert
weights, with pread as well: every weight the engine holds is its own memory, so a checkpoint
truncated or replaced under a running engine can never fault the process (SIGBUS) through a map.

Faults at run time (a file truncated, replaced or failing with EIO under a running engine): a failed
expert read raises `ExpertReadError(message, key, path)` naming the file, the expert and the tensor
(rows are filled in by the MoE block that needed it); the file's descriptor is dropped, so the next
read reopens the path: a file restored in place or by rename is read again. A reopened file whose
header (safetensors or GGUF: the bytes before its first tensor) differs from the one first opened was
replaced by another checkpoint and is refused (ExpertReadError) rather than read at stale offsets. A
file replaced by rename while no read fails keeps being read through the descriptor already open (the
old file's bytes, consistent with the index).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from moetier.errors import CheckpointError, ExpertReadError
from moetier.formats.checkpoint import CheckpointIndex, TensorLocation
from moetier.formats.codecs import CODECS
from moetier.formats.diskio import EOF, DiskIO, Span, pread_exact
from moetier.formats.layout import ExpertLayout, ExpertSource
from moetier.formats.location import read_bytes
from moetier.store import hostmem
from moetier.types import ExpertKey

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
STORED_DTYPES = TORCH_DTYPES | {
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_Dests = Sequence[Sequence[torch.Tensor] | None]  # read_stored's raw destinations, per read of an expert's plan
DECODE_WORKSPACE = 4  # float32 copies of a decoded slice a codec may hold at once (output + temporaries)
HEADER_DIGEST_BYTES = 16 * 1024 * 1024  # a file's header bytes hashed to notice it was replaced (see ExpertReader)


def byte_view(t: torch.Tensor) -> memoryview:
    """The flat bytes of a CPU tensor's own memory (any shape), for os.preadv to fill."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy().data)


class _ReadFailed(Exception):
    """One pread of an expert failed (EIO, end of file, a missing or replaced file); ExpertReader.read_into and
    read_stored turn it into ExpertReadError naming the expert."""

    def __init__(self, loc: TensorLocation, reason: str) -> None:
        super().__init__(reason)
        self.loc, self.reason = loc, reason


def _reason(exc: BaseException) -> str:
    """A failed read's cause in a few words (the errno's text for an OSError)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc)


@dataclass(frozen=True)
class _Part:
    """One stored part of an encoded tensor, restricted to one expert."""

    loc: TensorLocation
    offset: int  # absolute file offset
    nbytes: int
    shape: tuple[int, ...]  # the expert's slice as stored


@dataclass(frozen=True)
class _Read:
    """One contiguous byte range of the checkpoint feeding one or more pieces."""

    loc: TensorLocation
    offset: int  # absolute file offset
    nbytes: int
    src_shape: tuple[int, ...]  # shape of this expert's slice as stored (decoded, for an encoded tensor)
    pieces: tuple[tuple[str, str], ...]  # (piece, op)
    parts: tuple[_Part, ...] = ()  # an encoded tensor: this expert's byte range of each stored part

    @property
    def staging(self) -> int:
        """Transient bytes this read needs beyond the slot (0 if direct; see the module docstring)."""
        if not self.parts:
            return self.nbytes
        return self.nbytes + DECODE_WORKSPACE * 4 * prod(self.src_shape)


def _expected_src_shape(op: str, dest: tuple[int, ...]) -> tuple[int, ...]:
    return {
        "copy": dest,
        "T": tuple(reversed(dest)),
        "T_even": (dest[-1], 2 * dest[0]),
        "T_odd": (dest[-1], 2 * dest[0]),
        "even": (2 * dest[0], *dest[1:]),
        "odd": (2 * dest[0], *dest[1:]),
        "top": (2 * dest[0], *dest[1:]),
        "bottom": (2 * dest[0], *dest[1:]),
        "T_top": (dest[-1], 2 * dest[0]),
        "T_bottom": (dest[-1], 2 * dest[0]),
    }[op]


@dataclass(frozen=True)
class StoredTensor:
    """One checkpoint tensor of an expert as a stored-form slot keeps it (store/source.py StoredSource): the
    same for every expert of the checkpoint."""

    codec: str | None  # an encoded tensor's codec (formats/codecs.py); None: a plain tensor in its stored dtype
    parts: tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # per stored part: dtype, the expert's slice shape
    shape: tuple[int, ...]  # the decoded slice, the family op's source
    pieces: tuple[tuple[str, str], ...]  # (canonical piece, op) it feeds

    @property
    def part_bytes(self) -> tuple[int, ...]:
        return tuple(prod(shape) * dtype.itemsize for dtype, shape in self.parts)


def read_parts(loc: TensorLocation) -> list[torch.Tensor]:
    """The stored parts of an encoded tensor (a GPTQ qweight / qzeros / scales / g_idx ...), each in its stored
    dtype and shape, read with pread (CheckpointError naming the file and tensor on a short or failed read)."""
    return [torch.frombuffer(read_bytes(p), dtype=torch.uint8).view(STORED_DTYPES[p.dtype]).view(p.shape)
            for p in loc.parts]  # fmt: skip


def decode_stored(t: StoredTensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts of one stored tensor (views in their stored dtype and shape) -> its decoded slice [t.shape]:
    float32 for an encoded tensor, the stored tensor itself for a plain one."""
    return CODECS[t.codec].decode(parts, t.shape) if t.codec is not None else parts[0]


def apply_op(src: torch.Tensor, op: str) -> torch.Tensor:
    """A family op (models/families.py) applied to a decoded source slice: a view, no copy."""
    return _apply_op(src, op)


def _apply_op(src: torch.Tensor, op: str) -> torch.Tensor:
    if op == "copy":
        return src
    if op == "T":
        return src.t()
    if op in ("T_even", "T_odd"):
        return src.t()[0::2] if op == "T_even" else src.t()[1::2]
    if op in ("T_top", "T_bottom"):
        src = src.t()
        op = op[2:]
    if op in ("top", "bottom"):
        half = src.shape[0] // 2
        return src[:half] if op == "top" else src[half:]
    return src[0::2] if op == "even" else src[1::2]


class ExpertReader:
    def __init__(
        self,
        index: CheckpointIndex,
        sources: Mapping[str, ExpertSource],  # piece name -> where it is stored (the family's row)
        layout: ExpertLayout,
        prefixes: dict[int, str],  # MoE layer -> checkpoint name prefix of its block, e.g. "model.layers.3.mlp."
        num_experts: int,
        dtype: torch.dtype,
    ) -> None:
        self.index, self.layout, self.dtype = index, layout, dtype
        self.num_experts = num_experts
        self.plans: dict[ExpertKey, list[_Read]] = {}
        self._layouts: tuple[list[tuple[StoredTensor, ...]], dict[int, int]] | None = None  # stored_layouts()
        self.consumed: set[str] = set()
        for layer, prefix in prefixes.items():
            for e in range(num_experts):
                self.plans[ExpertKey(layer, e)] = self._plan(prefix, e, sources)
        # the bytes of the largest expert's reads (what a disk read of one expert spans: set_io, disk_io "auto")
        self.largest_expert_bytes = max((sum(r.nbytes for r in plan) for plan in self.plans.values()), default=0)
        staged = [r for plan in self.plans.values() for r in plan if not self._direct(r)]
        self.staging_bytes = max((r.staging for r in staged), default=0)  # buffer + decode workspace
        self._staging = torch.empty(max((r.nbytes for r in staged), default=0), dtype=torch.uint8)
        self._fds: dict[str, int] = {}
        self._dfds: dict[str, int | None] = {}  # file -> its O_DIRECT descriptor (None: buffered), with `io`
        self.io: DiskIO | None = None  # set_io: O_DIRECT and several reads in flight; None: one pread at a time
        self._header_end = _data_starts(index)  # file -> where its first tensor's bytes start
        self._headers: dict[str, bytes] = {}  # file -> digest of its header (bytes before any tensor's), first open
        self._lock = threading.Lock()
        self.bytes_read = 0

    def set_io(self, io: DiskIO) -> None:
        """Read through `io` from now on (formats/diskio.py); its bounce buffers join `staging_bytes`. Call it
        before building a source on this reader (sources copy `staging_bytes`)."""
        with self._lock:
            if self.io is not None:
                self.staging_bytes -= self.io.staging_bytes
                self.io.close()
            io.fit(max(self.largest_expert_bytes, 1))  # one expert
            self.io = io
            self.staging_bytes += io.staging_bytes

    def _plan(self, prefix: str, e: int, sources: Mapping[str, ExpertSource]) -> list[_Read]:
        groups: dict[str, list[tuple[str, ExpertSource]]] = {}
        for piece, src in sources.items():
            groups.setdefault(prefix + src.tensor.format(e=e), []).append((piece, src))
        reads = []
        pieces = self.layout.pieces
        for name, members in groups.items():
            loc = self.index[name]
            if loc.dtype not in TORCH_DTYPES and not loc.encoded:
                raise CheckpointError(
                    f"{loc.file}: expert tensor {name!r} has dtype {loc.dtype}; moetier reads F32, F16, BF16 "
                    "and the quantised formats its config.json's quantization_config declares"
                )
            ops = [(piece, self._op(piece, src.op)) for piece, src in members]
            shapes = {_expected_src_shape(op, pieces[piece][1]) for piece, op in ops}
            (want,) = shapes
            fused = members[0][1].fused
            full_want = (self.num_experts, *want) if fused else want
            stacked = fused and want and tuple(loc.shape) == (self.num_experts * want[0], *want[1:])
            if loc.shape != full_want and not (stacked and not loc.parts):  # [E * rows, ...]: the same bytes (DBRX)
                raise CheckpointError(
                    f"{loc.file}: expert tensor {name!r} has shape {list(loc.shape)}, expected {list(full_want)} "
                    "from config.json"
                )
            parts = tuple(self._part(p, e, fused) for p in loc.parts)
            nbytes = loc.nbytes // self.num_experts if fused else loc.nbytes
            offset = loc.offset + (e * nbytes if fused else 0)
            reads.append(_Read(loc, offset, nbytes, want, tuple(ops), parts))
            self.consumed.add(name)
        return reads

    def _part(self, p: TensorLocation, e: int, fused: bool) -> _Part:
        if not fused:
            return _Part(p, p.offset, p.nbytes, p.shape)
        if not p.shape or p.shape[0] != self.num_experts:
            raise CheckpointError(
                f"{p.file}: tensor {p.name!r} has shape {list(p.shape)}, expected a leading dimension of "
                f"{self.num_experts} experts"
            )
        nbytes = p.nbytes // self.num_experts
        return _Part(p, p.offset + e * nbytes, nbytes, p.shape[1:])

    def _op(self, piece: str, op: str) -> str:
        """The family's op for `piece`, transposed once more when the layout stores down rows."""
        if piece != "down" or not self.layout.down_rows:
            return op
        if op not in ("copy", "T"):
            raise CheckpointError(f"down rows cannot be read from a source with op {op!r}")
        return "T" if op == "copy" else "copy"

    def _direct(self, r: _Read) -> bool:
        return (
            not r.parts and len(r.pieces) == 1 and r.pieces[0][1] == "copy"
            and TORCH_DTYPES[r.loc.dtype] == self.dtype
        )  # fmt: skip

    def _fd(self, loc: TensorLocation) -> int:
        """Lock held: the open descriptor of loc's file (opened, and its header checked, when there is none)."""
        key = str(loc.file)
        fd = self._fds.get(key)
        if fd is None:
            fd = os.open(key, os.O_RDONLY)
            try:
                self._check_header(key, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fds[key] = fd
            if self.io is not None:
                self._dfds[key] = self.io.open_direct(fd, key)
        return fd

    def _check_header(self, file: str, fd: int) -> None:
        """The first open of `file` records a digest of its header (the bytes before any tensor's: the safetensors
        or GGUF header, at most HEADER_DIGEST_BYTES); a reopen (after a failed read) must find the same, else the
        file was replaced by another checkpoint whose offsets the index does not know."""
        n = min(self._header_end.get(file, 8), HEADER_DIGEST_BYTES)
        digest = hashlib.sha256(_pread_all(fd, n, 0, file)).digest()
        first = self._headers.setdefault(file, digest)
        if first != digest:
            raise CheckpointError(
                "replaced by a different file since the engine opened it (its header changed); "
                "restore the original or restart the engine on the new checkpoint"
            )

    def _drop_fd(self, loc: TensorLocation) -> None:
        """Lock held: forget loc's file descriptor after a failed read, so the next read reopens the path."""
        fd = self._fds.pop(str(loc.file), None)
        if fd is not None:
            os.close(fd)
        dfd = self._dfds.pop(str(loc.file), None)
        if dfd is not None:
            os.close(dfd)

    def _span(self, loc: TensorLocation, offset: int, dest: torch.Tensor) -> Span:
        """Lock held, `io` set: the span filling `dest` from loc's file at `offset` (its descriptors opened)."""
        fd = self._fd(loc)
        return Span.of(fd, self._dfds.get(str(loc.file)), offset, dest, str(loc.file))

    def _pread(self, loc: TensorLocation, offset: int, dest: torch.Tensor) -> None:
        """Lock held: fill `dest` from loc's file at `offset`; _ReadFailed (descriptor dropped) on any failure."""
        try:
            if self.io is None:
                self.bytes_read += pread_exact(self._fd(loc), [byte_view(dest)], offset, EOF)
                return
            span = self._span(loc, offset, dest)
            (err,) = self.io.read([span])
            if err is not None:
                raise err
            self.bytes_read += span.nbytes
        except (OSError, CheckpointError) as exc:
            raise self._lost(loc, exc) from exc

    def _lost(self, loc: TensorLocation, exc: BaseException) -> _ReadFailed:
        """Lock held: a failed read of loc's file as _ReadFailed (its cause set), the file's descriptors dropped."""
        self._drop_fd(loc)
        reason = _reason(exc)
        if reason == EOF:
            reason += " (the file is shorter than its header says: truncated?)"
        err = _ReadFailed(loc, reason)
        err.__cause__ = exc
        return err

    def _failed(self, key: ExpertKey, err: _ReadFailed) -> ExpertReadError:
        """The ExpertReadError of a failed read of expert `key` (its rows are the MoE block's to fill)."""
        return ExpertReadError(
            f"{err.loc.file}: cannot read expert {key.expert} of layer {key.layer} (tensor {err.loc.name!r}): "
            f"{err.reason}",
            key=key, path=str(err.loc.file),
        )  # fmt: skip

    def read_into(self, key: ExpertKey, pieces: dict[str, torch.Tensor]) -> int:
        """Fill a slot's pieces with expert `key`; returns bytes read from disk."""
        plan = self.plans.get(key)
        if plan is None:
            raise KeyError(f"no expert {key} in this checkpoint")
        if self.io is not None:
            return _one(self._batch([(key, None, pieces)]))
        before = self.bytes_read
        with self._lock:
            try:
                for r in plan:
                    self._fill(r, pieces)
            except _ReadFailed as err:
                raise self._failed(key, err) from err.__cause__
        return self.bytes_read - before

    def read_many(self, items: Sequence[tuple[ExpertKey, Mapping[str, torch.Tensor]]]) -> list[int | ExpertReadError]:
        """`read_into` of several experts, their reads in flight together (with `io`); per expert the bytes read or
        the ExpertReadError that stopped it (one failed expert never fails another)."""
        return self._batch([(key, None, pieces) for key, pieces in items])

    def read_stored_many(
        self, items: Sequence[tuple[ExpertKey, _Dests, Mapping[str, torch.Tensor]]]
    ) -> list[int | ExpertReadError]:
        """`read_stored` of several experts, as `read_many`."""
        return self._batch(items)

    def _batch(
        self, items: Sequence[tuple[ExpertKey, _Dests | None, Mapping[str, torch.Tensor]]]
    ) -> list[int | ExpertReadError]:
        """Experts read together: every byte range that lands as it is stored (a slot piece of the stored dtype, a
        raw stored part) of every expert goes to `io` in one call (`depth` in flight); the staged reads (casts,
        transposes, decodes) follow one at a time through the staging buffer. Without `io`, one after another."""
        for key, _, _ in items:
            if key not in self.plans:
                raise KeyError(f"no expert {key} in this checkpoint")
        if self.io is None:
            out: list[int | ExpertReadError] = []
            for key, dests, pieces in items:
                try:
                    out.append(self.read_stored(key, dests, pieces) if dests is not None
                               else self.read_into(key, dict(pieces)))  # fmt: skip
                except ExpertReadError as exc:
                    out.append(exc)
            return out
        with self._lock:
            failed: dict[int, _ReadFailed] = {}
            spans: list[Span] = []
            owners: list[tuple[int, TensorLocation]] = []
            staged: list[tuple[int, _Read]] = []
            done, direct = [0] * len(items), [0] * len(items)  # bytes staged (counted by _pread), direct
            for i, (key, dests, pieces) in enumerate(items):
                mine: list[tuple[Span, TensorLocation]] = []
                todo: list[_Read] = []
                r = self.plans[key][0]
                try:
                    for j, r in enumerate(self.plans[key]):
                        dest = dests[j] if dests is not None else None
                        if dest is not None:
                            at = [(p.loc, p.offset) for p in r.parts] if r.parts else [(r.loc, r.offset)]
                            for (loc, offset), view in zip(at, dest, strict=True):
                                mine.append((self._span(loc, offset, view), loc))
                        elif self._direct(r):
                            mine.append((self._span(r.loc, r.offset, pieces[r.pieces[0][0]]), r.loc))
                        else:
                            todo.append(r)
                except (OSError, CheckpointError) as exc:  # a file that cannot be (re)opened
                    failed[i] = self._lost(r.loc, exc)
                    continue
                spans += [sp for sp, _ in mine]
                owners += [(i, loc) for _, loc in mine]
                staged += [(i, r) for r in todo]
            for span, (i, loc), err in zip(spans, owners, self.io.read(spans), strict=True):
                if err is not None:
                    if i not in failed:
                        failed[i] = self._lost(loc, err)
                elif i not in failed:
                    direct[i] += span.nbytes
            for i, r in staged:
                if i in failed:
                    continue
                before = self.bytes_read
                try:
                    self._fill(r, items[i][2])
                except _ReadFailed as err:
                    failed[i] = err
                done[i] += self.bytes_read - before
            out = []
            for i, (key, _, _) in enumerate(items):
                if i in failed:
                    lost = self._failed(key, failed[i])
                    lost.__cause__ = failed[i].__cause__
                    out.append(lost)
                else:
                    self.bytes_read += direct[i]
                    out.append(direct[i] + done[i])
            return out

    def _fill(self, r: _Read, pieces: Mapping[str, torch.Tensor]) -> None:
        """One read into the slot pieces it feeds: straight from the file when it matches, else via staging."""
        if self._direct(r):
            self._pread(r.loc, r.offset, pieces[r.pieces[0][0]])
            return
        if r.parts:
            src = self._decode(r)
        else:
            raw = self._staging[: r.nbytes]
            self._pread(r.loc, r.offset, raw)
            src = raw.view(TORCH_DTYPES[r.loc.dtype]).view(r.src_shape)
        for piece, op in r.pieces:
            pieces[piece].copy_(_apply_op(src, op))

    def stored_layouts(self) -> tuple[list[tuple[StoredTensor, ...]], dict[int, int]]:
        """How the experts are stored, per MoE layer: (the distinct layouts, layer -> index of its layout). The
        experts of one layer must be stored alike (CheckpointError naming the tensor otherwise); layers may
        differ, as a Q4_K_M GGUF file's do (Q4_K down projections in some layers, Q6_K in others). Worked out once
        (the plans are fixed; start-up asks several times: precision auto, the executor, the source); the caller
        must not change what it gets."""
        if self._layouts is None:
            self._layouts = self._stored_layouts()
        return self._layouts

    def _stored_layouts(self) -> tuple[list[tuple[StoredTensor, ...]], dict[int, int]]:
        layouts: list[tuple[StoredTensor, ...]] = []
        of_layer: dict[int, int] = {}
        first: dict[int, tuple[StoredTensor, ...]] = {}
        for key, plan in self.plans.items():
            got = tuple(self._stored(r) for r in plan)
            want = first.setdefault(key.layer, got)
            if got != want:
                loc = next(r.loc for r, a, b in zip(plan, got, want, strict=True) if a != b)
                raise CheckpointError(
                    f"{loc.file}: expert tensor {loc.name!r} (layer {key.layer}, expert {key.expert}) is stored "
                    "unlike the layer's first expert; stored-form slots need a layer's experts stored alike"
                )
            if key.layer not in of_layer:
                if got not in layouts:
                    layouts.append(got)
                of_layer[key.layer] = layouts.index(got)
        return layouts, of_layer

    def _stored(self, r: _Read) -> StoredTensor:
        if r.parts:
            parts = tuple((STORED_DTYPES[p.loc.dtype], p.shape) for p in r.parts)
            return StoredTensor(r.loc.dtype, parts, r.src_shape, r.pieces)
        return StoredTensor(None, ((TORCH_DTYPES[r.loc.dtype], r.src_shape),), r.src_shape, r.pieces)

    def read_stored(
        self, key: ExpertKey, dests: Sequence[Sequence[torch.Tensor] | None], pieces: Mapping[str, torch.Tensor]
    ) -> int:
        """Expert `key` as stored: read i's parts are pread as raw bytes into `dests[i]` (uint8 views, one per
        part, of the `part_bytes` of read i's StoredTensor in `stored_layouts()`); a read whose dest is None is
        decoded into `pieces` as read_into does (e.g. biases kept in the compute dtype). Returns bytes read."""
        plan = self.plans.get(key)
        if plan is None:
            raise KeyError(f"no expert {key} in this checkpoint")
        if self.io is not None:
            return _one(self._batch([(key, dests, pieces)]))
        before = self.bytes_read
        with self._lock:
            try:
                for r, dest in zip(plan, dests, strict=True):
                    if dest is not None:
                        spans = [(p.loc, p.offset) for p in r.parts] if r.parts else [(r.loc, r.offset)]
                        for (loc, offset), view in zip(spans, dest, strict=True):
                            self._pread(loc, offset, view)
                        continue
                    self._fill(r, pieces)
            except _ReadFailed as err:
                raise self._failed(key, err) from err.__cause__
        return self.bytes_read - before

    def _decode(self, r: _Read) -> torch.Tensor:
        """Read the expert's slice of every part of an encoded tensor into staging; decode to fp32 [src_shape]."""
        views, at = [], 0
        for p in r.parts:
            raw = self._staging[at : at + p.nbytes]
            self._pread(p.loc, p.offset, raw)
            views.append(raw.view(STORED_DTYPES[p.loc.dtype]).view(p.shape))
            at += p.nbytes
        return CODECS[r.loc.dtype].decode(views, r.src_shape)

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        """Where expert `key` (its `piece`, else its first tensor) is stored: "file: tensor 'name'"."""
        plan = self.plans[key]
        r = next((r for r in plan if piece in dict(r.pieces)), plan[0])
        return f"{r.loc.file}: tensor {r.loc.name!r}"

    def close(self) -> None:
        with self._lock:
            for fd in (*self._fds.values(), *self._dfds.values()):
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._dfds.clear()
            if self.io is not None:
                self.io.close()


def _one(results: list[int | ExpertReadError]) -> int:
    """The bytes of a one-expert batch, or its error raised."""
    (got,) = results
    if isinstance(got, ExpertReadError):
        raise got
    return got


def _data_starts(index: CheckpointIndex) -> dict[str, int]:
    """file -> the smallest byte offset of any tensor (or stored part) in it: where its header ends."""
    starts: dict[str, int] = {}
    for name in index.names():
        loc = index[name]
        for piece in loc.parts or (loc,):
            file = str(piece.file)
            starts[file] = min(starts.get(file, piece.offset), piece.offset)
    return starts


def _pread_all(fd: int, n: int, offset: int, file: str) -> bytes:
    """n bytes of fd at offset (CheckpointError when the file is shorter)."""
    out = bytearray(n)
    pread_exact(fd, [memoryview(out)], offset, f"{file}: unexpected end of file reading its header")
    return bytes(out)


def read_tensor(loc: TensorLocation) -> torch.Tensor:
    """One whole tensor from its file by pread (no mmap): decoded float32 [shape] for an encoded tensor,
    else the stored tensor in its stored dtype. CheckpointError naming file and tensor if the file is short."""
    if loc.encoded:
        return CODECS[loc.dtype].decode([read_tensor(p) for p in loc.parts], loc.shape)
    dtype = STORED_DTYPES.get(loc.dtype)
    if dtype is None:
        raise CheckpointError(f"{loc.file}: tensor {loc.name!r} has dtype {loc.dtype}, which moetier cannot read")
    out = hostmem.empty((loc.nbytes,), torch.uint8)  # [nbytes]; a large one on transparent huge pages
    fd = os.open(loc.file, os.O_RDONLY)
    try:
        pread_exact(fd, [byte_view(out)], loc.offset, f"{loc.file}: unexpected end of file reading tensor {loc.name!r}")
    finally:
        os.close(fd)
    return out.view(dtype).view(loc.shape)  # [shape]
