"""The bundled trained model (models/tiny-shakespeare-moe): real routing, real text.

It is committed to the repo, so these tests fail (rather than skip) when it is missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moetier
from moetier import traces

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
HELDOUT = ROOT / "data" / "shakespeare_heldout.txt"


def _engine(budget_slots: int | None, dtype: str = "fp32", lean: bool = True) -> moetier.Engine:
    probe = moetier.load(MODEL, moetier.EngineConfig(runtime=moetier.RuntimeConfig(dtype=dtype)))  # type: ignore[arg-type]
    budget = None if budget_slots is None else budget_slots * probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    cfg = moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget),
        runtime=moetier.RuntimeConfig(dtype=dtype, lean=lean),  # type: ignore[arg-type]
    )
    return moetier.load(MODEL, cfg)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    engine = _engine(None)
    ids = engine.encode(HELDOUT.read_text(encoding="utf-8")[:4000])
    engine.close()
    return ids


def test_bundled_model_is_a_real_moe() -> None:
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert cfg["num_hidden_layers"] >= 4 and experts >= 16 and cfg["num_experts_per_tok"] >= 2
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size <= 40 * 2**20, f"bundled model is {size} bytes, over 40 MB"


@pytest.mark.parametrize("slots", [None, 4, 1])
@pytest.mark.parametrize("lean", [True, False])
def test_bundled_logits_equal_transformers(reference: torch.nn.Module, heldout_ids: list[int], slots, lean) -> None:
    ids = torch.tensor([heldout_ids[:96]])
    with torch.no_grad():
        want = reference(ids).logits
    engine = _engine(slots, lean=lean)
    got = engine.logits(ids)
    stats = engine.stats()
    engine.close()
    assert (got - want).abs().max().item() <= 1e-4
    if slots is not None:
        assert stats["misses"] > stats["tiers"]["host"]["slots"]  # it really streamed experts from disk


def test_bundled_perplexity_is_good_and_matches_reference(reference: torch.nn.Module, heldout_ids: list[int]) -> None:
    ids = heldout_ids[:257]
    engine = _engine(2)
    result = engine.perplexity(ids)
    engine.close()
    with torch.no_grad():
        logits = reference(torch.tensor([ids[:-1]])).logits[0]
    ref_ppl = math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())
    assert result.tokens == 256
    assert abs(result.ppl - ref_ppl) / ref_ppl < 1e-4
    assert result.ppl < 200  # a trained model, far from uniform over its vocabulary


def test_bundled_generation_and_trace(tmp_path: Path) -> None:
    engine = _engine(4, dtype="bf16")
    engine.record_trace(tmp_path / "t.parquet", with_scores=True)
    res = engine.generate("ROMEO:", max_new_tokens=24, stop_at_eos=False)
    engine.close()
    assert len(res.token_ids) == 24 and res.text.strip()
    trace = traces.load(tmp_path / "t.parquet")
    layers = trace.metadata["moe_layers"]
    assert len(trace) == (res.prompt_tokens + 23) * len(layers)
    used = {e for row in trace.table.column("experts").to_pylist() for e in row}
    assert len(used) > trace.metadata["top_k"] * 2  # trained routing spreads over many experts
