"""`moetier quantize`: writes quantized disk tiers of a model's routed experts.

For each precision, a directory `<model>/moetier-quant/<precision>-g<group>/` (or
`<out>/<precision>-g<group>/`) gets one safetensors file per MoE layer and a
`manifest.json` (format in formats/qtier.py, which reads it back). Experts are read in
batches (about BATCH_ELEMENTS fp32 weights, at least one expert) through the model's
ExpertReader in fp32, checked finite, quantised in fp32 by formats/quant.py's
`quantize_stack` (the w13 rows of every expert of the batch in one fit, the w2 rows in
another; a ggml block precision such as q4_k by ggml's own quantiser, formats/quant_ggml.py,
whose tier records method "ggml") and streamed into the layer file expert by expert, so memory
stays at one batch whatever the model size. Each expert is read once for all precisions.

Invariants:
- a layer file is written to `<name>.tmp`, fsynced and renamed, and only then recorded
  in the manifest (itself rewritten atomically after each layer): a crash never leaves
  a recorded layer that is incomplete;
- a restart skips layers recorded with a matching size and sha256, redoes any other,
  and removes stray `.tmp` files; the result is byte-identical to an uninterrupted run;
- a directory holding a tier of another source, precision, group, method or dtype is
  refused unless `force=True`, which deletes that tier's files first; so is a tier whose manifest
  holds the older sampled source print (formats/qtier.py), which cannot prove what it was made from;
- the manifest's source record (formats/qtier.source_record) hashes every checkpoint file whole,
  once: a resumed run reuses the recorded hashes of files whose size and mtime did not move;
- a non-finite source expert weight stops the run with a CheckpointError naming the
  checkpoint tensor, layer and expert; its layer is never recorded;
- the bytes written for an expert are those of `quantize_expert` on that expert alone
  (every group is fitted independently of the others it is batched with).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import IO, Any

import torch
from rich.progress import Progress, TaskID

from moetier import __version__
from moetier.errors import CheckpointError, ConfigError
from moetier.formats import quant_ggml
from moetier.formats.layout import ExpertLayout
from moetier.formats.qtier import (
    DTYPE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    LEGACY_SOURCE,
    MANIFEST,
    ST_DTYPES,
    TensorSpecs,
    _sha256_file,
    fsync_dir,
    group_label,
    layer_file,
    load_manifest,
    resolved_groups,
    save_manifest,
    source_mismatch,
    source_record,
    tier_dir,
)
from moetier.formats.quant import (
    DEFAULT_METHOD,
    MATRICES,
    METHODS,
    QUANTIZED,
    QuantSpec,
    expert_tensor_specs,
    quantize_stack,
)
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import expert_dtype, open_checkpoint, resolve_dtype
from moetier.types import ExpertKey, Precision

log = logging.getLogger(__name__)
# manifest fields a resumed run must agree with (besides the source fingerprint)
_IDENTITY = ("precision", "bits", "group", "group_sizes", "method", "dtype", "layout", "num_experts", "moe_layers")
# experts read and fitted together: about this many fp32 weights (32 MiB), at least one expert
BATCH_ELEMENTS = 8 << 20
GGML_METHOD = "ggml"  # the method a ggml block precision's tier records: ggml's own quantiser, whatever --method says


@dataclass(frozen=True)
class QuantEvent:
    """One (precision, layer) finished: `status` is "written", "skipped" (already done) or "redone"."""

    precision: Precision
    layer: int
    done: int  # (precision, layer) pairs finished so far, this one included
    total: int
    status: str
    path: Path
    error: dict[str, float]  # relative weight error of w13 and w2 in this layer


ProgressArg = Progress | Callable[[QuantEvent], None] | None


def parse_specs(precisions: Sequence[Precision | str], group_sizes: dict[Any, int | None] | None) -> list[QuantSpec]:
    """Precisions and optional per-precision group sizes -> QuantSpecs; ConfigError on anything unknown."""
    specs, groups = [], {}
    for p, g in (group_sizes or {}).items():
        groups[_precision(p)] = g
    if not precisions:
        raise ConfigError(f"no precision to quantize to; choose from {', '.join(QUANTIZED)}")
    for p in dict.fromkeys(_precision(p) for p in precisions):
        specs.append(QuantSpec(p, groups.pop(p, None)))  # QuantSpec refuses a bad group size
    if groups:
        raise ConfigError(f"group size given for {sorted(x.value for x in groups)}, which is not being quantized")
    return specs


def _precision(p: Precision | str) -> Precision:
    try:
        prec = Precision(p)
    except ValueError:
        raise ConfigError(f"unknown precision {p!r}; choose from {', '.join(QUANTIZED)}") from None
    if prec is Precision.FULL:
        raise ConfigError("precision 'full' is the checkpoint itself and needs no quantized tier")
    return prec


class _TierWriter:
    """One tier directory: resume state, the layer file being written, the manifest."""

    def __init__(self, path: Path, spec: QuantSpec, identity: dict[str, Any], source: dict[str, Any]) -> None:
        self.path, self.spec = path, spec
        self.manifest: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION, **identity, "source": source,
                                         "complete": False, "moetier": __version__, "layers": []}  # fmt: skip
        self.layout = ExpertLayout(**identity["layout"])
        self.specs: TensorSpecs = expert_tensor_specs(self.layout, spec, _dtype(identity))
        self.layer_bytes_data = identity["num_experts"] * sum(dt.itemsize * prod(s) for dt, s in self.specs.values())
        self.done: dict[int, dict[str, Any]] = {}
        self.redo: set[int] = set()
        self.wipe = False
        self._file: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._sq = {"sq_err": {"w13": 0.0, "w2": 0.0}, "sq_ref": {"w13": 0.0, "w2": 0.0}}

    def check(self, force: bool) -> None:
        """Adopt a compatible existing manifest (keeping its verified layers) or refuse. Writes nothing."""
        mfile = self.path / MANIFEST
        self.wipe = force
        if mfile.exists() and not force:
            try:
                old = load_manifest(mfile)
            except CheckpointError as exc:
                raise CheckpointError(f"{exc}; pass --force (force=True) to delete the tier and start over") from None
            changed = source_mismatch(old.get("source") or {}, self.manifest["source"])
            if changed == LEGACY_SOURCE:
                raise CheckpointError(f"{mfile}: {changed}; pass --force (force=True) to delete it and start over")
            if changed:
                raise CheckpointError(
                    f"{mfile}: holds a tier of another version of the model ({changed}); "
                    "pass --force (force=True) to delete it and start over"
                )
            for key in _IDENTITY:
                if old.get(key) != self.manifest[key]:
                    raise CheckpointError(
                        f"{mfile}: holds a tier with another {key} ({old.get(key)!r}, now {self.manifest[key]!r}); "
                        "pass --force (force=True) to delete it and start over"
                    )
            for rec in old.get("layers", []):
                file = self.path / rec["file"]
                if file.exists() and file.stat().st_size == rec["bytes"] and _sha256_file(file) == rec["sha256"]:
                    self.done[int(rec["layer"])] = rec
                else:
                    log.warning("%s: recorded but missing or modified; it will be rewritten", file)
                    self.redo.add(int(rec["layer"]))

    def claim(self) -> None:
        """Create the directory, delete the old tier (force) and stray partial files, write the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.wipe:
            for f in [self.path / MANIFEST, *self.path.glob("layer-*.safetensors")]:
                f.unlink(missing_ok=True)
        for f in self.path.glob("*.tmp"):
            log.info("%s: removing a partial file left by an interrupted run", f)
            f.unlink()
        self._write_manifest()

    def begin_layer(self, layer: int, num_experts: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "precision": self.spec.precision.value,
                                                   "layer": str(layer)}}  # fmt: skip
        pos = 0
        for e in range(num_experts):
            for name, (dt, shape) in self.specs.items():
                n = dt.itemsize * prod(shape)
                header[f"{e}.{name}"] = {"dtype": ST_DTYPES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
                pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._file = open(self.path / (layer_file(layer) + ".tmp"), "wb")  # noqa: SIM115 (closed in end/abort)
        self._hash = hashlib.sha256()
        self._sq = {"sq_err": {"w13": 0.0, "w2": 0.0}, "sq_ref": {"w13": 0.0, "w2": 0.0}}
        self._write(len(raw).to_bytes(8, "little") + raw)

    def _write(self, data: bytes | memoryview) -> None:
        assert self._file is not None
        self._file.write(data)
        self._hash.update(data)

    def add_batch(self, batch: _Batch, method: str) -> None:
        """Quantise the batch's experts (one fit per matrix kind) and append them to the layer file."""
        n = batch.count
        fits: dict[str, list[dict[str, torch.Tensor]]] = {}
        for m, w in (("w13", batch.w13[:n]), ("w2", batch.w2[:n])):  # [B, 2I, H], [B, H, I] or [B, I, H]
            if self.spec.ggml:  # rows of ggml blocks, by ggml's quantiser
                rows, sq_err = quant_ggml.quantize_stack(w, self.spec.precision)
                fits[m] = [{"q": q} for q in rows]
            else:
                qms, sq_err = quantize_stack(w, self.spec, method)
                fits[m] = [{"q": qm.q, "scale": qm.scale, "zero": qm.zero} for qm in qms]
            self._sq["sq_err"][m] += sq_err
            self._sq["sq_ref"][m] += batch.sq_ref[m]
        for e in range(n):
            tensors = {f"{m}.{part}": t for m in MATRICES for part, t in fits[m][e].items()}
            if batch.b13 is not None and batch.b2 is not None:
                tensors |= {"b13": batch.b13[e], "b2": batch.b2[e]}  # [2I], [H]
            for name, (dt, shape) in self.specs.items():
                t = tensors.get(name)
                if t is None or tuple(t.shape) != shape:
                    raise RuntimeError(
                        f"quantize_stack gave {name} {None if t is None else tuple(t.shape)}, not {shape}"
                    )
                if t.dtype != dt:
                    if name not in ("b13", "b2"):
                        raise RuntimeError(f"quantize_stack gave {name} as {t.dtype}, not {dt}")
                    t = t.to(dt)
                self._write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)

    def end_layer(self, layer: int) -> dict[str, float]:
        assert self._file is not None
        f, self._file = self._file, None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        final = self.path / layer_file(layer)
        os.replace(final.with_name(final.name + ".tmp"), final)
        fsync_dir(self.path)
        err = {m: (self._sq["sq_err"][m] / r) ** 0.5 if (r := self._sq["sq_ref"][m]) > 0 else 0.0
               for m in ("w13", "w2")}  # fmt: skip
        self.done[layer] = {"layer": layer, "file": final.name, "bytes": final.stat().st_size,
                            "sha256": self._hash.hexdigest(), "error": err, **self._sq}  # fmt: skip
        self._write_manifest()
        return err

    def abort(self) -> None:
        if self._file is not None:
            name = self._file.name
            self._file.close()
            self._file = None
            Path(name).unlink(missing_ok=True)

    def _write_manifest(self) -> None:
        self.manifest["layers"] = sorted(self.done.values(), key=lambda r: int(r["layer"]))
        self.manifest["complete"] = set(self.done) == set(self.manifest["moe_layers"])
        save_manifest(self.path, self.manifest)


def quantize_model(
    model_dir: str | os.PathLike[str], precisions: Sequence[Precision | str], out: str | os.PathLike[str] | None = None,
    group_sizes: dict[Any, int | None] | None = None, method: str = DEFAULT_METHOD, progress: ProgressArg = None,
    force: bool = False, down_rows: bool = False,
) -> list[Path]:  # fmt: skip
    """Write one quantized disk tier per precision; returns their directories (see the module docstring).
    `progress`: a rich Progress (one bar over (precision, layer)) or a callable taking a QuantEvent.
    `down_rows`: the layout intra-expert sparsity reads (down projection as rows, quantised along H),
    written to `<precision>-g<group>-rows`."""
    if method not in METHODS:
        raise ConfigError(f"unknown quantization method {method!r}; choose from {', '.join(METHODS)}")
    specs = parse_specs(precisions, group_sizes)
    cpu = torch.device("cpu")
    o = open_checkpoint(model_dir, "fp32", cpu, down_rows=down_rows)  # fp32 pieces; quantisation runs in fp32
    try:
        if down_rows and o.family.expert_kind != "swiglu":
            raise ConfigError(
                f"--for-sparsity writes tiers for sparse execution, which {o.family.name} experts do not support yet"
            )
        dtype = resolve_dtype("auto", o.config, cpu, expert_dtype(o.index))  # biases are kept in this dtype
        layout, layers = o.reader.layout, [s.layer for s in o.sites]
        for spec in specs:  # a ggml type refuses a layout it has no tier for, or rows its blocks cannot tile
            expert_tensor_specs(layout, spec, dtype)
        paths = [tier_dir(model_dir, spec, out, down_rows) for spec in specs]
        source = source_record(o.index, known=_known_source([p for p in paths if (p / MANIFEST).exists()]))
        writers = []
        for spec, path in zip(specs, paths, strict=True):
            identity: dict[str, Any] = {
                "precision": spec.precision.value, "bits": spec.bits, "group": group_label(spec),
                "group_sizes": resolved_groups(layout, spec), "method": GGML_METHOD if spec.ggml else method,
                "dtype": DTYPE_NAMES[dtype],
                "layout": layout.as_dict(),
                "num_experts": o.num_experts, "moe_layers": layers, "family": o.family.name,
            }  # fmt: skip
            if spec.ggml:  # the GGUF type each matrix takes (w2's rows may take llama-quantize's fallback)
                identity["types"] = quant_ggml.matrix_types(spec.precision, layout)
            writers.append(_TierWriter(path, spec, identity, source))
        for w in writers:  # every refusal before the first write
            w.check(force)
        _check_space(writers, layers)
        for w in writers:
            w.claim()
        rep = _Reporter(progress, len(writers) * len(layers))
        for w in writers:
            if w.done:
                rep.note(f"{w.path}: {len(w.done)} of {len(layers)} layers already written and verified, resuming")
        _run(o.reader, writers, layers, o.num_experts, method, rep)
        return [w.path for w in writers]
    finally:
        o.reader.close()


class _Batch:
    """Up to `size` experts of one layer in fp32, each expert's pieces views into stacked matrices."""

    def __init__(self, reader: ExpertReader, size: int) -> None:
        layout = reader.layout
        h, i = layout.hidden, layout.inter
        self.w13 = torch.empty((size, 2 * i, h))  # [B, 2I, H]: gate rows, then up rows
        self.w2 = torch.empty((size, *layout.pieces["down"][1]))  # [B, H, I] ([B, I, H] with down_rows)
        self.b13 = torch.empty((size, 2 * i)) if layout.has_bias else None  # [B, 2I]
        self.b2 = torch.empty((size, h)) if layout.has_bias else None  # [B, H]
        self.reader, self.count = reader, 0
        self.keys: list[ExpertKey] = []
        self.sq_ref = {"w13": 0.0, "w2": 0.0}

    def pieces(self, b: int) -> dict[str, torch.Tensor]:
        """Expert b's pieces, in the reader's names and shapes (contiguous views)."""
        i = self.w13.shape[1] // 2
        out = {"gate": self.w13[b, :i], "up": self.w13[b, i:], "down": self.w2[b]}
        if self.b13 is not None and self.b2 is not None:
            out |= {"gate_bias": self.b13[b, :i], "up_bias": self.b13[b, i:], "down_bias": self.b2[b]}
        return out

    def fill(self, keys: list[ExpertKey]) -> None:
        """Read `keys` (at most `size`), check them finite, and measure their squared norms."""
        self.keys, self.count = keys, len(keys)
        for b, key in enumerate(keys):
            self.reader.read_into(key, self.pieces(b))
        n = self.count
        stacked = [t[:n] for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]
        if not all(bool(torch.isfinite(t.sum())) for t in stacked):  # one cheap pass; NaN and inf show here
            for b, key in enumerate(keys):
                _check_finite(self.reader, key, self.pieces(b))  # names the tensor (a finite overflow goes on)
        self.sq_ref = {"w13": float(torch.linalg.vector_norm(self.w13[:n])) ** 2,
                       "w2": float(torch.linalg.vector_norm(self.w2[:n])) ** 2}  # fmt: skip


def _run(
    reader: ExpertReader, writers: list[_TierWriter], layers: list[int], num_experts: int, method: str,
    rep: _Reporter,
) -> None:  # fmt: skip
    size = max(1, min(num_experts, BATCH_ELEMENTS // reader.layout.numel))
    batch = _Batch(reader, size)
    for layer in layers:
        todo = [w for w in writers if layer not in w.done]
        for w in writers:
            if layer in w.done:
                log.info("%s: layer %d already written (size and sha256 match), skipped", w.path, layer)
                rep.event(w, layer, "skipped", w.done[layer]["error"])
        if not todo:
            continue
        rep.describe(f"{'/'.join(w.spec.precision.value for w in todo)} layer {layer}")
        try:
            for w in todo:
                w.begin_layer(layer, num_experts)
            for e0 in range(0, num_experts, size):  # over batches of experts
                batch.fill([ExpertKey(layer, e) for e in range(e0, min(num_experts, e0 + size))])
                for w in todo:
                    w.add_batch(batch, method)
            errors = [w.end_layer(layer) for w in todo]
        finally:
            for w in todo:
                w.abort()
        for w, err in zip(todo, errors, strict=True):
            rep.event(w, layer, "redone" if layer in w.redo else "written", err)


def _check_finite(reader: ExpertReader, key: ExpertKey, pieces: dict[str, torch.Tensor]) -> None:
    for piece, t in pieces.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            r = next(r for r in reader.plans[key] if piece in (p for p, _ in r.pieces))
            raise CheckpointError(
                f"{r.loc.file}: expert tensor {r.loc.name!r} (layer {key.layer}, expert {key.expert}, {piece}) has "
                f"{bad} NaN/Inf values; refusing to quantize a broken checkpoint"
            )


def _check_space(writers: list[_TierWriter], layers: list[int]) -> None:
    need = sum(w.layer_bytes_data for w in writers for layer in layers if layer not in w.done)
    where = writers[0].path
    while not where.exists():  # the tier directories are created after every check passed
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise ConfigError(f"{writers[0].path}: quantizing needs about {need / 2**30:.2f} GiB, {free / 2**30:.2f} free")


class _Reporter:
    def __init__(self, progress: ProgressArg, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.task: TaskID | None = None
        if isinstance(progress, Progress):
            self.task = progress.add_task("quantizing", total=total)

    def note(self, text: str) -> None:
        log.info(text)
        if isinstance(self.progress, Progress):
            self.progress.console.print(text)

    def describe(self, text: str) -> None:
        if isinstance(self.progress, Progress) and self.task is not None:
            self.progress.update(self.task, description=f"quantizing {text}")

    def event(self, w: _TierWriter, layer: int, status: str, error: dict[str, float]) -> None:
        self.done += 1
        if isinstance(self.progress, Progress):
            assert self.task is not None
            self.progress.update(self.task, advance=1, description=f"{w.spec.precision.value} layer {layer}: {status}")
        elif self.progress is not None:
            self.progress(QuantEvent(w.spec.precision, layer, self.done, self.total, status, w.path, error))


def _dtype(identity: dict[str, Any]) -> torch.dtype:
    return {v: k for k, v in DTYPE_NAMES.items()}[identity["dtype"]]


def _known_source(paths: list[Path]) -> dict[str, Any] | None:
    """The source record of an existing tier among `paths` (its hashes are reused for unmoved files), if any."""
    for path in paths:
        try:
            source: dict[str, Any] = load_manifest(path / MANIFEST)["source"]
            return source
        except CheckpointError:
            continue
    return None
