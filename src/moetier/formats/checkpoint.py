"""The safetensors files of a checkpoint folder, as an index of tensor locations.

Reads only the headers (8-byte length + JSON). Every tensor gets its file, byte
offset, dtype and shape, so the store can read one expert by offset without mapping
the whole file. Validation happens here, once, at open: a header that does not parse,
a tensor whose byte range overruns the file (a truncated download), overlapping or
mis-sized ranges, an index that names a missing file or tensor: each raises
CheckpointError naming the file and tensor.

A quantised checkpoint (config.json's `quantization_config`, passed as `quantization`) is
indexed by logical tensor: formats/quantized.py replaces each group of stored tensors (an FP8
weight and its scale grid, MXFP4 blocks and scales, GPTQ's qweight / qzeros / scales / g_idx)
by one encoded TensorLocation (formats/encoded.py) after validating it. `tensors` then holds
logical names only; the stored tensors are reachable through `parts`.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import Any

from moetier.errors import CheckpointError
from moetier.formats.location import TensorLocation as TensorLocation  # re-exported: where it is indexed
from moetier.formats.quantized import apply_quantization

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse and validate one safetensors file's header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{path}: header length {header_len} exceeds the file ({size} bytes): corrupt or truncated"
                )
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}): corrupt safetensors file") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object: corrupt safetensors file")
    data_start = 8 + header_len
    out: dict[str, TensorLocation] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(begin, int) and isinstance(end, int)):
                raise TypeError("dtype must be a string and data_offsets two integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r} ({exc})") from exc
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        expected = prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expected or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but shape {list(shape)} of {dtype} needs {expected}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes: "
                "the file is truncated"
            )
        out[name] = TensorLocation(name, path, data_start + begin, end - begin, dtype, shape)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: tensors {name_a!r} and {name_b!r} overlap: corrupt safetensors file")
    return out


class CheckpointIndex:
    """All tensors of a checkpoint folder: `index[name] -> TensorLocation`; with `quantization` (config.json's
    quantization_config), quantised groups are indexed as logical encoded tensors."""

    def __init__(self, folder: str | os.PathLike[str], quantization: Mapping[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a directory (expected a Hugging Face checkpoint folder)")
        index_file = self.folder / "model.safetensors.index.json"
        self.tensors: dict[str, TensorLocation] = {}
        self.set_aside: list[str] = []  # tensors present but not the model's (a composite's vision tower: open.py)
        if index_file.exists():
            self._load_indexed(index_file)
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder}: no *.safetensors files and no model.safetensors.index.json")
            for file in files:
                self._add_file(file)
        self.quantization = dict(quantization) if quantization else None
        if self.quantization is not None:
            self.tensors = apply_quantization(self.tensors, self.quantization, self.folder)

    def _load_indexed(self, index_file: Path) -> None:
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_file}: not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_file}: weight_map must map tensor names to shard file names")
        for file_name in sorted(set(weight_map.values())):
            file = self.folder / file_name
            if not file.exists():
                raise CheckpointError(f"{index_file}: names shard {file_name!r}, which is missing from {self.folder}")
            self._add_file(file)
        for name, file_name in weight_map.items():
            loc = self.tensors.get(name)
            if loc is None or loc.file.name != file_name:
                raise CheckpointError(f"{index_file}: tensor {name!r} is mapped to {file_name!r} but is not in it")

    def _add_file(self, file: Path) -> None:
        for name, loc in read_header(file).items():
            if name in self.tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].file} and {file}")
            self.tensors[name] = loc

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorLocation:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint") from None

    def names(self) -> list[str]:
        return list(self.tensors)
