"""Model specs: the shipped files (numbers checked against the public configs), reading HF checkpoint
folders of every family moetier knows, byte counts, validation and trace metadata."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from moetier import config
from moetier.errors import ConfigError
from moetier.models.tiny import _COMMON, TINY
from moetier.policies import hwprofile
from moetier.specs import (
    SHIPPED_SPECS,
    ModelSpec,
    load_spec,
    spec_from_hf_config,
    spec_from_trace_metadata,
    spec_names,
)
from moetier.types import GGML_PRECISIONS, PRECISION_BITS

ROOT = Path(__file__).resolve().parents[1]
PAPER_SPECS = ("mixtral-8x7b", "qwen2-57b-a14b", "deepseek-v2-lite", "deepseek-v2", "qwen3-30b-a3b",
               "qwen3-235b-a22b", "glm-4.5-air")  # fmt: skip


def test_shipped_specs_load_with_sources() -> None:
    names = spec_names()
    assert set(PAPER_SPECS) | {"tiny-shakespeare-moe", "qwen3moe-bench"} <= set(names)
    for n in PAPER_SPECS:
        s = load_spec(n)
        assert s.name == n and s.source.startswith("https://huggingface.co/") and s.source.endswith("config.json")


@pytest.mark.parametrize(
    ("name", "layers", "moe0", "experts", "k", "shared", "hidden", "inter", "shared_inter", "heads", "kv"),
    [
        ("mixtral-8x7b", 32, 0, 8, 2, 0, 4096, 14336, 0, 32, 8),
        ("qwen2-57b-a14b", 28, 0, 64, 8, 1, 3584, 2560, 20480, 28, 4),
        ("deepseek-v2-lite", 27, 1, 64, 6, 2, 2048, 1408, 1408, 16, 16),
        ("deepseek-v2", 60, 1, 160, 6, 2, 5120, 1536, 1536, 128, 128),
        ("qwen3-30b-a3b", 48, 0, 128, 8, 0, 2048, 768, 0, 32, 4),
        ("qwen3-235b-a22b", 94, 0, 128, 8, 0, 4096, 1536, 0, 64, 4),
        ("glm-4.5-air", 46, 1, 128, 8, 1, 4096, 1408, 1408, 96, 8),
    ],
)
def test_paper_spec_numbers(
    name: str, layers: int, moe0: int, experts: int, k: int, shared: int, hidden: int, inter: int,
    shared_inter: int, heads: int, kv: int,
) -> None:  # fmt: skip
    s = load_spec(name)
    got = (s.num_layers, s.moe_layers[0], s.num_experts, s.top_k, s.num_shared, s.hidden, s.moe_inter,
           s.shared_inter, s.num_heads, s.num_kv_heads)  # fmt: skip
    assert got == (layers, moe0, experts, k, shared, hidden, inter, shared_inter, heads, kv)
    assert s.moe_layers == tuple(range(moe0, layers))
    assert (s.dense_inter > 0) == (moe0 > 0)
    assert s.expert_bytes() == 3 * hidden * inter * 2
    assert s.total_expert_bytes == (layers - moe0) * experts * s.expert_bytes()


def test_known_totals_and_attention() -> None:
    # routed-expert params: Mixtral ~45B of 46.7B; Qwen3-235B ~227B of 235B; DeepSeek-V2 ~222B of 236B
    assert load_spec("mixtral-8x7b").total_expert_bytes / 2 == pytest.approx(45.1e9, rel=0.01)
    assert load_spec("qwen3-235b-a22b").total_expert_bytes / 2 == pytest.approx(227e9, rel=0.01)
    v2 = load_spec("deepseek-v2")
    assert v2.attention == "mla" and (v2.q_lora_rank, v2.kv_lora_rank, v2.qk_rope_dim) == (1536, 512, 64)
    assert v2.kv_bytes_per_token() == (512 + 64) * 2  # the compressed latent, not 128 heads of K and V
    assert load_spec("mixtral-8x7b").kv_bytes_per_token() == 2 * 8 * 128 * 2
    # the bundled model's quantised expert bytes follow formats/quant.py (int8 per row, int4 groups of 128)
    tiny = load_spec("tiny-shakespeare-moe")
    h, i = 256, 128
    assert tiny.expert_bytes("int8") == 3 * h * i + (2 * i + h) * 4
    assert tiny.expert_bytes("int4") == 3 * h * i // 2 + (2 * i * (h // 128) + h * (i // 128)) * 4
    with pytest.raises(ConfigError, match="unknown precision"):
        tiny.expert_bytes("fp8")


def test_bundled_and_bench_specs_match_their_configs() -> None:
    folder = load_spec(str(ROOT / "models" / "tiny-shakespeare-moe"))
    shipped = load_spec("tiny-shakespeare-moe")
    assert folder.to_dict() | {"name": "", "source": ""} == shipped.to_dict() | {"name": "", "source": ""}
    spec_ = importlib.util.spec_from_file_location("bench_models", ROOT / "benchmarks" / "_models.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    bench = spec_from_hf_config(dict(mod.BENCH_CONFIG, model_type="qwen3_moe"), "qwen3moe-bench", "x")
    assert bench.to_dict() | {"source": ""} == load_spec("qwen3moe-bench").to_dict() | {"source": ""}


def _hf_folder(tmp: Path, model_type: str, **over: Any) -> Path:
    AutoConfig.for_model(model_type, **{**_COMMON, **TINY[model_type], **over}).save_pretrained(tmp)
    return tmp


@pytest.mark.parametrize("family", sorted(TINY))
def test_hf_checkpoint_folders_of_every_family(tmp_path: Path, family: str) -> None:
    s = load_spec(str(_hf_folder(tmp_path, family)))
    kw = TINY[family]
    assert s.hidden == 32 and s.top_k == 2
    assert s.num_experts == kw.get("num_experts", kw.get("num_local_experts", kw.get("n_routed_experts")))
    assert s.moe_inter == kw.get("moe_intermediate_size", kw["intermediate_size"])
    if family == "qwen2_moe":
        assert (s.num_shared, s.shared_inter) == (1, 24)
    if family.startswith("deepseek"):
        assert s.attention == "mla" and s.moe_layers == (1, 2) and s.dense_inter == 48
        assert (s.num_shared, s.shared_inter) == (1, 16)
    else:
        assert s.moe_layers == (0, 1) and s.num_shared == (1 if family == "qwen2_moe" else 0)


def test_qwen_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    cfg = {**_COMMON, **TINY["qwen2_moe"], "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    s = spec_from_hf_config(dict(cfg, model_type="qwen2_moe"), "q", "x")
    assert s.moe_layers == (1, 5) and s.dense_inter == 48


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model spec 'gpt-5'; known: .*mixtral-8x7b"):
        load_spec("gpt-5")
    good = load_spec("mixtral-8x7b").to_dict()
    cases = (("top_k", 9, "top_k 9 > num_experts 8"), ("hidden", 0, "hidden must be > 0"),
             ("moe_layers", [0, 40], "moe_layers must be"), ("num_shared", 1, "both be 0"),
             ("attention", "mqa", "attention must be"), ("vocab", 1.5, "vocab must be an int"))  # fmt: skip
    for key, bad, msg in cases:
        (tmp_path / "s.json").write_text(json.dumps(good | {key: bad}))
        with pytest.raises(ConfigError, match=msg):
            load_spec(str(tmp_path / "s.json"))
    (tmp_path / "s.json").write_text(json.dumps(good | {"experts": 3}))
    with pytest.raises(ConfigError, match="unknown spec keys"):
        load_spec(str(tmp_path / "s.json"))
    del good["hidden"]
    (tmp_path / "s.json").write_text(json.dumps(good))
    with pytest.raises(ConfigError, match="missing spec keys"):
        load_spec(str(tmp_path / "s.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"without config\.json"):
        load_spec(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="no spec reader"):
        spec_from_hf_config({"model_type": "llama"}, "l", "x")


def test_spec_from_trace_metadata(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "my-moe", "olmoe")
    assert spec_from_trace_metadata({"model": str(folder)}) == load_spec(str(folder))
    assert spec_from_trace_metadata({"model": "models/tiny-shakespeare-moe"}) == load_spec("tiny-shakespeare-moe")
    meta = {"model": "/x/other", "num_experts": 16, "top_k": 2, "hidden_size": 128, "moe_intermediate_size": 64,
            "dtype": "bfloat16", "num_layers": 3, "moe_layers": [1, 2]}  # fmt: skip
    s = spec_from_trace_metadata(meta)
    assert isinstance(s, ModelSpec)
    assert (s.num_layers, s.moe_layers, s.num_experts, s.top_k, s.hidden, s.moe_inter) == (3, (1, 2), 16, 2, 128, 64)
    assert spec_from_trace_metadata({"model": "x", "top_k": 2}) is None


def test_one_precision_bit_table_and_full_bytes_use_the_dtype() -> None:
    """config, hwprofile and specs read types.PRECISION_BITS; a full-precision expert is priced at the model's
    dtype (not at the table's 16 bits), a quantised one at its bits plus a bf16 scale and zero per group."""
    assert dict(PRECISION_BITS) == {"full": 16, "int8": 8, "int4": 4, "int2": 2}
    assert hwprofile.PRECISIONS == ("full", "int8", "int4", "int2")
    # config's precisions: this table's and ggml's block types (types.GGML_PRECISIONS, bits from the same module)
    assert (*PRECISION_BITS, *GGML_PRECISIONS) == config.TIER_PRECISIONS
    s = load_spec("mixtral-8x7b")
    h, i = s.hidden, s.moe_inter
    for dtype_bytes in (2, 4):
        assert replace(s, dtype_bytes=dtype_bytes).expert_bytes("full") == 3 * h * i * dtype_bytes
    assert s.expert_bytes("int4") == 3 * h * i // 2 + (2 * i * (h // 128) + h * (i // 128)) * 4
    with pytest.raises(ConfigError, match="expected one of full, int8, int4, int2"):
        s.expert_bytes("fp8")


def test_specs_ship_inside_the_package() -> None:
    assert {f"{n}.json" for n in spec_names()} == {e.name for e in SHIPPED_SPECS.iterdir() if e.name.endswith(".json")}
    assert not (ROOT / "specs").exists()  # moved to src/moetier/data/specs (package data)
