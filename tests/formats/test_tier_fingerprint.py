"""The quantized tier's source record (formats/qtier.py): a full-content hash per checkpoint file, taken once at
quantize time, checked cheaply (size + mtime_ns) at every open and re-hashed only when those moved.

Faults injected: bytes edited in the middle of a source file keeping its size (refused, the file named, the
command given); the same edit with the mtime put back inside the racy window (still refused); a touch or a copy
with the same bytes (accepted silently, the record refreshed); an unchanged source (accepted without reading
it: the hash function is monkeypatched to fail); a tier written with the older sampled print (refused, both by
open and by quantize, with the command that rewrites it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moetier.errors import CheckpointError
from moetier.formats import qtier
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.qtier import list_tiers, source_fingerprint
from moetier.formats.quantize import quantize_model
from moetier.models.open import open_quant_tier
from moetier.models.tiny import build_tiny_checkpoint
from moetier.types import ExpertKey

HOUR_NS = 3600 * 10**9


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny mixtral checkpoint (I = 64, so int8 has a group) whose files are an hour old."""
    src = build_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("fp") / "mixtral", intermediate_size=64)
    age(src, HOUR_NS)
    return src


def age(folder: Path, by_ns: int) -> None:
    for f in folder.iterdir():
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns - by_ns, st.st_mtime_ns - by_ns))


@pytest.fixture
def src(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(pristine, dst)  # copy2: the old mtimes come along
    return dst


def counting(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[Path]:
    """Count (or refuse) full-content hashes of checkpoint files."""
    calls: list[Path] = []
    real = qtier._content_hash

    def wrapped(path: Path) -> str:
        calls.append(path)
        if fail:
            raise AssertionError(f"{path} was re-hashed")
        return real(path)

    monkeypatch.setattr(qtier, "_content_hash", wrapped)
    return calls


def edit_middle(file: Path, keep_mtime: bool = False) -> None:
    """Flip one byte in the middle of the file's data, in place (same size)."""
    st = file.stat()
    with open(file, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.stat().st_size == st.st_size


def manifest_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "tiers" / "int8-gK" / "manifest.json").read_text())


def test_record_holds_a_full_hash_per_file(src: Path, tmp_path: Path) -> None:
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    rec = manifest_of(tmp_path)["source"]
    st = (src / "model.safetensors").stat()
    entry = rec["files"]["model.safetensors"]
    assert rec["version"] == qtier.SOURCE_VERSION
    assert (entry["size"], entry["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert entry["blake2b"] == qtier._content_hash(src / "model.safetensors")


def test_edit_in_the_middle_keeping_size_is_refused_naming_the_file(src: Path, tmp_path: Path, monkeypatch) -> None:
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()
    edit_middle(src / "model.safetensors")
    calls = counting(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        open_quant_tier(src, "int8", root=tmp_path / "tiers")
    msg = str(err.value)
    assert f"{src / 'model.safetensors'} changed (data differs)" in msg
    assert "moetier quantize" in msg and "--force" in msg
    assert calls == [src / "model.safetensors"]  # the moved file only, read once
    (tier,) = list_tiers(src, root=tmp_path / "tiers")
    assert tier["status"] == "stale" and "model.safetensors changed (data differs)" in tier["stale_reason"]


def test_racy_edit_with_the_mtime_put_back_is_still_refused(pristine: Path, tmp_path: Path) -> None:
    """A checkpoint written moments before quantize: an edit within the same timestamp tick (simulated by putting
    the recorded mtime back) keeps size and mtime, so only the racy rule catches it."""
    src = Path(shutil.copytree(pristine, tmp_path / "fresh"))
    os.utime(src / "model.safetensors")  # now: within RACY_NS of the hash quantize takes
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    edit_middle(src / "model.safetensors", keep_mtime=True)
    with pytest.raises(CheckpointError, match=r"model\.safetensors changed \(data differs\)"):
        open_quant_tier(src, "int8", root=tmp_path / "tiers")


def test_touch_only_is_accepted_then_cheap_again(src: Path, tmp_path: Path, monkeypatch) -> None:
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    before = manifest_of(tmp_path)
    os.utime(src / "model.safetensors")  # same bytes, new mtime (as a copy or a touch gives)
    calls = counting(monkeypatch)
    assert [t["status"] for t in list_tiers(src, root=tmp_path / "tiers")] == ["ok"]
    assert manifest_of(tmp_path) == before  # info writes nothing
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()
    assert calls == [src / "model.safetensors"] * 2  # list_tiers, then open: re-hashed, accepted
    after = manifest_of(tmp_path)
    assert after["source"]["fingerprint"] == before["source"]["fingerprint"]
    assert after["source"]["files"]["model.safetensors"]["mtime_ns"] == (src / "model.safetensors").stat().st_mtime_ns
    assert {k: v for k, v in after.items() if k != "source"} == {k: v for k, v in before.items() if k != "source"}
    # the new mtime is now recorded, but it is still inside the racy window of the re-hash: once it is old,
    # an open reads nothing
    age(src, HOUR_NS)
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()  # re-hashed once more (mtime moved), recorded
    counting(monkeypatch, fail=True)
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()


def test_unchanged_source_is_accepted_without_rehashing(src: Path, tmp_path: Path, monkeypatch) -> None:
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    counting(monkeypatch, fail=True)
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()
    assert [t["status"] for t in list_tiers(src, root=tmp_path / "tiers")] == ["ok"]
    quantize_model(src, ["int8"], out=tmp_path / "tiers")  # a rerun reuses the recorded hashes too


def test_tier_with_the_old_sampled_print_is_refused(src: Path, tmp_path: Path) -> None:
    (path,) = quantize_model(src, ["int8"], out=tmp_path / "tiers")
    m = manifest_of(tmp_path)
    m["source"] = source_fingerprint(CheckpointIndex(src))  # what moetier wrote before the source record
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"older moetier.*sampled.*rewrite it with `moetier quantize .*--force`"):
        open_quant_tier(src, "int8", root=tmp_path / "tiers")
    (tier,) = list_tiers(src, root=tmp_path / "tiers")
    assert tier["status"] == "stale" and "older moetier" in tier["stale_reason"]
    with pytest.raises(CheckpointError, match=r"older moetier.*--force"):
        quantize_model(src, ["int8"], out=tmp_path / "tiers")
    quantize_model(src, ["int8"], out=tmp_path / "tiers", force=True)
    open_quant_tier(src, "int8", root=tmp_path / "tiers").close()


def test_sharded_source_names_the_edited_shard(tmp_path: Path, tiny_ckpt: Callable[..., Path]) -> None:
    src = Path(shutil.copytree(tiny_ckpt("deepseek_v3", "sharded"), tmp_path / "sharded"))
    age(src, HOUR_NS)
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    shards = sorted(src.glob("*.safetensors"))
    victim = shards[len(shards) // 2]
    edit_middle(victim)
    with pytest.raises(CheckpointError, match=rf"{victim}.*changed \((data|tensor header) differs\).*moetier quantize"):
        open_quant_tier(src, "int8", root=tmp_path / "tiers")


def test_a_failed_tier_read_reopens_the_layer_file_next_time(src: Path, tmp_path: Path) -> None:
    """A layer file moved away under an open tier fails that read (no stale descriptor is kept), and once it is
    restored by rename the next read reopens the path and gives the same bytes."""
    quantize_model(src, ["int8"], out=tmp_path / "tiers")
    tier = open_quant_tier(src, "int8", root=tmp_path / "tiers")
    try:
        key = ExpertKey(0, 1)
        fresh = lambda: {n: torch.empty(shape, dtype=dt) for n, (dt, shape) in tier.tensor_specs.items()}  # noqa: E731
        first = fresh()
        tier.read_into(key, first)
        layer = tier.path / "layer-000.safetensors"
        data = layer.read_bytes()
        layer.write_bytes(data[: len(data) // 4])  # truncated in place: the read fails
        with pytest.raises((OSError, CheckpointError)):
            tier.read_into(key, fresh())
        spare = layer.with_suffix(".restore")
        spare.write_bytes(data)
        spare.rename(layer)  # restored by rename: a new inode the old descriptor would never see
        again = fresh()
        tier.read_into(key, again)
        assert all(torch.equal(first[n], again[n]) for n in first)
    finally:
        tier.close()
