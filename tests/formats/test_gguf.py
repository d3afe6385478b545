"""GGUF header reading and validation (formats/gguf.py): every damaged file is a CheckpointError naming it."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_ref import write_gguf
from moetier.errors import CheckpointError
from moetier.formats.gguf import gguf_files, is_gguf, location, read_gguf, read_gguf_model
from moetier.models.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_hdr")
    src = build_tiny_checkpoint("qwen3_moe", root / "src")
    return write_gguf(src, root / "model.gguf", "qwen3_moe", "Q8_0")


def copy(good: Path, tmp_path: Path, name: str = "model.gguf") -> Path:
    out = tmp_path / name
    shutil.copy(good, out)
    return out


def test_reads_header_metadata_and_tensors(good):
    g = read_gguf(good)
    assert g.version == 3 and g.metadata["general.architecture"] == "qwen3moe"
    assert g.metadata["qwen3moe.expert_count"] == 6
    t = g.tensors["blk.1.ffn_gate_exps.weight"]
    assert t.shape == (6, 16, 32) and t.type_name == "Q8_0"
    assert t.nbytes == 6 * 16 * 34 and t.row_bytes == 34
    assert g.tensors["blk.1.ffn_down_exps.weight"].type_name == "F32"  # rows of 16: not whole Q8_0 blocks
    size = good.stat().st_size
    assert all(x.offset + x.nbytes <= size for x in g.tensors.values())
    # the bytes at the recorded offset are the tensor's (compared with gguf's own reader)
    ref = {t.name: t for t in gguf.GGUFReader(str(good)).tensors}["blk.1.ffn_gate_exps.weight"]
    with open(good, "rb") as f:
        f.seek(t.offset)
        assert f.read(t.nbytes) == ref.data.tobytes()


def test_expert_location_is_its_contiguous_byte_range(good):
    t = read_gguf(good).tensors["blk.0.ffn_gate_exps.weight"]
    loc = location(t, "x.experts.2.gate_proj.weight", (16, 32), expert=2)
    assert loc.dtype == "gguf:Q8_0" and loc.shape == (16, 32)
    (part,) = loc.parts
    assert part.dtype == "U8" and part.offset == t.offset + 2 * 16 * 34 and part.nbytes == 16 * 34
    f32 = read_gguf(good).tensors["blk.0.ffn_down_exps.weight"]
    plain = location(f32, "y", (32, 16), expert=5)
    assert plain.dtype == "F32" and not plain.parts and plain.offset == f32.offset + 5 * 32 * 16 * 4
    with pytest.raises(CheckpointError, match="cannot hold"):
        location(t, "z", (32, 16), expert=0)


def test_truncated_data_names_file_and_tensor(good, tmp_path):
    bad = copy(good, tmp_path)
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError) as err:
        read_gguf(bad)
    msg = str(err.value)
    assert str(bad) in msg and "truncated" in msg and "tensor '" in msg


def test_truncated_header(good, tmp_path):
    bad = copy(good, tmp_path)
    with open(bad, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match="truncated") as err:
        read_gguf(bad)
    assert str(bad) in str(err.value)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<I", 7) + b"\0" * 100)
    with pytest.raises(CheckpointError, match="version 7"):
        read_gguf(bad)


def _patch_type(path: Path, tensor: str, code: int) -> None:
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, code)
    path.write_bytes(bytes(data))


def test_unknown_and_unsupported_tensor_types(good, tmp_path):
    bad = copy(good, tmp_path)
    _patch_type(bad, "blk.0.attn_q.weight", 99)
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.weight' has unknown GGML type 99") as err:
        read_gguf(bad)
    assert str(bad) in str(err.value)
    _patch_type(bad, "blk.0.attn_q.weight", int(gguf.GGMLQuantizationType.TQ1_0))
    with pytest.raises(CheckpointError, match="TQ1_0, which moetier cannot decode"):
        read_gguf(bad)


def test_rows_must_be_whole_blocks(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    w.add_tensor("a.weight", np.zeros((4, 68), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # [4, 64]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    at = data.index(b"a.weight") + len(b"a.weight") + 4  # after the name and n_dims: ne[0]
    assert struct.unpack_from("<Q", data, at)[0] == 64
    struct.pack_into("<Q", data, at, 48)
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rows of 48 weights, not whole Q8_0 blocks"):
        read_gguf(tmp_path / "m.gguf")


def test_shards_are_found_in_order_and_checked(tmp_path):
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    whole = write_gguf(src, tmp_path / "whole.gguf", "qwen3_moe")
    folder = tmp_path / "split"
    folder.mkdir()
    tensors = read_gguf(whole).tensors
    w = gguf.GGUFWriter(str(folder / "m.gguf"), "qwen3moe", split_max_tensors=10)
    r = gguf.GGUFReader(str(whole))
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(folder.glob("*.gguf"))
    assert len(shards) > 2 and shards[0].name.endswith("-00001-of-" + f"{len(shards):05d}.gguf")
    assert gguf_files(folder) == shards and gguf_files(shards[1]) == shards
    assert is_gguf(folder) and is_gguf(shards[0]) and not is_gguf(src)
    _, _, merged = read_gguf_model(folder)
    assert set(merged) == set(tensors)
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"lacks {shards[-1].name}"):
        gguf_files(folder)


def test_folder_with_two_models_is_ambiguous(good, tmp_path):
    copy(good, tmp_path, "a.gguf")
    copy(good, tmp_path, "b.gguf")
    with pytest.raises(CheckpointError, match="more than one GGUF model"):
        gguf_files(tmp_path)


def test_quantize_and_info_on_a_gguf_file(good, tmp_path):
    """`moetier quantize` and `moetier info` on a .gguf file: tiers go next to it (`<stem>-moetier-quant/`), their
    source fingerprint is the GGUF file's, and they read as ok until the file changes."""
    from moetier.formats.qtier import list_tiers
    from moetier.formats.quantize import quantize_model
    from moetier.models.open import open_index

    path = copy(good, tmp_path)
    (tier,) = quantize_model(path, ["int8"])
    assert tier.parent == tmp_path / "model-moetier-quant"
    tiers = list_tiers(path, index=open_index(path))
    assert [t["status"] for t in tiers] == ["ok"]
    with open(path, "r+b") as f:  # change a weight byte near the end of the file
        f.seek(-64, 2)
        b = f.read(1)
        f.seek(-64, 2)
        f.write(bytes([b[0] ^ 0x55]))
    assert [t["status"] for t in list_tiers(path, index=open_index(path))] == ["stale"]
