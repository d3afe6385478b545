"""Reads a quantized disk tier written by `moetier quantize` (formats/quantize.py).

A tier is a directory `<model>/moetier-quant/<precision>-g<group>/` (or under another
root) holding `manifest.json` and one safetensors file per MoE layer,
`layer-<L:03d>.safetensors`, with tensors `<expert>.<canonical name>` (e.g. `7.w13.q`),
the canonical quantized tensors of formats/quant.py. One expert's tensors are contiguous
in the file, in `expert_tensor_specs` order, so reading an expert is one `os.preadv`.

Invariants:
- `QuantTier.open` refuses (CheckpointError naming the file, tensor or source change,
  and the command that fixes it) a tier that is missing, incomplete, written for another
  source (the source record), layout, expert count or layer list, or whose files differ from
  the manifest (size, sha256 with `verify=True`, header dtypes and shapes);
- `read_into` writes only into the caller's tensors, never allocates on the weight path
  (biases of another float dtype go through one staging buffer), and is thread-safe. With `set_io` it reads
  through formats/diskio.py (O_DIRECT, the expert's bytes as requests in flight together).

The source record (`source_record`, written by `moetier quantize`) holds config.json's sha256 and, per
checkpoint file, its size, mtime_ns, header sha256 and a blake2b of its whole content, hashed once at
quantize time. `check_source` accepts a file without reading it when its size and mtime_ns are the
recorded ones and the record is not racy (the file's mtime was at least `RACY_NS` older than the moment
hashing began, so a write in the same timestamp tick cannot hide); otherwise it re-hashes the whole
file: a different hash is a stale tier, the same hash (a copy, a touch) is accepted silently and the
manifest's record is refreshed (`QuantTier.open`, best effort) so the next open is cheap again. A tier
whose manifest holds the older sampled print (no `version` 2 source record) is refused as stale with
the command that rewrites it: a sample cannot prove the tier matches the weights.

`source_fingerprint` is the older cheap print (config.json bytes, per file its size, header bytes and a
sample of its data: all of it when under 1 MiB, else 16 evenly spaced 64 KiB blocks). It still
identifies a checkpoint for sparsity tables and reference logits, which only need to tell models
apart; it is no longer what a quantized tier trusts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

import torch

from moetier.errors import CheckpointError
from moetier.formats.checkpoint import CheckpointIndex, TensorLocation, read_header
from moetier.formats.diskio import DiskIO, Span, pread_exact
from moetier.formats.layout import ExpertLayout
from moetier.formats.quant import DEFAULT_GROUP, QuantSpec, expert_tensor_specs, resolve_group
from moetier.formats.safetensors import ExpertReader, byte_view
from moetier.types import ExpertKey, Precision

log = logging.getLogger(__name__)

FORMAT = "moetier-quant"
FORMAT_VERSION = 1
TIER_ROOT = "moetier-quant"
MANIFEST = "manifest.json"
ST_DTYPES = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SAMPLE_FULL = 1 << 20  # data regions up to this size are hashed whole
_SAMPLE_BLOCK, _SAMPLE_COUNT = 64 << 10, 16
_GGUF_HEAD = 1 << 20  # bytes of a GGUF file's head hashed as its header
_BIASES = ("b13", "b2")
SOURCE_VERSION = 2  # the source record's version; older manifests hold the sampled print
RACY_NS = 2_000_000_000  # a file modified this close to its hashing is re-hashed at the next check
LEGACY_SOURCE = (
    "the tier was written by an older moetier whose source fingerprint sampled about 3% of the checkpoint, "
    "which cannot show the tier still matches it"
)

TensorSpecs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def group_label(spec: QuantSpec) -> str:
    """`128` for an explicit or default group of 128; `K` for the per-channel default (int8); `ggml` for a ggml
    block precision (its blocks are its groups)."""
    if spec.ggml:
        return "ggml"
    group = spec.group_size if spec.group_size is not None else DEFAULT_GROUP.get(spec.precision)
    return "K" if group is None else str(group)


def default_root(model_dir: str | os.PathLike[str]) -> Path:
    """MODEL/moetier-quant; for a GGUF file MODEL, <its folder>/<its stem>-moetier-quant."""
    model = Path(model_dir)
    return model.parent / f"{model.stem}-{TIER_ROOT}" if model.is_file() else model / TIER_ROOT


def tier_dir(
    model_dir: str | os.PathLike[str], spec: QuantSpec, root: str | os.PathLike[str] | None = None,
    down_rows: bool = False,
) -> Path:  # fmt: skip
    """`default_root(MODEL)`/<precision>-g<group>, with a `-rows` suffix for the layout sparse execution
    needs (down projection stored as rows [I, H], quantised along H). A ggml block precision: `<precision>`."""
    base = Path(root) if root is not None else default_root(model_dir)
    if spec.ggml:
        return base / f"{spec.precision.value}{'-rows' if down_rows else ''}"
    return base / f"{spec.precision.value}-g{group_label(spec)}{'-rows' if down_rows else ''}"


def layer_file(layer: int) -> str:
    return f"layer-{layer:03d}.safetensors"


def quantize_command(
    model_dir: str | os.PathLike[str], spec: QuantSpec, root: str | os.PathLike[str] | None, down_rows: bool = False
) -> str:
    cmd = f"moetier quantize {model_dir} --precisions {spec.precision.value}"
    if down_rows:
        cmd += " --for-sparsity"
    if spec.group_size is not None and spec.group_size != DEFAULT_GROUP.get(spec.precision):
        cmd += f" --group {spec.precision.value}={spec.group_size}"
    return cmd + (f" --out {root}" if root is not None else "")


def resolved_groups(layout: ExpertLayout, spec: QuantSpec) -> dict[str, int]:
    """The group size each matrix is quantised with: w13 [2I, H] groups along H, w2 [H, I] along I
    (down rows [I, H]: along H)."""
    h, i = layout.hidden, layout.inter
    w2 = resolve_group(spec, h, shape=(i, h)) if layout.down_rows else resolve_group(spec, i, shape=(h, i))
    return {"w13": resolve_group(spec, h, shape=(2 * i, h)), "w2": w2}


# -- source fingerprint ----------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _file_print(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if path.suffix == ".gguf":  # metadata and tensor infos lead the file; the sample covers all of it
            header, start = f.read(min(size, _GGUF_HEAD)), 0
        else:
            (hlen,) = struct.unpack("<Q", f.read(8))  # the header was validated by CheckpointIndex
            header, start = f.read(hlen), 8 + hlen
        data = size - start
        sample = hashlib.sha256()
        if data <= _SAMPLE_FULL:
            sample.update(f.read(data))
        else:
            step = (data - _SAMPLE_BLOCK) // (_SAMPLE_COUNT - 1)
            for i in range(_SAMPLE_COUNT):
                f.seek(start + i * step)
                sample.update(f.read(_SAMPLE_BLOCK))
    return {"size": size, "header_sha256": hashlib.sha256(header).hexdigest(), "sample_sha256": sample.hexdigest()}


def source_fingerprint(index: CheckpointIndex) -> dict[str, Any]:
    """{fingerprint, config_sha256, files: {name: {size, header_sha256, sample_sha256}}} of a checkpoint."""
    folder = index.folder
    files = sorted({loc.file for loc in index.tensors.values()})
    config = folder / "config.json"  # a GGUF model has none: its metadata is in the file's header print
    out: dict[str, Any] = {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
        "files": {str(f.relative_to(folder)): _file_print(f) for f in files},
    }
    out["fingerprint"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    return out


def source_mismatch(recorded: dict[str, Any], current: dict[str, Any], folder: Path | None = None) -> str | None:
    """What changed in the source since `recorded` was taken, in words; None if nothing. Both records come from
    `source_record` (a `recorded` print of an older moetier is reported as such); `folder` prefixes file names."""
    if recorded.get("version") != SOURCE_VERSION:
        return LEGACY_SOURCE
    if recorded.get("fingerprint") == current["fingerprint"]:
        return None
    if recorded.get("config_sha256") != current["config_sha256"]:
        return "config.json changed"
    old, new = recorded.get("files") or {}, current["files"]
    if set(old) != set(new):
        gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        return f"the checkpoint files changed (gone: {gone or 'none'}, new: {added or 'none'})"
    for name, now in new.items():
        for field, what in (("size", "size"), ("header_sha256", "tensor header"), ("blake2b", "data")):
            if old[name].get(field) != now[field]:
                return f"{folder / name if folder is not None else name} changed ({what} differs)"
    return "the source fingerprint differs"


def _content_hash(path: Path) -> str:
    """blake2b (32-byte digest) of the whole file, streamed in 4 MiB reads."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's JSON header (a GGUF file: its first MiB, metadata and tensor infos)."""
    with open(path, "rb") as f:
        if path.suffix == ".gguf":
            return hashlib.sha256(f.read(_GGUF_HEAD)).hexdigest()
        (hlen,) = struct.unpack("<Q", f.read(8))  # the header was validated by CheckpointIndex
        return hashlib.sha256(f.read(hlen)).hexdigest()


def _source_files(index: CheckpointIndex) -> list[Path]:
    """Every file a tensor of the index (or a stored part of an encoded one) lives in."""
    return sorted({part.file for loc in index.tensors.values() for part in (loc, *loc.parts)})


def source_record(index: CheckpointIndex, known: dict[str, Any] | None = None) -> dict[str, Any]:
    """{version, fingerprint, config_sha256, files: {name: {size, mtime_ns, hashed_ns, header_sha256, blake2b}}}
    of a checkpoint (see the module docstring). `known`: an earlier record whose hashes are reused, unread, for
    files whose size and mtime_ns are unchanged and which were not modified within RACY_NS of being hashed;
    every other file is read whole. `fingerprint` depends on the contents only (not on mtimes)."""
    # 1. config.json (small: always hashed; a GGUF model has none, its metadata is in the file's header)
    folder = index.folder
    config = folder / "config.json"
    config_sha = hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None
    # 2. per file: reuse the known entry when the cheap test passes, else stat, then hash the whole file
    old = (known or {}).get("files") if (known or {}).get("version") == SOURCE_VERSION else None
    files: dict[str, dict[str, Any]] = {}
    for path in _source_files(index):
        name = str(path.relative_to(folder))
        st = path.stat()
        prev = (old or {}).get(name)
        if isinstance(prev, dict) and _unchanged(prev, st.st_size, st.st_mtime_ns):
            files[name] = dict(prev)
            continue
        if prev is not None:
            log.info("%s: size or mtime moved since it was hashed (or too recently to trust); re-hashing it", path)
        begun = time.time_ns()  # before the read: a later write gets an mtime at or after this
        files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "hashed_ns": begun,
                       "header_sha256": _header_sha256(path), "blake2b": _content_hash(path)}  # fmt: skip
    # 3. the fingerprint: contents only
    contents = {"config_sha256": config_sha, "files": {n: [f["size"], f["blake2b"]] for n, f in files.items()}}
    fingerprint = hashlib.sha256(json.dumps(contents, sort_keys=True).encode()).hexdigest()
    return {"version": SOURCE_VERSION, "fingerprint": fingerprint, "config_sha256": config_sha, "files": files}


def _unchanged(prev: dict[str, Any], size: int, mtime_ns: int) -> bool:
    """The cheap test: same size and mtime, and the mtime safely older than the hash (not racy)."""
    try:
        return (prev["size"] == size and prev["mtime_ns"] == mtime_ns and isinstance(prev["blake2b"], str)
                and isinstance(prev["header_sha256"], str) and mtime_ns < int(prev["hashed_ns"]) - RACY_NS)  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return False


def check_source(recorded: dict[str, Any], index: CheckpointIndex) -> tuple[str | None, dict[str, Any]]:
    """(what changed, in words, or None; the current record) of the checkpoint against a tier's recorded source.
    Reads only files whose size or mtime moved (or whose record is racy); a print of an older moetier is stale
    at once (the current record is then empty)."""
    if recorded.get("version") != SOURCE_VERSION:
        return LEGACY_SOURCE, {}
    current = source_record(index, known=recorded)
    return source_mismatch(recorded, current, index.folder), current


def save_manifest(path: Path, manifest: dict[str, Any], tmp_name: str = MANIFEST + ".tmp") -> None:
    """Write `path`/manifest.json atomically: `tmp_name` in the same directory, fsynced, renamed, directory fsynced."""
    tmp = path / tmp_name
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable quantized-tier manifest ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if data.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: manifest version {data.get('version')!r}, this moetier reads {FORMAT_VERSION}")
    bad = _bad_fields(data, _FIELDS) or next(
        (f"layers[{i}]: {b}" for i, r in enumerate(data["layers"]) if (b := _bad_fields(r, _LAYER_FIELDS))), None
    )
    if bad or data["dtype"] not in DTYPE_NAMES.values():
        raise CheckpointError(f"{path}: malformed manifest ({bad or 'dtype ' + repr(data['dtype'])})")
    return data


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "precision": str, "bits": int, "group": str, "group_sizes": dict, "method": str, "dtype": str, "layout": dict,
    "num_experts": int, "moe_layers": list, "source": dict, "complete": bool, "layers": list,
}  # fmt: skip
_LAYER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "layer": int, "file": str, "bytes": int, "sha256": str, "sq_err": dict, "sq_ref": dict, "error": dict
}  # fmt: skip


def _bad_fields(obj: Any, fields: dict[str, type | tuple[type, ...]]) -> str | None:
    if not isinstance(obj, dict):
        return f"expected an object, got {type(obj).__name__}"
    for key, kind in fields.items():
        if not isinstance(obj.get(key), kind):
            return f"{key!r} is {obj.get(key)!r}"
    return None


@dataclass(frozen=True)
class SourceShape:
    """What the tier must match in the current model: canonical layout, experts per layer, MoE layers."""

    layout: ExpertLayout
    num_experts: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of(cls, reader: ExpertReader) -> SourceShape:
        return cls(reader.layout, reader.num_experts, tuple(sorted({k.layer for k in reader.plans})))


class QuantTier:
    """One quantized disk tier of one model, validated at open; `read_into` fills canonical tensors."""

    def __init__(self, path: Path, manifest: dict[str, Any], spec: QuantSpec, shape: SourceShape) -> None:
        self.path, self.manifest, self.spec = path, manifest, spec
        self.layout, self.num_experts, self.moe_layers = shape.layout, shape.num_experts, shape.moe_layers
        self.dtype: torch.dtype = {v: k for k, v in DTYPE_NAMES.items()}[manifest["dtype"]]
        self.group_sizes: dict[str, int] = dict(manifest["group_sizes"])
        self.tensor_specs: TensorSpecs = expert_tensor_specs(self.layout, spec, self.dtype)
        self.expert_bytes = sum(dt.itemsize * prod(s) for dt, s in self.tensor_specs.values())
        self._offsets: dict[int, tuple[Path, int]] = {}  # layer -> (file, byte offset of expert 0)
        self._fds: dict[int, int] = {}
        self._dfds: dict[int, int | None] = {}  # layer -> O_DIRECT descriptor (None: buffered), with `io`
        self.io: DiskIO | None = None  # set_io: reads through formats/diskio.py
        self._lock = threading.Lock()
        staging = [prod(s) * dt.itemsize for n, (dt, s) in self.tensor_specs.items() if n in _BIASES]
        self._staging = torch.empty(sum(staging), dtype=torch.uint8)  # biases read into dest of another dtype
        self.bytes_read = 0

    @classmethod
    def open(
        cls, model_dir: str | os.PathLike[str], precision: Precision | str, group_size: int | None = None,
        root: str | os.PathLike[str] | None = None, *, reader: ExpertReader, verify: bool = True,
    ) -> QuantTier:  # fmt: skip
        """Find and validate the tier against the model's ExpertReader (its index and shape; the caller opened
        the checkpoint, see models.open.open_quant_tier).
        `verify`: also sha256 every layer file (a full read of the tier); sizes and headers are always checked."""
        spec = QuantSpec(Precision(precision), group_size)
        rows = reader.layout.down_rows
        path = tier_dir(model_dir, spec, root, rows)
        fix = quantize_command(model_dir, spec, root, rows)
        if not (path / MANIFEST).exists():
            raise CheckpointError(f"{path}: no {spec.precision.value} quantized tier for {model_dir}; run `{fix}`")
        # 1. the manifest; 2. the source (cheap unless a file's size or mtime moved)
        raw = (path / MANIFEST).read_bytes()
        manifest = load_manifest(path / MANIFEST)
        source, index = SourceShape.of(reader), reader.index
        changed, current = check_source(manifest["source"], index)
        if changed == LEGACY_SOURCE:
            raise CheckpointError(f"{path}: {changed}; rewrite it with `{fix} --force`")
        if changed:
            raise CheckpointError(
                f"{path}: the tier was written from another version of {model_dir}: {changed}; "
                f"rewrite it with `{fix} --force`"
            )
        # 3. the tier against the model and its own manifest; 4. a moved mtime whose content matched is recorded
        tier = cls(path, manifest, spec, source)
        tier._validate(fix, verify)
        if current != manifest["source"]:
            tier._refresh_source(raw, current)
        return tier

    def _refresh_source(self, raw: bytes, current: dict[str, Any]) -> None:
        """Record the re-hashed source (same content, new mtimes) so the next open is cheap; best effort: skipped
        when the manifest changed since it was read or cannot be written (a read-only tier)."""
        manifest = {**self.manifest, "source": current}
        try:
            if (self.path / MANIFEST).read_bytes() != raw:
                return
            save_manifest(self.path, manifest, f"{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp")
        except OSError as exc:
            log.debug("%s: could not record the re-hashed source (%s)", self.path / MANIFEST, exc)
            return
        self.manifest = manifest

    def _validate(self, fix: str, verify: bool) -> None:
        m, lay = self.manifest, self.layout
        expected = {
            "precision": self.spec.precision.value, "bits": self.spec.bits, "group": group_label(self.spec),
            "group_sizes": resolved_groups(lay, self.spec), "num_experts": self.num_experts,
            "layout": lay.as_dict(),
            "moe_layers": list(self.moe_layers),
        }  # fmt: skip
        for key, want in expected.items():
            if m.get(key) != want:
                raise CheckpointError(f"{self.path / MANIFEST}: {key} is {m.get(key)!r}, the model needs {want!r}")
        done = {int(rec["layer"]): rec for rec in m.get("layers", [])}
        missing = [layer for layer in self.moe_layers if layer not in done]
        if missing or not m.get("complete"):
            raise CheckpointError(
                f"{self.path}: incomplete tier ({len(missing)} of {len(self.moe_layers)} layers missing, "
                f"first {missing[:1]}); finish it with `{fix}`"
            )
        for layer in self.moe_layers:
            self._validate_layer(layer, done[layer], fix, verify)

    def _validate_layer(self, layer: int, rec: dict[str, Any], fix: str, verify: bool) -> None:
        file = self.path / layer_file(layer)
        check_layer_file(file, rec, fix, verify)
        header = read_header(file)
        names = {f"{e}.{n}" for e in range(self.num_experts) for n in self.tensor_specs}
        extra = sorted(set(header) - names)
        if extra:
            raise CheckpointError(f"{file}: unexpected tensor {extra[0]!r} in a quantized layer file")
        first: TensorLocation | None = None
        for e in range(self.num_experts):
            pos = None
            for name, (dt, shape) in self.tensor_specs.items():
                full = f"{e}.{name}"
                loc = header.get(full)
                if loc is None:
                    raise CheckpointError(f"{file}: tensor {full!r} is missing; rewrite the tier with `{fix}`")
                if loc.dtype != ST_DTYPES[dt] or loc.shape != shape:
                    raise CheckpointError(
                        f"{file}: tensor {full!r} is {loc.dtype} {list(loc.shape)}, expected {ST_DTYPES[dt]} "
                        f"{list(shape)}; rewrite the tier with `{fix} --force`"
                    )
                first = first or loc
                want = first.offset + e * self.expert_bytes if pos is None else pos
                if loc.offset != want:
                    raise CheckpointError(f"{file}: tensor {full!r} is not where moetier quantize puts it")
                pos = loc.offset + loc.nbytes
        assert first is not None
        self._offsets[layer] = (file, first.offset)

    def set_io(self, io: DiskIO) -> None:
        """Read through `io` (O_DIRECT, requests in flight together; formats/diskio.py); its bounce buffers are
        `io.staging_bytes`, which the source counts."""
        with self._lock:
            io.fit(self.expert_bytes)
            self.io = io

    def _fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            fd = self._fds[layer] = os.open(self._offsets[layer][0], os.O_RDONLY)
            if self.io is not None:
                self._dfds[layer] = self.io.open_direct(fd, str(self._offsets[layer][0]))
        return fd

    def read_into(self, key: ExpertKey, dest: dict[str, torch.Tensor]) -> int:
        """Fill `dest` (canonical tensors as `tensor_specs`; contiguous CPU) with expert `key`; bytes read."""
        if key.layer not in self._offsets or not 0 <= key.expert < self.num_experts:
            raise KeyError(f"no expert {key} in the {self.spec.precision.value} tier {self.path}")
        with self._lock:
            views: list[memoryview] = []
            addrs: list[tuple[int, int]] = []  # the same buffers as (address, nbytes), for `io`
            casts: list[tuple[torch.Tensor, torch.Tensor]] = []
            staged = 0
            for name, (dt, shape) in self.tensor_specs.items():
                t = dest[name]
                if tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError(f"dest[{name!r}] is {tuple(t.shape)} on {t.device}; expected contiguous {shape}")
                if t.dtype != dt:
                    if name not in _BIASES or not t.dtype.is_floating_point:
                        raise ValueError(f"dest[{name!r}] has dtype {t.dtype}; expected {dt}")
                    nbytes = prod(shape) * dt.itemsize
                    t = self._staging[staged : staged + nbytes].view(dt)
                    staged += nbytes
                    casts.append((dest[name], t))
                views.append(byte_view(t))
                addrs.append((t.data_ptr(), len(views[-1])))
            file, base = self._offsets[key.layer]
            offset = base + key.expert * self.expert_bytes
            eof = f"{file}: unexpected end of file reading expert {key.expert}"
            try:
                if self.io is None:
                    done = pread_exact(self._fd(key.layer), views, offset, eof)
                else:
                    fd = self._fd(key.layer)
                    done = sum(n for _, n in addrs)
                    (err,) = self.io.read([Span(fd, self._dfds.get(key.layer), offset, done, addrs, str(file))])
                    if err is not None:
                        raise CheckpointError(eof) if isinstance(err, CheckpointError) else err
            except (OSError, CheckpointError):
                for fds in (self._fds, self._dfds):  # the next read reopens the path (a file restored by rename)
                    fd_ = fds.pop(key.layer, None)
                    if fd_ is not None:
                        os.close(fd_)
                raise
            for out, src in casts:
                out.copy_(src.view(out.shape))
            self.bytes_read += done
        return done

    def close(self) -> None:
        with self._lock:
            for fd in (*self._fds.values(), *self._dfds.values()):
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._dfds.clear()
            if self.io is not None:
                self.io.close()


def check_layer_file(file: Path, rec: dict[str, Any], fix: str, verify: bool) -> None:
    """CheckpointError unless a recorded layer file exists with the recorded size (and sha256 with `verify`)."""
    if not file.exists():
        raise CheckpointError(f"{file}: missing from the quantized tier; rewrite it with `{fix}`")
    size = file.stat().st_size
    if size != rec["bytes"]:
        raise CheckpointError(
            f"{file}: {size} bytes, the manifest records {rec['bytes']}: truncated or modified; rewrite it with `{fix}`"
        )
    if verify and _sha256_file(file) != rec["sha256"]:
        raise CheckpointError(
            f"{file}: differs from the manifest (sha256): damaged or modified; rewrite it with `{fix}`"
        )


def spec_of(manifest: dict[str, Any]) -> QuantSpec:
    """The QuantSpec a manifest was written for (its precision and group label; the default group as None)."""
    precision = Precision(manifest["precision"])
    group = None if manifest["group"] in ("K", "ggml") else int(manifest["group"])
    return QuantSpec(precision, None if group == DEFAULT_GROUP.get(precision) else group)


def list_tiers(
    model_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
    index: CheckpointIndex | None = None, shape: SourceShape | None = None, verify: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every tier directory under the model (or `root`), for `moetier info`: `tier_summary` plus a status:
    ok | incomplete | stale (the source changed since) | damaged (a layer file missing, truncated, modified, or
    not what the model needs) | unreadable (the manifest), and `reason`: why it is not ok, in the words loading it
    would use (None when ok; `stale_reason` repeats it for a stale tier). `index`: the model's tensor index
    (models/open.py `open_index`, which also reads GGUF files and quantized checkpoints); default the safetensors
    folder's. `shape`: the model's (SourceShape.of its reader): each complete tier then gets every check
    `QuantTier.open` makes (headers, dtypes, shapes, offsets; sha256 with `verify`), the same code and messages;
    without it, layer files are checked for presence and size (and sha256 with `verify`). Nothing is written."""
    base = Path(root) if root is not None else default_root(model_dir)
    checked: dict[str, str | None] = {}  # recorded source (as JSON) -> what changed: tiers of one run share it
    out: list[dict[str, Any]] = []
    for path in sorted(p for p in base.glob("*") if (p / MANIFEST).exists()):
        # 1. the manifest
        try:
            m = load_manifest(path / MANIFEST)
            summary = tier_summary(path, m)
            spec = spec_of(m)
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            out.append({"path": str(path), "precision": path.name.split("-")[0], "status": "unreadable",
                        "reason": str(exc)})  # fmt: skip
            continue
        # 2. the source (the same cheap-unless-moved test QuantTier.open makes; nothing is refreshed here)
        index = index if index is not None else CheckpointIndex(model_dir)
        key = json.dumps(m["source"], sort_keys=True)
        if key not in checked:
            checked[key] = check_source(m["source"], index)[0]
        stale = summary["stale_reason"] = summary["reason"] = checked[key]
        rows = bool((m.get("layout") or {}).get("down_rows"))
        fix = quantize_command(model_dir, spec, root, rows)
        if stale:
            summary["status"] = "stale"
        elif not m.get("complete"):
            summary["status"] = "incomplete"
            summary["reason"] = (
                f"{summary['layers_done']} of {summary['layers_total']} layers written; finish it with `{fix}`"
            )
        else:
            # 3. the tier's files, as QuantTier.open checks them
            summary["status"] = "ok"
            try:
                if shape is not None:
                    layout = replace(shape.layout, down_rows=rows)
                    tier = QuantTier(path, m, spec, SourceShape(layout, shape.num_experts, shape.moe_layers))
                    tier._validate(fix, verify)
                else:
                    for rec in m["layers"]:
                        check_layer_file(path / str(rec["file"]), rec, fix, verify)
            except CheckpointError as exc:
                summary["status"], summary["reason"] = "damaged", str(exc)
        out.append(summary)
    return out


def tier_summary(path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """One tier from its manifest alone: precision, bits, group, group_sizes, method, layers_done,
    layers_total, bytes, the relative weight error per matrix (`error_summary`), the layout
    ("rows" for `--for-sparsity` tiers, else "packed") and, for a ggml block precision, the GGUF type of each
    matrix (`types`; None otherwise)."""
    m = manifest if manifest is not None else load_manifest(path / MANIFEST)
    layers = m.get("layers", [])
    return {
        "path": str(path), "precision": m["precision"], "bits": m["bits"], "group": m["group"],
        "group_sizes": m["group_sizes"], "method": m["method"], "complete": bool(m.get("complete")),
        "layers_done": len(layers), "layers_total": len(m["moe_layers"]),
        "bytes": sum(int(r["bytes"]) for r in layers), "error": error_summary(m),
        "layout": "rows" if (m.get("layout") or {}).get("down_rows") else "packed",
        "types": m.get("types"),  # a ggml block precision: the GGUF type of each matrix
    }  # fmt: skip


def error_summary(manifest: dict[str, Any]) -> dict[str, float]:
    """Relative weight error sqrt(sum ||W - Q(W)||^2 / sum ||W||^2) over the written layers, per matrix."""
    out = {}
    for m in ("w13", "w2"):
        err = sum(float(r["sq_err"][m]) for r in manifest.get("layers", []))
        ref = sum(float(r["sq_ref"][m]) for r in manifest.get("layers", []))
        out[m] = (err / ref) ** 0.5 if ref > 0 else 0.0
    return out
