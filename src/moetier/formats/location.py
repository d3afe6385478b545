"""Where one checkpoint tensor lives: file, byte range, dtype, shape, and (an encoded tensor) its stored parts.

Its own module so that formats/checkpoint.py (which indexes a folder into TensorLocations) and
formats/quantized.py (which rewrites quantised groups into encoded ones) can both use it without an import
cycle; formats/checkpoint.py re-exports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moetier.errors import CheckpointError


@dataclass(frozen=True)
class TensorLocation:
    name: str
    file: Path
    offset: int  # absolute byte offset of the tensor's data in `file`
    nbytes: int
    dtype: str  # safetensors dtype string, e.g. "BF16"; for an encoded tensor its codec name (formats/encoded.py)
    shape: tuple[int, ...]  # for an encoded tensor, the logical (decoded) shape
    parts: tuple[TensorLocation, ...] = ()  # an encoded tensor: the stored tensors it decodes from, in codec order

    @property
    def encoded(self) -> bool:
        return bool(self.parts)


def read_bytes(loc: TensorLocation) -> bytearray:
    """The bytes of one stored tensor (`loc.nbytes` at `loc.offset` of `loc.file`), read with pread (no memory
    map); CheckpointError naming the file and tensor on a failed or short read."""
    buf = bytearray(loc.nbytes)
    try:
        fd = os.open(loc.file, os.O_RDONLY)
        try:
            got = os.preadv(fd, [buf], loc.offset)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"{loc.file}: cannot read tensor {loc.name!r}: {exc}") from exc
    if got != loc.nbytes:
        raise CheckpointError(f"{loc.file}: tensor {loc.name!r} is truncated ({got} of {loc.nbytes} bytes)")
    return buf
