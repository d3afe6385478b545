"""Composite (vision + text) checkpoints: moetier runs the text model (models/open.py `text_model_view`).

Qwen3.5-MoE, Qwen4-Exp and Aria publish their MoE language models inside a ForConditionalGeneration checkpoint
(`model.language_model.*` or `language_model.model.*`, beside a vision tower and a projector). Each is built tiny
(its text model from models/tiny.py, a one-layer vision tower), saved by transformers, and loaded by moetier from
the folder as published: fp32 logits of a text-only prompt within 1e-4 of transformers' own composite model; the
vision tensors are set aside, named in the index, and any other tensor the text model does not consume is still
refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import CheckpointError
from moetier.models.open import open_index
from moetier.models.tiny import tiny_config

RUNTIME = RuntimeConfig(device="cpu", dtype="fp32")
# vision-tower sizes, where the family's vision config has the field
VISION = dict(depth=1, num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_heads=2, num_attention_heads=2,
              num_key_value_heads=2, patch_size=4, temporal_patch_size=1, spatial_merge_size=1, in_channels=3,
              head_dim=16)  # fmt: skip
COMPOSITES = [("qwen3_5_moe", "qwen3_5_moe_text"), ("qwen4_exp", "qwen4_exp_text"), ("aria", "aria_text")]


def _composite(model_type: str, text_type: str, out: Path) -> torch.nn.Module:
    text = tiny_config(text_type).to_dict()
    vision = AutoConfig.for_model(model_type).vision_config.to_dict()
    vision.update({k: v for k, v in VISION.items() if k in vision})
    for k in ("out_hidden_size", "projection_dim"):
        if k in vision:
            vision[k] = text["hidden_size"]
    cfg = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=False)
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    cfg.architectures = [cls]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).float().eval()
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize(("model_type", "text_type"), COMPOSITES)
def test_composite_checkpoint_runs_its_text_model_exactly(tmp_path: Path, model_type: str, text_type: str) -> None:
    model = _composite(model_type, text_type, tmp_path / model_type)
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with moetier.load(tmp_path / model_type, EngineConfig(runtime=RUNTIME)) as engine:
        got = engine.logits(ids)
        assert engine.info.architecture == MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))
    index = open_index(tmp_path / model_type)
    assert index.set_aside and all("language_model" not in n for n in index.set_aside)
    assert not any(n.startswith(("model.language_model.", "language_model.")) for n in index.names())


def test_a_composites_unknown_tensor_is_still_refused(tmp_path: Path) -> None:
    folder = tmp_path / "qwen3_5_moe"
    _composite("qwen3_5_moe", "qwen3_5_moe_text", folder)
    sd = load_file(folder / "model.safetensors")
    sd["model.language_model.extra.weight"] = torch.zeros(2, 2)  # in the text model's names, consumed by nothing
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"extra\.weight"):
        moetier.load(folder, EngineConfig(runtime=RUNTIME))
