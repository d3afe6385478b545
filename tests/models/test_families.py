"""The family table: lookup, validation, unknown architectures, and a new family added as one row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moetier
import moetier.models.families as families
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import UnknownArchitectureError
from moetier.models.families import FAMILIES, ExpertSource, Family, find_family
from moetier.models.tiny import TINY

RUNTIME = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
ARCHS = {
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}  # fmt: skip


def row(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def test_every_tiny_family_has_a_row():
    assert {f.name for f in FAMILIES} >= set(TINY)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_lookup_by_architecture_and_by_model_type(name):
    assert find_family("something_else", [ARCHS[name]]).name == name  # architecture wins
    assert find_family(name, None).name == name
    assert find_family(name, ["NotAModel"]).name == name  # unknown architecture, known model_type


@pytest.mark.parametrize(("model_type", "archs"), [
    ("llama", ["LlamaForCausalLM"]),  # a dense model: no MoE family
    ("foo_moe", ["FooMoeForCausalLM"]),
    (None, None),
])  # fmt: skip
def test_unknown_architecture_names_it(model_type, archs):
    with pytest.raises(UnknownArchitectureError) as err:
        find_family(model_type, archs)
    msg = str(err.value)
    for part in [*(archs or []), str(model_type)]:
        assert part in msg
    assert "MixtralForCausalLM" in msg  # and says what is known


def test_row_validation():
    good = row("qwen3_moe")
    with pytest.raises(ValueError, match="unknown op"):
        dataclasses.replace(good, sources={**good.sources, "gate": ExpertSource("experts.{e}.w1.weight", "flip")})
    with pytest.raises(ValueError, match="'down'"):
        dataclasses.replace(good, sources={k: v for k, v in good.sources.items() if k != "down"})
    assert ExpertSource("experts.gate_up_proj").fused and not ExpertSource("experts.{e}.w1.weight").fused


def test_dense_model_is_refused_by_load(ckpt_copy):
    path = ckpt_copy("qwen3_moe", config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(UnknownArchitectureError, match="LlamaForCausalLM"):
        moetier.load(path, EngineConfig(runtime=RUNTIME))


@pytest.mark.parametrize("budget_slots", [None, 1])
def test_new_family_is_one_row(ckpt_copy, hf_model, monkeypatch, budget_slots):
    """A family 'added by a row': a copy of the qwen3_moe row under a new name and architecture."""
    # model_type stays qwen3_moe for transformers
    path = ckpt_copy("qwen3_moe", config={"architectures": ["FakeTierMoeForCausalLM"]})
    new = dataclasses.replace(row("qwen3_moe"), name="fake_tier_moe", architectures=("FakeTierMoeForCausalLM",))
    monkeypatch.setattr(families, "FAMILIES", (new, *FAMILIES))
    assert find_family("qwen3_moe", ["FakeTierMoeForCausalLM"]) is new

    probe = moetier.load(path, EngineConfig(runtime=RUNTIME))
    budget = None if budget_slots is None else budget_slots * probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    engine = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=RUNTIME))
    assert engine.info.family == "fake_tier_moe"
    assert engine.loaded.family is new
    assert engine.info.architecture == "FakeTierMoeForCausalLM"
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf_model("qwen3_moe")(ids).logits  # same weights, the original folder
    assert (engine.logits(ids) - ref).abs().max().item() <= 1e-4
    engine.close()


def test_new_row_is_needed(ckpt_copy):
    """Without the row, an unknown architecture whose model_type is also unknown is refused."""
    path = ckpt_copy("qwen3_moe", config={"architectures": ["FakeTierMoeForCausalLM"],
                                          "model_type": "fake_tier_moe"})  # fmt: skip
    with pytest.raises(UnknownArchitectureError, match="FakeTierMoeForCausalLM"):
        moetier.load(path, EngineConfig(runtime=RUNTIME))
