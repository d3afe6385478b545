"""Disk tiers: where an expert at one precision is read from, and the pools that hold it.

A source fills one pool slot with one expert at its precision:
- `FullSource` reads the model's own checkpoint (formats/safetensors.py) into the canonical
  full-precision layout of formats/layout.py;
- `QuantSource` reads a quantized disk tier written by `moetier quantize`
  (formats/qtier.py) into a staging area of canonical tensors allocated once, then packs
  it into the slot's compute format (kernels/qformat.py);
- `StoredSource` reads the checkpoint's own stored bytes of an expert (FP8 + scales, MXFP4,
  GPTQ words ...) into a uint8 slot (kernels/stored.py StoredFormat; MixedStoredFormat where layers store
  their experts differently, slots of the largest layout), computed as stored or dequantised per call;
  its slots count stored bytes, and only the biases are decoded when read.

`FullSource` and `StoredSource` also have `read_many(items)`: several experts read together, their byte
ranges in flight at once (formats/diskio.py through the reader's `io`); per expert the bytes read or the
ExpertReadError that stopped it. The store's layer-call misses use it where a source has it.

`make_pool` builds the fixed-slot pool of a precision. Every source is thread-safe (one
lock), because the forward pass (demand loads) and the mover thread both read. The
`staging_bytes` of a source is transient memory that budgets must count.

A read that fails (EIO, a file truncated, replaced or removed under a running engine) raises
`ExpertReadError` naming the file and the expert (`as_read_error` turns any other OSError or
CheckpointError of a source into one); the stores count them in a `FaultLog` (Engine.health()).
`locate(key, piece)` says where an expert's bytes come from, for error messages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from moetier.errors import CheckpointError, ConfigError, ExpertReadError
from moetier.formats.codecs_quant import INT4_INTS
from moetier.formats.qtier import QuantTier, layer_file
from moetier.formats.quant import QuantSpec
from moetier.formats.quant_ggml import is_ggml
from moetier.formats.safetensors import ExpertReader, StoredTensor
from moetier.kernels import decode
from moetier.kernels.fp8 import Fp8Format, fill, fits_fp8
from moetier.kernels.qformat import ExpertFormat
from moetier.kernels.stored import MixedStoredFormat, StoredFormat, for_layer
from moetier.store.pool import QuantPool, SlotPool, StoredPool
from moetier.types import ExpertKey, Precision

Pool = SlotPool | QuantPool | StoredPool


class ExpertSource(Protocol):
    precision: Precision
    slot_bytes: int
    staging_bytes: int

    def read_into(self, key: ExpertKey, views: Any) -> int: ...

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> Pool: ...

    def locate(self, key: ExpertKey, piece: str | None = None) -> str: ...

    def close(self) -> None: ...


def as_read_error(key: ExpertKey, exc: BaseException) -> ExpertReadError | None:
    """A source's failed read of `key` as the ExpertReadError it raises (itself when it is one already); None for
    an error that is no read failure (a programming error, a KeyboardInterrupt): it propagates unchanged."""
    if isinstance(exc, ExpertReadError):
        return exc
    if not isinstance(exc, (OSError, CheckpointError)):
        return None
    path = getattr(exc, "filename", None)
    where = f"{path}: " if path else ""
    reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    return ExpertReadError(
        f"{where}cannot read expert {key.expert} of layer {key.layer}: {reason}", key=key,
        path=str(path) if path else None,
    )  # fmt: skip


class FaultLog:
    """Faults of one kind, thread-safe: how many, the last one's message and when (time.time(); `last_monotonic`
    for windows). A store keeps one of its failed expert reads (demand loads and background moves alike)."""

    def __init__(self) -> None:
        self.count = 0
        self.last: str | None = None
        self.last_time: float | None = None
        self.last_monotonic: float | None = None
        self._lock = threading.Lock()

    def record(self, exc: BaseException) -> None:
        with self._lock:
            self.count += 1
            self.last = str(exc)
            self.last_time, self.last_monotonic = time.time(), time.monotonic()

    def snapshot(self) -> tuple[int, str | None, float | None, float | None]:
        """(count, last message, its time.time(), its time.monotonic())."""
        with self._lock:
            return self.count, self.last, self.last_time, self.last_monotonic


class _FromReader:
    """A source whose experts come from one ExpertReader: it names their files and closes with it."""

    reader: ExpertReader

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        return self.reader.locate(key, piece)

    def close(self) -> None:
        self.reader.close()


class FullSource(_FromReader):
    """The checkpoint's own experts at the model dtype."""

    precision = Precision.FULL

    def __init__(self, reader: ExpertReader, dtype: torch.dtype) -> None:
        self.reader, self.dtype, self.layout = reader, dtype, reader.layout
        self.slot_bytes = reader.layout.slot_bytes(dtype.itemsize)
        self.staging_bytes = reader.staging_bytes

    def read_into(self, key: ExpertKey, views: Any) -> int:
        return self.reader.read_into(key, views.pieces)

    def read_many(self, items: Sequence[tuple[ExpertKey, Any]]) -> list[int | ExpertReadError]:
        return self.reader.read_many([(key, views.pieces) for key, views in items])

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> SlotPool:
        return SlotPool(self.layout, n_slots, self.dtype, device, pin=pin)


class QuantSource:
    """A quantized disk tier, packed into the compute format of `fmt` on the way in."""

    def __init__(self, tier: QuantTier, fmt: ExpertFormat) -> None:
        self.tier, self.fmt = tier, fmt
        self.precision = tier.spec.precision
        self.slot_bytes = fmt.slot_bytes
        # a ggml block tier in host slots: the tier's rows of blocks are the slot's, read straight into it
        self.direct = is_ggml(self.precision) and fmt.device.type == "cpu"
        # otherwise one expert's canonical tensors, allocated once; the mover and demand loads share it
        self._staging = {} if self.direct else {
            name: torch.empty(shape, dtype=dt) for name, (dt, shape) in tier.tensor_specs.items()
        }  # fmt: skip
        canonical = sum(t.numel() * t.element_size() for t in self._staging.values())
        bounce = tier.io.staging_bytes if tier.io is not None else 0  # formats/diskio.py's O_DIRECT buffers
        self.staging_bytes = canonical + fmt.pack_scratch_bytes + bounce
        self._lock = threading.Lock()

    def read_into(self, key: ExpertKey, views: Any) -> int:
        with self._lock:
            dest = self._staging
            if self.direct:
                dest = {"w13.q": views.w13.q, "w2.q": views.w2.q}
                dest |= {b: t for b in ("b13", "b2") if (t := getattr(views, b)) is not None}
            try:
                n = self.tier.read_into(key, dest)
            except (OSError, CheckpointError) as exc:  # the tier's own errors name the file, not the expert
                file = self.tier.path / layer_file(key.layer)
                reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
                raise ExpertReadError(
                    f"{file}: cannot read expert {key.expert} of layer {key.layer} ({self.precision.value} tier): "
                    f"{reason}",
                    key=key, path=str(file),
                ) from exc  # fmt: skip
            if not self.direct:
                self.fmt.pack_into(self._staging, views)
        return n

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> QuantPool:
        return QuantPool(self.fmt, n_slots, device, pin=pin)

    def locate(self, key: ExpertKey, piece: str | None = None) -> str:
        return f"{self.tier.path / layer_file(key.layer)}: expert {key.expert}"

    def close(self) -> None:
        self.tier.close()


_MATRIX_OF = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}  # piece -> (matrix, block of rows)


class StoredIntSource(_FromReader):
    """A GPTQ / AWQ / compressed-tensors int4 checkpoint's experts in our native int4 slots (precision "stored"
    with the native kernels loaded): each read takes the stored parts into a staging buffer allocated once, then
    writes their 4-bit values, integer zeros and own scales (fp16 or bf16, as stored: exact) into the slot, in the
    layout `kernels/qformat.py` ExpertFormat gives for n4 with those scales; no dequantisation. The budget counts
    the slot: 4 bits a weight plus a 16-bit scale and a 16-bit zero a group (GPTQ stores a 4-bit zero)."""

    precision = Precision.STORED

    @classmethod
    def fits(cls, reader: ExpertReader) -> tuple[tuple[StoredTensor, ...], int, torch.dtype] | None:
        """(stored tensors, group, scale dtype) when every expert's matrices are int4 codecs our kernels read as
        stored (INT4_INTS: no act-order groups, whole matrices, groups a multiple of 32 along K, one group size and
        one fp16 / bf16 scale dtype), none with biases; else None."""
        tensors = _one_layout(reader)
        if tensors is None:
            return None
        groups, dtypes = set(), set()
        for t in tensors:
            if t.codec not in INT4_INTS or len(t.pieces) != 1 or t.pieces[0][1] != "copy":
                return None
            if t.pieces[0][0] not in _MATRIX_OF or len(t.shape) != 2:
                return None
            sdt, sshape = t.parts[2] if not t.codec.startswith("ct_") else t.parts[1]
            ngroups = sshape[0] if not t.codec.startswith("ct_") else sshape[1]
            k = t.shape[1]
            if ngroups <= 0 or k % ngroups:
                return None
            groups.add(k // ngroups)
            dtypes.add(sdt)
        if len(groups) != 1 or len(dtypes) != 1:
            return None
        group, sdt = groups.pop(), dtypes.pop()
        if group % 32 or sdt not in (torch.float16, torch.bfloat16):
            return None
        if any(t.codec in ("gptq4", "gptq4_v2") for t in tensors) and reader.plans:
            # g_idx: act-order checkpoints permute every tensor's groups; the first expert tells (a later one that
            # differs is refused when read, naming its tensor)
            raw = [[torch.empty(n, dtype=torch.uint8) for n in t.part_bytes] for t in tensors]
            reader.read_stored(next(iter(reader.plans)), raw, {})
            for t, parts in zip(tensors, raw, strict=True):
                typed = [r.view(dt).view(shape) for r, (dt, shape) in zip(parts, t.parts, strict=True)]
                try:
                    INT4_INTS[str(t.codec)](typed)
                except ValueError:
                    return None
        return tensors, group, sdt

    def __init__(self, reader: ExpertReader, dtype: torch.dtype, device: torch.device,
                 fit: tuple[tuple[StoredTensor, ...], int, torch.dtype]) -> None:  # fmt: skip
        tensors, group, sdt = fit
        self.reader, self.tensors = reader, tensors
        self.fmt = ExpertFormat(reader.layout, QuantSpec(Precision.INT4, group), dtype, device, native=True,
                                scale_dtype=sdt)  # fmt: skip
        if set(self.fmt.kinds.values()) != {"n4"}:
            raise ConfigError(f"int4 experts of group {group} do not fit the native int4 slots ({self.fmt.kinds})")
        self.slot_bytes = self.fmt.slot_bytes
        # one expert's stored parts, read here and converted into the slot
        self._raw = [[torch.empty(n, dtype=torch.uint8) for n in t.part_bytes] for t in tensors]
        self._typed = [[r.view(dt).view(shape) for r, (dt, shape) in zip(raw, t.parts, strict=True)]
                       for raw, t in zip(self._raw, tensors, strict=True)]  # fmt: skip
        stored = sum(n for t in tensors for n in t.part_bytes)
        h, i = reader.layout.hidden, reader.layout.inter
        self.staging_bytes = stored + 3 * 4 * 2 * i * h  # the raw parts and one matrix's int32 temporaries
        self._lock = threading.Lock()

    def read_into(self, key: ExpertKey, views: Any) -> int:
        with self._lock:
            n = self.reader.read_stored(key, self._raw, {})
            for t, typed in zip(self.tensors, self._typed, strict=True):
                piece = t.pieces[0][0]
                matrix, block = _MATRIX_OF[piece]
                w = views.w13 if matrix == "w13" else views.w2
                try:
                    v, z, s = INT4_INTS[str(t.codec)](typed)  # [rows, K], [rows, G], [rows, G]
                except ValueError as exc:
                    raise CheckpointError(f"{self.reader.locate(key, piece)}: {exc}; run it with --precision "
                                          "full") from exc  # fmt: skip
                r0 = block * v.shape[0]
                rows = slice(r0, r0 + v.shape[0])
                w.q[rows].copy_(decode.pack_nibbles(v.to(torch.uint8)))
                w.scale[rows].copy_(s)
                w.zero[rows].copy_(z)
        return n

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> QuantPool:
        return QuantPool(self.fmt, n_slots, device, pin=pin)


class StoredFp8Source(_FromReader):
    """A block-scaled FP8 checkpoint's experts in FP8 slots (precision "stored" with the native kernels loaded):
    each read takes the stored e4m3fn bytes as they are and the scale grid widened to fp32, one grid row per weight
    row (kernels/fp8.py Fp8Format); no dequantisation. The budget counts the slot: a byte a weight plus 4 bytes
    per column block of a row."""

    precision = Precision.STORED

    @classmethod
    def fits(cls, reader: ExpertReader) -> tuple[tuple[StoredTensor, ...], int] | None:
        """(stored tensors, column block) when every expert matrix is one `fp8_block:{bn}x{bk}` tensor of the
        checkpoint (gate, up and down each as stored, no op), one bk for all, a whole number of blocks along K and
        bk a multiple of 32; no biases; else None."""
        tensors = _one_layout(reader)
        if tensors is None:
            return None
        bks = set()
        for t in tensors:
            codec = t.codec or ""
            if not codec.startswith("fp8_block:") or len(t.pieces) != 1 or t.pieces[0][1] != "copy":
                return None
            if t.pieces[0][0] not in _MATRIX_OF or len(t.shape) != 2 or len(t.parts) != 2:
                return None
            bks.add(_fp8_block(codec)[1])
        if len(bks) != 1:
            return None
        bk = bks.pop()
        h, i = reader.layout.hidden, reader.layout.inter
        if not (fits_fp8(2 * i, h, bk) and fits_fp8(h, i, bk)):
            return None
        return tensors, bk

    def __init__(self, reader: ExpertReader, fit: tuple[tuple[StoredTensor, ...], int]) -> None:
        tensors, bk = fit
        self.reader, self.tensors = reader, tensors
        self.fmt = Fp8Format(reader.layout, bk)
        self.slot_bytes = self.fmt.slot_bytes
        self._raw = [[torch.empty(n, dtype=torch.uint8) for n in t.part_bytes] for t in tensors]
        self._typed = [[r.view(dt).view(shape) for r, (dt, shape) in zip(raw, t.parts, strict=True)]
                       for raw, t in zip(self._raw, tensors, strict=True)]  # fmt: skip
        self._bn = [_fp8_block(str(t.codec))[0] for t in tensors]
        self.staging_bytes = sum(n for t in tensors for n in t.part_bytes)
        self._lock = threading.Lock()

    def read_into(self, key: ExpertKey, views: Any) -> int:
        with self._lock:
            n = self.reader.read_stored(key, self._raw, {})
            for t, (weight, grid), bn in zip(self.tensors, self._typed, self._bn, strict=True):
                matrix, block = _MATRIX_OF[t.pieces[0][0]]
                fill(views.w13 if matrix == "w13" else views.w2, block * weight.shape[0], weight, grid, bn)
        return n

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> QuantPool:
        return QuantPool(cast(Any, self.fmt), n_slots, device, pin=pin)


def _one_layout(reader: ExpertReader) -> tuple[StoredTensor, ...] | None:
    """The stored tensors of every expert when all layers store them alike (one layout), bias-free and without down
    rows: what the native stored sources take; else None."""
    if reader.layout.has_bias or reader.layout.down_rows:
        return None
    try:
        layouts, _ = reader.stored_layouts()
    except CheckpointError:
        return None
    return layouts[0] if len(layouts) == 1 and layouts[0] else None


def _fp8_block(codec: str) -> tuple[int, int]:
    """(bn, bk) of an `fp8_block:{bn}x{bk}` codec name."""
    bn, bk = codec.removeprefix("fp8_block:").split("x")
    return int(bn), int(bk)


class StoredSource(_FromReader):
    """The checkpoint's experts as stored (precision "stored"): raw parts into the slot, biases decoded."""

    precision = Precision.STORED

    def __init__(self, reader: ExpertReader, dtype: torch.dtype, native: bool = False) -> None:
        """`native`: the decode kernels are loaded; GGUF Q4_0 / Q8_0 matrices are re-laid out for them after each
        read (their quants and fp16 scales apart, the same bytes: StoredWeight.relay)."""
        self.reader, self.dtype = reader, dtype
        layouts, of_layer = reader.stored_layouts()  # one per layer group: a Q4_K_M file's layers differ
        self.fmt: StoredFormat | MixedStoredFormat = (
            StoredFormat(reader.layout, layouts[0] if layouts else (), dtype, native) if len(layouts) <= 1
            else MixedStoredFormat(reader.layout, layouts, of_layer, dtype, native)
        )  # fmt: skip
        self.slot_bytes = self.fmt.slot_bytes
        self.staging_bytes = reader.staging_bytes  # the biases' reads go through the reader's staging

    def read_into(self, key: ExpertKey, views: Any) -> int:
        v = for_layer(views, key.layer)
        n = self.reader.read_stored(key, v.dests, v.pieces)
        for w in (v.w13, v.w2):
            if w.relaid is not None:
                w.relay()
        return n

    def read_many(self, items: Sequence[tuple[ExpertKey, Any]]) -> list[int | ExpertReadError]:
        vs = [for_layer(views, key.layer) for key, views in items]
        got = self.reader.read_stored_many([(key, v.dests, v.pieces) for (key, _), v in zip(items, vs, strict=True)])
        for v, n in zip(vs, got, strict=True):
            if not isinstance(n, ExpertReadError):
                for w in (v.w13, v.w2):
                    if w.relaid is not None:
                        w.relay()
        return got

    def make_pool(self, n_slots: int, device: torch.device, pin: bool = False) -> StoredPool:
        # a mixed format's slots are StoredVariants: the consumers take a layer's variant (stored.for_layer)
        return StoredPool(cast(Any, self.fmt), n_slots, device, pin=pin)
