"""Config variants the default tiny checkpoints leave off: each must stay exact, fall back, or be refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import moetier
from moetier.errors import CheckpointError
from moetier.models.tiny import build_tiny_checkpoint

IDS = torch.tensor([[5, 17, 33, 2, 71, 9, 40, 88, 12, 63, 7, 25]])


def _rewrite(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _randomize_biases(path: Path) -> None:
    g = torch.Generator().manual_seed(0)

    def edit(t: dict[str, torch.Tensor]) -> None:
        for name in t:
            if name.endswith("proj.bias") and "self_attn" in name:
                t[name] = torch.randn(t[name].shape, generator=g)

    _rewrite(path, edit)


def _engine(path: Path, dtype: str = "fp32", lean: bool = True) -> moetier.Engine:
    cfg = moetier.EngineConfig(
        budgets=moetier.Budgets(), runtime=moetier.RuntimeConfig(device="cpu", dtype=dtype, lean=lean)  # type: ignore[arg-type]
    )
    return moetier.load(path, cfg)


def _assert_exact(path: Path, decoder: str) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(IDS).logits
    engine = _engine(path)
    assert type(engine.decoder).__name__ == decoder
    got = engine.logits(IDS)
    engine.close()
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_including_output_projection(tmp_path: Path, family: str) -> None:
    path = build_tiny_checkpoint(family, tmp_path, attention_bias=True)
    _randomize_biases(path)  # transformers initialises them to zero, which would hide a dropped bias
    _assert_exact(path, "LeanDecoder")


def test_olmoe_clip_qkv_after_the_norm(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("olmoe", tmp_path, clip_qkv=0.5)
    _assert_exact(path, "LeanDecoder")


def test_longrope_falls_back_to_transformers_modules(tmp_path: Path) -> None:
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 64}  # fmt: skip
    path = build_tiny_checkpoint("qwen3_moe", tmp_path, rope_parameters=rope)
    _assert_exact(path, "HFDecoder")


def test_deepseek_v3_mtp_tensors_are_ignored_like_transformers(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("deepseek_v3", tmp_path)

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.61.enorm.weight"] = torch.ones(32)
        t["model.layers.61.eh_proj.weight"] = torch.zeros(32, 64)

    _rewrite(path, add)
    _assert_exact(path, "HFDecoder")
    _rewrite(path, lambda t: t.__setitem__("model.layers.2.stray.weight", torch.ones(3)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.stray\.weight"):
        _engine(path)


def test_deepseek_v3_correction_bias_stays_fp32(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("deepseek_v3", tmp_path)
    engine = _engine(path, dtype="bf16")
    biases = [b for n, b in engine.loaded.model.named_buffers() if n.endswith("e_score_correction_bias")]
    engine.close()
    assert biases and all(b.dtype == torch.float32 for b in biases)


def test_integer_tensor_where_a_float_one_belongs(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("qwen3_moe", tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.norm.weight", torch.ones(32, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*int32"):
        _engine(path)
