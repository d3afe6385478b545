"""Reads one expert from the safetensors files straight into a pool slot.

Each expert's pieces are located once at open (file, byte offset, dtype, shape) and
validated against the config: a missing, mis-shaped or wrongly typed expert tensor
raises CheckpointError naming it. A read is `os.preadv` into the slot's own memory
when the stored dtype and layout already match the slot; otherwise it goes through
one staging buffer allocated at start (dtype cast, transpose, de-interleave). No
file is mapped into the process, so reading never leaves a whole file resident.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError
from moetier.formats.checkpoint import CheckpointIndex, TensorLocation
from moetier.formats.layout import ExpertLayout, ExpertSource
from moetier.types import ExpertKey

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def byte_view(t: torch.Tensor) -> memoryview:
    """The flat bytes of a CPU tensor's own memory (any shape), for os.preadv to fill."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy().data)


def pread_exact(fd: int, views: list[memoryview], offset: int, eof_message: str) -> int:
    """Fill `views` from `fd` at `offset`, resuming short reads; CheckpointError(eof_message) at EOF."""
    done, total = 0, sum(len(v) for v in views)
    while done < total:
        n = os.preadv(fd, _after(views, done), offset + done)
        if n <= 0:
            raise CheckpointError(eof_message)
        done += n
    return done


def _after(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers of `views` after their first `n` bytes (to resume a short read)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


@dataclass(frozen=True)
class _Read:
    """One contiguous byte range of the checkpoint feeding one or more pieces."""

    loc: TensorLocation
    offset: int  # absolute file offset
    nbytes: int
    src_shape: tuple[int, ...]  # shape of this expert's slice as stored
    pieces: tuple[tuple[str, str], ...]  # (piece, op)


def _expected_src_shape(op: str, dest: tuple[int, ...]) -> tuple[int, ...]:
    return {
        "copy": dest,
        "T": tuple(reversed(dest)),
        "T_even": (dest[-1], 2 * dest[0]),
        "T_odd": (dest[-1], 2 * dest[0]),
        "even": (2 * dest[0],),
        "odd": (2 * dest[0],),
    }[op]


def _apply_op(src: torch.Tensor, op: str) -> torch.Tensor:
    if op == "copy":
        return src
    if op == "T":
        return src.t()
    if op in ("T_even", "T_odd"):
        return src.t()[0::2] if op == "T_even" else src.t()[1::2]
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
        self.consumed: set[str] = set()
        for layer, prefix in prefixes.items():
            for e in range(num_experts):
                self.plans[ExpertKey(layer, e)] = self._plan(prefix, e, sources)
        staging = [r.nbytes for plan in self.plans.values() for r in plan if not self._direct(r)]
        self.staging_bytes = max(staging, default=0)
        self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _plan(self, prefix: str, e: int, sources: Mapping[str, ExpertSource]) -> list[_Read]:
        groups: dict[str, list[tuple[str, ExpertSource]]] = {}
        for piece, src in sources.items():
            groups.setdefault(prefix + src.tensor.format(e=e), []).append((piece, src))
        reads = []
        pieces = self.layout.pieces
        for name, members in groups.items():
            loc = self.index[name]
            if loc.dtype not in TORCH_DTYPES:
                raise CheckpointError(
                    f"{loc.file}: expert tensor {name!r} has dtype {loc.dtype}; moetier reads F32, F16, BF16 "
                    "(quantized checkpoints such as MXFP4 must be dequantized to bf16 first)"
                )
            ops = [(piece, self._op(piece, src.op)) for piece, src in members]
            shapes = {_expected_src_shape(op, pieces[piece][1]) for piece, op in ops}
            (want,) = shapes
            fused = members[0][1].fused
            full_want = (self.num_experts, *want) if fused else want
            if loc.shape != full_want:
                raise CheckpointError(
                    f"{loc.file}: expert tensor {name!r} has shape {list(loc.shape)}, expected {list(full_want)} "
                    "from config.json"
                )
            nbytes = loc.nbytes // self.num_experts if fused else loc.nbytes
            offset = loc.offset + (e * nbytes if fused else 0)
            reads.append(_Read(loc, offset, nbytes, want, tuple(ops)))
            self.consumed.add(name)
        return reads

    def _op(self, piece: str, op: str) -> str:
        """The family's op for `piece`, transposed once more when the layout stores down rows."""
        if piece != "down" or not self.layout.down_rows:
            return op
        if op not in ("copy", "T"):
            raise CheckpointError(f"down rows cannot be read from a source with op {op!r}")
        return "T" if op == "copy" else "copy"

    def _direct(self, r: _Read) -> bool:
        return (
            len(r.pieces) == 1 and r.pieces[0][1] == "copy" and TORCH_DTYPES[r.loc.dtype] == self.dtype
        )

    def _fd(self, loc: TensorLocation) -> int:
        key = str(loc.file)
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = os.open(key, os.O_RDONLY)
        return fd

    def _pread(self, loc: TensorLocation, offset: int, dest: torch.Tensor) -> None:
        what = f"{loc.file}: unexpected end of file reading tensor {loc.name!r}"
        self.bytes_read += pread_exact(self._fd(loc), [byte_view(dest)], offset, what)

    def read_into(self, key: ExpertKey, pieces: dict[str, torch.Tensor]) -> int:
        """Fill a slot's pieces with expert `key`; returns bytes read from disk."""
        plan = self.plans.get(key)
        if plan is None:
            raise KeyError(f"no expert {key} in this checkpoint")
        before = self.bytes_read
        with self._lock:
            for r in plan:
                if self._direct(r):
                    self._pread(r.loc, r.offset, pieces[r.pieces[0][0]])
                    continue
                raw = self._staging[: r.nbytes]
                self._pread(r.loc, r.offset, raw)
                src = raw.view(TORCH_DTYPES[r.loc.dtype]).view(r.src_shape)
                for piece, op in r.pieces:
                    pieces[piece].copy_(_apply_op(src, op))
        return self.bytes_read - before

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
