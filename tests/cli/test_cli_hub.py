"""MODEL as a Hugging Face hub id on the command line, offline: a tiny checkpoint placed in a hub cache laid out
as huggingface_hub lays it out (tests/hub_cache.py); what moetier writes for it goes to its moetier cache folder,
never into the read-only snapshot."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
from test_cli import assert_user_error, invoke, last_json

from hub_cache import cache_checkpoint
from moetier.cli.model_arg import ModelArg, moetier_cache
from moetier.config import EngineConfig, PrecisionConfig
from moetier.models.hub import HubSpec
from moetier.models.tiny import build_tiny_checkpoint

COMMIT = "c" * 40


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiny qwen3_moe cached as acme/tiny-moe (main -> COMMIT); HF_HUB_CACHE and MOETIER_CACHE under tmp_path."""
    cache = tmp_path / "hf-cache"
    cache_checkpoint(cache, "acme/tiny-moe", build_tiny_checkpoint("qwen3_moe", tmp_path / "src"), COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))  # huggingface_hub read the variable on import
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path / "moetier-cache"))
    return cache


def test_info_of_a_hub_id_offline(hub_cache: Path) -> None:
    data = last_json(invoke("info", "acme/tiny-moe", "--json"))
    local = last_json(invoke("info", hub_cache / "models--acme--tiny-moe" / "snapshots" / COMMIT, "--json"))
    assert data["num_experts"] == 6 and data["family"] == local["family"]
    assert data["total_expert_bytes"] == local["total_expert_bytes"] and data["quantized_tiers"] == []
    human = invoke("info", "acme/tiny-moe@main")
    assert human.exit_code == 0 and "qwen3_moe" in human.stdout


def test_quantize_a_hub_id_writes_to_the_moetier_cache(hub_cache: Path, tmp_path: Path) -> None:
    data = last_json(invoke("quantize", "acme/tiny-moe", "--precisions", "int8", "--json"))
    work = tmp_path / "moetier-cache" / "hub" / "acme--tiny-moe"
    assert data["model"] == "acme/tiny-moe" and Path(data["tiers"][0]["path"]).parent == work / "moetier-quant"
    assert not list(hub_cache.rglob("moetier-quant"))  # nothing written into the hub's cache
    tiers = last_json(invoke("info", "acme/tiny-moe", "--json"))["quantized_tiers"]
    assert [t["precision"] for t in tiers] == ["int8"]


def test_hub_id_errors_offline(hub_cache: Path) -> None:
    assert_user_error(invoke("info", "acme/absent"), "error:", "acme/absent", "not in the Hugging Face cache",
                      "HF_HUB_OFFLINE")  # fmt: skip
    assert_user_error(invoke("info", "acme/tiny-moe@v9"), "error:", "revision v9")
    assert_user_error(invoke("info", "not a model"), "error:", "neither an existing path nor a Hugging Face hub id")


def test_hub_defaults_fill_only_what_the_flags_left_out(tmp_path: Path) -> None:
    arg = ModelArg("acme/m", tmp_path / "snap", HubSpec("acme/m"), tmp_path / "work")
    cfg = arg.defaults(EngineConfig())
    assert cfg.precision.quant_dir == str(tmp_path / "work" / "moetier-quant")
    assert cfg.sparsity.table == str(tmp_path / "work" / "moetier-sparsity" / "thresholds.json")
    mine = EngineConfig(precision=PrecisionConfig(quant_dir="/mine"))
    assert arg.defaults(mine).precision.quant_dir == "/mine"
    local = ModelArg("m", tmp_path, None, tmp_path)
    assert local.defaults(EngineConfig()) == EngineConfig() and local.quant_root is None


def test_moetier_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETIER_CACHE", raising=False)
    assert moetier_cache() == Path.home() / ".cache" / "moetier"
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    assert moetier_cache() == tmp_path and moetier_cache(tmp_path / "flag") == tmp_path / "flag"
