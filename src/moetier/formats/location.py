"""Where one checkpoint tensor lives: file, byte range, dtype, shape, and (an encoded tensor) its stored parts.

Its own module so that formats/checkpoint.py (which indexes a folder into TensorLocations) and
formats/quantized.py (which rewrites quantised groups into encoded ones) can both use it without an import
cycle; formats/checkpoint.py re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
