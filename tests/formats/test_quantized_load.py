"""Quantised safetensors checkpoints end to end: FP8 block-scaled, MXFP4, GPTQ and AWQ tiny checkpoints load
with moetier.load and give the logits of the reference, all experts resident and at one slot per MoE layer.

References: FP8 and MXFP4 against transformers' own dequantising load of the same folder; GPTQ / AWQ (no
GPTQ library installs here) and ragged FP8 block grids (transformers 5 derives the block from the grid,
rows // grid rows, which is wrong when the block does not divide the weight) against the dequantised twin
(quant_ref.py: float64 dequantisation by the spec, saved as fp32, loaded by transformers).
Bad input (missing, mis-shaped or mistyped scales, a wrong block size, a truncated file, an unknown
method) gets a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quant_ref import TINY_OVERRIDES, VARIANTS, convert
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import CheckpointError, MoetierError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.safetensors import read_tensor
from moetier.models.tiny import build_tiny_checkpoint

ATOL = 1e-3
PROMPT = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(11))  # [1, T]
RUNTIME = RuntimeConfig(device="cpu", dtype="fp32", lean=False)

# (family, variant, reference): "hf" = transformers' dequantising load of the quantised folder, "twin" = the twin
CASES = [
    ("qwen3_moe", "fp8", "hf"),
    ("deepseek_v3", "fp8", "hf"),
    ("qwen3_moe", "fp8_128", "hf"),
    ("deepseek_v3", "fp8_ragged", "twin"),
    ("gpt_oss", "mxfp4", "hf"),
    ("mixtral", "gptq_v1_sym", "twin"),
    ("mixtral", "gptq_v1_asym_noidx", "twin"),
    ("qwen3_moe", "gptq_v2_actorder", "twin"),
    ("qwen3_moe", "awq", "twin"),
    ("deepseek_v3", "awq", "twin"),
    ("qwen3_moe", "ct_sym", "twin"),
    ("mixtral", "ct_asym", "twin"),
]


@pytest.fixture(scope="session")
def quant_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """quant_ckpt(family, variant) -> (quantised folder, dequantised twin folder); built once, read-only."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}
    root = tmp_path_factory.mktemp("quant")

    def get(family: str, variant: str) -> tuple[Path, Path]:
        if (family, variant) not in cache:
            method, opts = VARIANTS[variant]
            src = build_tiny_checkpoint(family, root / f"{family}_src_{variant}", **TINY_OVERRIDES.get(family, {}))
            quant, twin = root / f"{family}_{variant}", root / f"{family}_{variant}_twin"
            convert(src, quant, twin, method, **opts)
            cache[(family, variant)] = (quant, twin)
        return cache[(family, variant)]

    return get


@pytest.fixture
def quant_copy(quant_ckpt: Callable[[str, str], tuple[Path, Path]], tmp_path: Path) -> Callable[[str, str], Path]:
    """quant_copy(family, variant) -> a private, writable copy of a quantised tiny checkpoint."""

    def get(family: str, variant: str) -> Path:
        dst = tmp_path / f"{family}_{variant}"
        shutil.copytree(quant_ckpt(family, variant)[0], dst)
        return dst

    return get


def _engine(path: Path, budget: int | None = None) -> moetier.Engine:
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=RUNTIME))


@pytest.fixture(scope="module")
def reference(quant_ckpt):
    cache: dict[tuple[str, str, str], torch.Tensor] = {}

    def get(family: str, variant: str, kind: str) -> torch.Tensor:
        if (family, variant, kind) not in cache:
            quant, twin = quant_ckpt(family, variant)
            kw = {"quantization_config": Mxfp4Config(dequantize=True)} if variant == "mxfp4" else {}
            model = AutoModelForCausalLM.from_pretrained(quant if kind == "hf" else twin, dtype=torch.float32, **kw)
            with torch.no_grad():
                cache[(family, variant, kind)] = model.eval()(PROMPT).logits  # [1, T, V]
        return cache[(family, variant, kind)]

    return get


@pytest.mark.parametrize("budget", ["all", "per_layer"])
@pytest.mark.parametrize(("family", "variant", "ref"), CASES)
def test_logits_match_reference(quant_ckpt, reference, family, variant, ref, budget):
    quant, _ = quant_ckpt(family, variant)
    engine = _engine(quant)
    if budget == "per_layer":
        slot, staging, n_moe = engine.store.slot_bytes, engine.store.staging_bytes, len(engine.info.moe_layers)
        engine.close()
        engine = _engine(quant, n_moe * slot + staging)
        assert engine.store.host.pool.n_slots == n_moe
    out = engine.logits(PROMPT)
    diff = (out - reference(family, variant, ref)).abs().max().item()
    assert diff <= ATOL, diff
    if budget == "per_layer":
        assert engine.store.host.evictions > 0
        stats = engine.stats()
        assert stats["peak_host_expert_bytes"] + stats["staging_bytes"] <= n_moe * slot + staging
    engine.close()


@pytest.mark.parametrize(("family", "variant", "ref"), [("qwen3_moe", "fp8", "hf"), ("mixtral", "gptq_v1_sym", "twin")])
def test_lean_decoder_reads_dequantised_weights(quant_ckpt, reference, family, variant, ref):
    quant, _ = quant_ckpt(family, variant)
    engine = moetier.load(quant, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", lean=True)))
    diff = (engine.logits(PROMPT) - reference(family, variant, ref)).abs().max().item()
    engine.close()
    assert diff <= ATOL, diff


@pytest.mark.parametrize(("family", "variant", "codec"), [
    ("qwen3_moe", "fp8", "fp8_block:8x8"), ("gpt_oss", "mxfp4", "mxfp4"), ("mixtral", "gptq_v1_sym", "gptq4"),
    ("qwen3_moe", "awq", "awq4"),
])  # fmt: skip
def test_experts_are_indexed_encoded_and_counted_as_stored(quant_ckpt, family, variant, codec):
    quant, twin = quant_ckpt(family, variant)
    engine, plain = _engine(quant), _engine(twin)
    try:
        assert engine.info.checkpoint_dtype == codec
        assert engine.info.expert_bytes < plain.info.expert_bytes / 3  # stored bytes, not the fp32 twin's
        reader = engine.store.source.reader
        raw = max(r.nbytes for plan in reader.plans.values() for r in plan)  # the stored parts of one tensor
        assert engine.store.staging_bytes > raw  # staging counts the decode's float32 workspace as well
        assert engine.store.slot_bytes == plain.store.slot_bytes  # the slot holds the dequantised expert
    finally:
        engine.close()
        plain.close()


def test_read_tensor_decodes_non_expert_weights(quant_ckpt):
    quant, twin = quant_ckpt("deepseek_v3", "fp8")
    index = CheckpointIndex(quant, quantization=json.loads((quant / "config.json").read_text())["quantization_config"])
    twin_sd = load_file(twin / "model.safetensors")
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # FP8 attention projection [24, 32]
    assert index[name].encoded and index[name].dtype == "fp8_block:8x8" and index[name].shape == (24, 32)
    assert torch.equal(read_tensor(index[name]), twin_sd[name])
    norm = "model.layers.0.input_layernorm.weight"  # not quantised: read as stored
    assert not index[norm].encoded and torch.equal(read_tensor(index[norm]), twin_sd[norm])
    assert name + "_scale_inv" not in index  # consumed by the encoded tensor, reachable through its parts
    assert [p.name for p in index[name].parts] == [name, name + "_scale_inv"]


def test_index_without_quantization_lists_stored_tensors(quant_ckpt):
    quant, _ = quant_ckpt("gpt_oss", "mxfp4")
    plain = CheckpointIndex(quant)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name not in plain and plain[name + "_blocks"].dtype == "U8"


# -- bad input ------------------------------------------------------------------------------------------------


def _rewrite(path: Path, edit) -> Path:
    file = path / "model.safetensors"
    sd = load_file(file)
    edit(sd)
    save_file(sd, file, metadata={"format": "pt"})
    return file


def _edit_qcfg(path: Path, **fields) -> None:
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"] |= fields
    cfg_file.write_text(json.dumps(cfg))


def _error(path: Path) -> CheckpointError:
    with pytest.raises(MoetierError) as err:
        _engine(path)
    assert isinstance(err.value, CheckpointError), err.value
    return err.value


SCALE = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
WEIGHT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_fp8_missing_scale(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    file = _rewrite(path, lambda sd: sd.pop(SCALE))
    msg = str(_error(path))
    assert str(file) in msg and WEIGHT in msg and SCALE in msg and "missing" in msg


def test_fp8_misshaped_scale(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    file = _rewrite(path, lambda sd: sd.update({SCALE: sd[SCALE][:1].contiguous()}))
    msg = str(_error(path))
    assert str(file) in msg and SCALE in msg and "[1, 4]" in msg and "[2, 4]" in msg


def test_fp8_wrong_block_size(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")  # scale grids for 8x8 blocks
    _edit_qcfg(path, weight_block_size=[16, 16])
    msg = str(_error(path))
    assert "model.safetensors" in msg and "_scale_inv" in msg and "16x16" in msg and "block size" in msg


def test_fp8_scale_of_wrong_dtype(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    _rewrite(path, lambda sd: sd.update({SCALE: sd[SCALE].to(torch.int32)}))
    msg = str(_error(path))
    assert SCALE in msg and "I32" in msg


def test_fp8_orphan_scale(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    _rewrite(path, lambda sd: sd.update({WEIGHT: sd[WEIGHT].float()}))  # the weight stored unquantised
    assert SCALE in str(_error(path))


def test_fp8_without_block_size(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    _edit_qcfg(path, weight_block_size=None)
    msg = str(_error(path))
    assert "config.json" in msg and "weight_block_size" in msg


def test_mxfp4_misshaped_scales(quant_copy):
    path = quant_copy("gpt_oss", "mxfp4")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    _rewrite(path, lambda sd: sd.update({name: sd[name][:, :-1].contiguous()}))
    msg = str(_error(path))
    assert name in msg and "model.safetensors" in msg


def test_gptq_missing_zeros(quant_copy):
    path = quant_copy("mixtral", "gptq_v1_sym")
    name = "model.layers.0.block_sparse_moe.experts.2.w2"
    _rewrite(path, lambda sd: sd.pop(name + ".qzeros"))
    msg = str(_error(path))
    assert name + ".qweight" in msg and name + ".qzeros" in msg


def test_gptq_group_size_disagrees(quant_copy):
    path = quant_copy("mixtral", "gptq_v1_sym")  # group 8
    _edit_qcfg(path, group_size=16)
    msg = str(_error(path))
    assert ".scales" in msg and "group_size 16" in msg


@pytest.mark.parametrize(("variant", "fields", "words"), [
    ("gptq_v1_sym", {"bits": 8}, ("gptq", "bits=8", "4-bit")),
    ("gptq_v1_sym", {"checkpoint_format": "marlin"}, ("marlin", "gptq_v2")),
    ("awq", {"version": "gemv"}, ("gemv", "gemm")),
    ("awq", {"quant_method": "bitsandbytes"}, ("bitsandbytes", "fp8", "mxfp4", "gptq", "awq")),
])  # fmt: skip
def test_unsupported_settings_are_refused(quant_copy, variant, fields, words):
    path = quant_copy("mixtral" if variant.startswith("gptq") else "qwen3_moe", variant)
    _edit_qcfg(path, **fields)
    msg = str(_error(path))
    assert "config.json" in msg and all(w in msg for w in words), msg


def test_truncated_quantised_file(quant_copy):
    path = quant_copy("qwen3_moe", "fp8")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    msg = str(_error(path))
    assert str(file) in msg and "truncated" in msg
