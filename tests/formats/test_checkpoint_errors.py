"""Bad checkpoints give typed errors naming the file, tensor or number at fault.

Each test damages a private copy of a tiny checkpoint, then opens it with moetier.load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import BudgetError, CheckpointError, MoetierError
from moetier.formats.checkpoint import CheckpointIndex, read_header

CFG = EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", lean=False))


def rewrite(path: Path, edit) -> Path:
    """Load model.safetensors, apply edit(state_dict) and save it back in place."""
    file = path / "model.safetensors"
    sd = load_file(file)
    edit(sd)
    save_file(sd, file, metadata={"format": "pt"})
    return file


def load_error(path: Path, cfg: EngineConfig = CFG) -> MoetierError:
    with pytest.raises(MoetierError) as err:
        moetier.load(path, cfg)
    return err.value


@pytest.mark.parametrize(("family", "name"), [
    ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.5.w2.weight"),
    ("deepseek_v2", "model.layers.2.mlp.experts.7.gate_proj.weight"),
    ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj_bias"),
])  # fmt: skip
def test_missing_expert_tensor(ckpt_copy, family, name):
    path = ckpt_copy(family)
    rewrite(path, lambda sd: sd.pop(name))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert name in str(err) and "missing" in str(err)


def test_missing_non_expert_tensor(ckpt_copy):
    path = ckpt_copy("olmoe")
    rewrite(path, lambda sd: sd.pop("model.layers.1.self_attn.q_norm.weight"))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert "model.layers.1.self_attn.q_norm.weight" in str(err)


@pytest.mark.parametrize("name", [
    "model.layers.0.mlp.experts.99.up_proj.weight",  # an expert beyond num_experts
    "model.layers.1.mlp.mystery.weight",  # a tensor no module owns
])  # fmt: skip
def test_extra_tensor(ckpt_copy, name):
    path = ckpt_copy("qwen3_moe")
    file = rewrite(path, lambda sd: sd.__setitem__(name, torch.zeros(16, 32)))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert name in str(err) and str(file) in str(err)


@pytest.mark.parametrize(("family", "name", "bad_shape", "good_shape"), [
    ("qwen3_moe", "model.layers.1.mlp.experts.2.down_proj.weight", (32, 17), (32, 16)),
    ("qwen3_moe", "model.layers.0.mlp.experts.0.gate_proj.weight", (32, 16), (16, 32)),  # transposed
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj", (6, 32, 30), (6, 32, 32)),
    ("gpt_oss", "model.layers.0.mlp.experts.down_proj", (5, 16, 32), (6, 16, 32)),  # one expert short
])  # fmt: skip
def test_misshaped_expert_tensor(ckpt_copy, family, name, bad_shape, good_shape):
    path = ckpt_copy(family)
    rewrite(path, lambda sd: sd.__setitem__(name, torch.zeros(bad_shape)))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    msg = str(err)
    assert name in msg
    assert str(list(bad_shape)) in msg and str(list(good_shape)) in msg


def test_misshaped_non_expert_tensor(ckpt_copy):
    path = ckpt_copy("mixtral")
    rewrite(path, lambda sd: sd.__setitem__("model.norm.weight", torch.ones(33)))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert "model.norm.weight" in str(err) and "[33]" in str(err) and "[32]" in str(err)


def test_integer_expert_tensor_is_refused(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    name = "model.layers.1.mlp.experts.4.up_proj.weight"
    rewrite(path, lambda sd: sd.__setitem__(name, sd[name].to(torch.int32)))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert name in str(err) and "I32" in str(err)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_file(ckpt_copy, keep):
    path = ckpt_copy("deepseek_v3")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert str(file) in str(err) and "truncated" in str(err)


def test_file_cut_inside_header(ckpt_copy):
    path = ckpt_copy("qwen2_moe")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert str(file) in str(err) and "truncated" in str(err)


@pytest.mark.parametrize(("start", "stop"), [(8, 40), (0, 8), (60, 90)])
def test_corrupt_header(ckpt_copy, start, stop):
    path = ckpt_copy("qwen3_moe")
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[start:stop] = b"\xff" * (stop - start)
    file.write_bytes(bytes(data))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert str(file) in str(err)


def test_header_with_overlapping_tensors(tmp_path):
    """A header whose byte ranges overlap is corrupt even if every range fits in the file."""
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    raw = json.dumps(header).encode()
    file = tmp_path / "x.safetensors"
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(24))
    with pytest.raises(CheckpointError, match="overlap") as err:
        read_header(file)
    assert str(file) in str(err.value)


def test_header_with_wrong_byte_count(tmp_path):
    header = {"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 48]}}  # needs 24 bytes
    raw = json.dumps(header).encode()
    file = tmp_path / "y.safetensors"
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(48))
    with pytest.raises(CheckpointError) as err:
        read_header(file)
    msg = str(err.value)
    assert "'w'" in msg and "48" in msg and "24" in msg


def test_unknown_architecture(ckpt_copy):
    path = ckpt_copy("qwen3_moe", config={"architectures": ["FooMoeForCausalLM"], "model_type": "foo_moe"})
    err = load_error(path)
    assert isinstance(err, moetier.UnknownArchitectureError)
    assert "FooMoeForCausalLM" in str(err) and "foo_moe" in str(err)


def test_missing_or_broken_config(ckpt_copy):
    path = ckpt_copy("olmoe")
    (path / "config.json").write_text("{not json")
    err = load_error(path)
    assert isinstance(err, CheckpointError) and "config.json" in str(err)
    (path / "config.json").unlink()
    err = load_error(path)
    assert isinstance(err, CheckpointError) and "config.json" in str(err)


def test_not_a_directory(tmp_path):
    err = load_error(tmp_path / "nowhere")
    assert isinstance(err, CheckpointError) and "nowhere" in str(err)


def test_no_safetensors_files(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        CheckpointIndex(path)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_budget_smaller_than_one_expert(tiny_ckpt, family):
    path = tiny_ckpt(family)
    probe = moetier.load(path, CFG)
    slot, staging = probe.store.slot_bytes, probe.store.staging_bytes
    probe.close()
    budget = slot + staging - 1
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=CFG.runtime)
    err = load_error(path, cfg)
    assert isinstance(err, BudgetError)
    assert str(budget) in str(err) and str(slot) in str(err) and str(slot + staging) in str(err)


# -- sharded checkpoints ---------------------------------------------------------------------


def test_sharded_checkpoint_is_indexed(tiny_ckpt):
    path = tiny_ckpt("qwen2_moe", "sharded")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").exists()
    index = CheckpointIndex(path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.names()) == set(weight_map)
    for name, file_name in weight_map.items():
        loc = index[name]
        assert loc.file.name == file_name
        tensor = load_file(loc.file)[name]
        assert tuple(tensor.shape) == loc.shape
        with open(loc.file, "rb") as f:  # the recorded byte offset really is where the tensor lives
            f.seek(loc.offset)
            raw = f.read(loc.nbytes)
        assert raw == tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v2"])
def test_sharded_checkpoint_is_exact(tiny_ckpt, hf_model, family):
    path = tiny_ckpt(family, "sharded")
    assert len(list(path.glob("*.safetensors"))) > 2
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf_model(family, "sharded")(ids).logits
    probe = moetier.load(path, CFG)
    budget = probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    for b in (None, budget):
        engine = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=b), runtime=CFG.runtime))
        assert (engine.logits(ids) - ref).abs().max().item() <= 1e-4
        engine.close()


def test_index_naming_missing_shard(ckpt_copy):
    path = ckpt_copy("qwen2_moe", "sharded")
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert victim.name in str(err) and "index" in str(err)


def test_index_mapping_tensor_to_wrong_shard(ckpt_copy):
    path = ckpt_copy("qwen2_moe", "sharded")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert name in str(err)


def test_corrupt_index(ckpt_copy):
    path = ckpt_copy("qwen2_moe", "sharded")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    err = load_error(path)
    assert isinstance(err, CheckpointError) and "model.safetensors.index.json" in str(err)


def test_tensor_in_two_files(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    (path / "extra.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert "extra.safetensors" in str(err) and "model.safetensors" in str(err) and "model." in str(err)


def test_unsupported_quantization_is_refused(ckpt_copy):
    path = ckpt_copy("gpt_oss", config={"quantization_config": {"quant_method": "bitsandbytes"}})
    err = load_error(path)
    assert isinstance(err, CheckpointError)
    assert "bitsandbytes" in str(err) and "config.json" in str(err) and "mxfp4" in str(err)


# -- malformed metadata: typed errors, never a traceback -----------------------------------------------------


def _edit_json(path: Path, name: str, edit) -> None:
    file = path / name
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))


def test_config_that_is_not_an_object(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    (path / "config.json").write_text("[]")
    assert "expected a JSON object" in str(load_error(path))


def test_header_offsets_that_are_not_integers(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    file = path / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [str(begin), str(end)]  # 4 characters longer...
    header["lm_head.weight"]["dtype"] = 4  # ...and 4 shorter: every data offset stays where it was
    body = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(body) == n
    file.write_bytes(raw[:8] + body + raw[8 + n :])
    msg = str(load_error(path))
    assert "model.safetensors" in msg and "malformed" in msg
    assert name in msg or "lm_head.weight" in msg


def test_index_with_a_non_string_shard(tiny_ckpt, tmp_path):
    import shutil

    path = tmp_path / "sharded"
    shutil.copytree(tiny_ckpt("qwen3_moe", "sharded"), path)
    _edit_json(path, "model.safetensors.index.json", lambda d: {**d, "weight_map": {**d["weight_map"], "x": 3}})
    assert "weight_map must map tensor names to shard file names" in str(load_error(path))


def test_unknown_activation(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    _edit_json(path, "config.json", lambda d: {**d, "hidden_act": "wobble"})
    assert "'wobble'" in str(load_error(path))


def test_top_k_above_the_number_of_experts(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    _edit_json(path, "config.json", lambda d: {**d, "num_experts_per_tok": 7})
    msg = str(load_error(path))
    assert "num_experts_per_tok is 7" in msg and "6 experts" in msg


def test_auto_dtype_falls_back_to_the_stored_expert_dtype(tiny_ckpt, tmp_path):
    import shutil

    path = tmp_path / "nodtype"
    shutil.copytree(tiny_ckpt("qwen3_moe", "bf16"), path)
    _edit_json(path, "config.json", lambda d: {k: v for k, v in d.items() if k not in ("dtype", "torch_dtype")})
    engine = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu")))
    # read straight into bf16 slots: the only staging is the O_DIRECT bounce buffers (formats/diskio.py)
    assert engine.dtype == torch.bfloat16 and engine.store.staging_bytes == engine.stats()["disk_io"]["staging_bytes"]
    engine.close()


def test_failed_load_is_not_counted_as_a_miss(ckpt_copy):
    path = ckpt_copy("qwen3_moe")
    probe = moetier.load(path, CFG)
    one = probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    engine = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=one), runtime=CFG.runtime))
    store = engine.store
    from moetier.types import ExpertKey

    store.acquire(ExpertKey(0, 0))
    with pytest.raises(BudgetError):
        store.acquire(ExpertKey(0, 1))  # the only slot is pinned
    assert (store.host.hits, store.host.misses) == (0, 1)
    engine.close()
