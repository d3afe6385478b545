"""GGUF files as an index of tensor locations: header, metadata, tensor infos, validation.

A GGUF file is a little-endian header (magic `GGUF`, version 2 or 3, tensor count, metadata
count), the metadata key/value pairs, one info per tensor (name, dims fastest-first, GGML type,
offset from the data section), then the data section, aligned to `general.alignment` (default
32). A model may be split into shards `NAME-00001-of-0000N.gguf`; the first holds the model
metadata, every shard says `split.no` / `split.count`.

This module reads only the header (buffered reads, never a memory map) and validates it once:
a truncated header, an unknown or unsupported tensor type, a row length that is not whole
blocks, an unaligned or overlapping tensor, a tensor overrunning its file, a missing or extra
shard each raise CheckpointError naming the file and the tensor. Tensor bytes are read later,
by byte range (os.pread), by whoever holds a TensorLocation.

Invariants: `GGUFTensor.shape` is numpy order (the reverse of GGUF's `ne`), which for a 2-D
weight is transformers' [out, in]; `offset` is absolute in its file; `nbytes` is exactly the
bytes of `shape` in `type_name` blocks. `GGUFIndex` is a CheckpointIndex over TensorLocations
named by whoever maps GGUF names to transformers names (models/gguf_config.py).
"""

from __future__ import annotations

import itertools
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from moetier.errors import CheckpointError
from moetier.formats.checkpoint import CheckpointIndex, TensorLocation
from moetier.formats.codecs_gguf import BLOCK_SIZES, unpermute_rows
from moetier.formats.location import read_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_MAX_STRING = 1 << 30  # no metadata string or name is longer; a larger length means corruption
_MAX_COUNT = 1 << 40
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_SCALARS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}  # fmt: skip
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # GGUF name, e.g. "blk.3.ffn_gate_exps.weight"
    file: Path
    type_name: str  # GGML type, a key of codecs_gguf.BLOCK_SIZES, e.g. "Q4_K"
    shape: tuple[int, ...]  # numpy order (GGUF ne reversed), e.g. (E, I, H) for ffn_gate_exps
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (shape[-1] weights); rows are whole blocks."""
        block, size = BLOCK_SIZES[self.type_name]
        return self.shape[-1] // block * size


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # key -> int | float | bool | str | list | numpy array (numeric arrays)
    tensors: dict[str, GGUFTensor]


class _Reader:
    """Buffered little-endian reads of a GGUF header; EOF -> CheckpointError naming the file and what was read."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.pos = 0

    def bytes(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(
                f"{self.path}: file ends at byte {self.size} while reading {what} (GGUF header): the file is truncated"
            )
        self.pos += n
        return data

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt, n = _SCALARS[vtype]
        return struct.unpack(fmt, self.bytes(n, what))[0]

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > min(_MAX_STRING, self.size):
            raise CheckpointError(f"{self.path}: {what} has length {n}: corrupt GGUF header")
        raw = self.bytes(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value_type(self, what: str) -> GGUFValueType:
        code = self.u32(what)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise CheckpointError(f"{self.path}: {what} has unknown value type {code}: corrupt GGUF header") from None

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            etype = self.value_type(what)
            count = self.u64(what)
            if count > _MAX_COUNT:
                raise CheckpointError(f"{self.path}: {what} claims {count} elements: corrupt GGUF header")
            if etype in _NUMPY:
                n = count * _SCALARS[etype][1]
                if n > self.size:
                    raise CheckpointError(f"{self.path}: {what} ({count} elements) is larger than the file")
                return np.frombuffer(self.bytes(n, what), dtype=_NUMPY[etype])
            return [self.value(etype, what) for _ in range(count)]
        return self.scalar(vtype, what)


def _type_name(path: Path, name: str, code: int) -> str:
    try:
        qtype = GGMLQuantizationType(code)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown GGML type {code}") from None
    if qtype.name not in BLOCK_SIZES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has GGML type {qtype.name}, which moetier cannot decode "
            f"(supported: {', '.join(BLOCK_SIZES)})"
        )
    return qtype.name


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate one GGUF file's header (metadata and tensor infos)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=1 << 20) as f:
            return _parse(_Reader(f, path, size))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc


def _parse(r: _Reader) -> GGUFFile:
    path = r.path
    if r.size < 24:
        raise CheckpointError(f"{path}: file is {r.size} bytes, too short to be a GGUF file")
    magic = r.bytes(4, "the magic")
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = r.u32("the version")
    if version not in (2, 3):
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        hint = " (a big-endian GGUF file, which moetier does not read)" if swapped in (2, 3) else ""
        raise CheckpointError(f"{path}: unsupported GGUF version {version}{hint}")
    n_tensors, n_kv = r.u64("the tensor count"), r.u64("the metadata count")
    if n_tensors > r.size or n_kv > r.size:
        raise CheckpointError(
            f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys: corrupt GGUF header"
        )
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        metadata[key] = r.value(r.value_type(f"metadata {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor name #{i}")
        n_dims = r.u32(f"tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to 4)")
        ne = [r.u64(f"tensor {name!r}") for _ in range(n_dims)]
        type_name = _type_name(path, name, r.u32(f"tensor {name!r}"))
        infos.append((name, ne, type_name, r.u64(f"tensor {name!r}")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment is {alignment}, not a power of two")
    data_start = -(-r.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, type_name, rel in infos:
        block, type_size = BLOCK_SIZES[type_name]
        if ne[0] % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} has rows of {ne[0]} weights, not whole {type_name} blocks of {block}"
            )
        if rel % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} starts at offset {rel}, not aligned to {alignment}")
        nbytes = prod(ne) // block * type_size
        begin = data_start + rel
        if begin + nbytes > r.size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {begin + nbytes} but the file has {r.size} bytes: "
                "the file is truncated"
            )
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the header")
        tensors[name] = GGUFTensor(name, path, type_name, tuple(reversed(ne)), begin, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: tensors {name_a!r} and {name_b!r} overlap: corrupt GGUF file")
    return GGUFFile(path, version, metadata, tensors)


def gguf_files(path: str | os.PathLike[str]) -> list[Path]:
    """The GGUF file(s) of a model: a .gguf file (any shard of a split model names all its shards) or a folder
    holding one model's file or its shards. Shards come back in order; a missing shard is an error."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if not found:
            raise CheckpointError(f"{p}: no *.gguf file in this folder")
        stems = {(m.group("stem"), m.group("count")) if (m := _SHARD.match(f.name)) else (f.stem, "") for f in found}
        if len(stems) > 1:
            names = ", ".join(f.name for f in found[:6])
            raise CheckpointError(f"{p}: holds more than one GGUF model ({names}); name the file to open")
        p = found[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file")
    m = _SHARD.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    shards = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{p}: split GGUF model of {count} shards lacks {', '.join(missing)}")
    return shards


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a GGUF model: a .gguf file, or a folder with *.gguf files and no config.json."""
    p = Path(path)
    if p.is_file() or p.suffix == ".gguf":
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def read_gguf_model(path: str | os.PathLike[str]) -> tuple[list[GGUFFile], dict[str, Any], dict[str, GGUFTensor]]:
    """All shards of a model: (files, the first shard's metadata, every tensor by GGUF name), the split
    metadata checked against the shards found."""
    files = [read_gguf(f) for f in gguf_files(path)]
    tensors: dict[str, GGUFTensor] = {}
    for i, g in enumerate(files):
        count = int(g.metadata.get("split.count", 1))
        no = int(g.metadata.get("split.no", 0))
        if count != len(files) or no != i:
            raise CheckpointError(
                f"{g.path}: metadata says shard {no + 1} of {count}, but it is file {i + 1} of {len(files)} found"
            )
        for name, t in g.tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file} and {g.path}")
            tensors[name] = t
    expected = files[0].metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(tensors):
        raise CheckpointError(
            f"{files[0].path}: metadata says {int(expected)} tensors over all shards, the shards hold {len(tensors)}"
        )
    return files, files[0].metadata, tensors


def location(
    t: GGUFTensor, name: str, shape: tuple[int, ...], *, expert: int | None = None, unpermute_heads: int | None = None
) -> TensorLocation:
    """A TensorLocation named `name` of logical `shape` (transformers' orientation) for tensor `t`, or for
    expert `expert` of a fused [E, ...] tensor (its contiguous byte range). F32 / F16 / BF16 come back as
    plain tensors (read as stored); other types, and q/k rows to un-permute (`unpermute_heads` heads), as
    encoded tensors of codec `gguf:<TYPE>[+unpermute]` with one uint8 part of the block bytes."""
    if expert is None:
        offset, nbytes, stored = t.offset, t.nbytes, t.shape
    else:
        nbytes = t.nbytes // t.shape[0]
        offset, stored = t.offset + expert * nbytes, t.shape[1:]
    if prod(stored) != prod(shape) or stored[-1] != shape[-1]:
        raise CheckpointError(
            f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, which cannot hold {name} of shape {list(shape)}"
        )
    if unpermute_heads is None and t.type_name in ("F32", "F16", "BF16"):
        return TensorLocation(name, t.file, offset, nbytes, t.type_name, shape)
    part_shape: tuple[int, ...] = (nbytes,)
    codec = f"gguf:{t.type_name}"
    if unpermute_heads is not None:
        rows = prod(stored[:-1])
        if rows % (2 * unpermute_heads):
            raise CheckpointError(
                f"{t.file}: tensor {t.name!r} has {rows} rows, not a whole number of {unpermute_heads} heads"
            )
        part_shape = (unpermute_heads, rows // unpermute_heads // 2, 2, nbytes // rows)
        codec += "+unpermute"
    part = TensorLocation(name + ":blocks", t.file, offset, nbytes, "U8", part_shape)
    return TensorLocation(name, t.file, offset, nbytes, codec, shape, (part,))


def read_blocks(loc: TensorLocation) -> tuple[str, torch.Tensor] | None:
    """A 2-D GGUF block tensor as stored, for the kernels that compute it so (kernels/ggml.py): (type name,
    uint8 [N, row bytes]) with its rows in transformers' order (a llama q/k permuted by llama.cpp's converter
    comes back un-permuted: rows are whole blocks); None for a location that is no such tensor (plain floats,
    an expert slice, another codec). Reads the bytes with pread (no memory map)."""
    codec = loc.dtype
    if not codec.startswith("gguf:") or len(loc.parts) != 1 or len(loc.shape) != 2:
        return None
    name, _, extra = codec.removeprefix("gguf:").partition("+")
    part = loc.parts[0]
    raw = torch.frombuffer(read_bytes(part), dtype=torch.uint8)
    n = loc.shape[0]
    if extra == "unpermute":
        raw = unpermute_rows(raw.view(part.shape))
    return name, raw.reshape(n, part.nbytes // n).contiguous()


class GGUFIndex(CheckpointIndex):
    """A CheckpointIndex over GGUF tensors renamed to transformers' checkpoint names. `folder` is the
    folder of the GGUF file(s); every location points into one of them. `converters`: transformers WeightConverters
    for names only this index uses (pieces llama.cpp stores apart that the family's checkpoint fuses), which the
    experts seam (models/seam.py) applies after the family's own rules."""

    def __init__(self, folder: Path, locations: Iterable[TensorLocation], converters: Iterable[Any] = ()) -> None:
        self.folder = folder  # no super(): nothing to scan
        self.converters = tuple(converters)
        self.quantization = None  # GGUF block types are per tensor (encoded locations), not a config section
        self.tensors: dict[str, TensorLocation] = {}
        for loc in locations:
            if loc.name in self.tensors:
                raise CheckpointError(f"{loc.file}: two GGUF tensors map to {loc.name!r}")
            self.tensors[loc.name] = loc
