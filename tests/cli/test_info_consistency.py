"""`moetier info` agrees with `moetier generate`: the same checks, the same messages.

Faults injected into private copies of a tiny qwen3_moe checkpoint (expert inner size 64, test_cli's
tokenizer): config.json contradicting the tensors (hidden size, layer count, vocabulary), a non-expert tensor
of the wrong shape, one stored as integers; and into its int4 tier: a truncated layer file, a layer file with
one byte changed (same size, wrong sha256), a missing one. A broken checkpoint is `error: <message>` with exit 2
from both commands, the message identical; a damaged tier is listed as damaged (not ok) with the reason that
loading it gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import _save_tokenizer, invoke, last_json

from moetier.models.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("info") / "qwen3_moe", moe_intermediate_size=64)
    _save_tokenizer(folder)
    return folder


@pytest.fixture
def model(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def error_line(result: Any) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def both_refuse(model: Path) -> str:
    """info and generate on `model`: both exit 2 with the same one-line error; that line."""
    info = error_line(invoke("info", model))
    assert error_line(invoke("info", model, "--json")) == info
    generate = error_line(invoke("generate", model, "--prompt", "ROMEO:", "--max-new-tokens", 2, "--device", "cpu"))
    assert info == generate
    return info


def edit_config(model: Path, **fields: Any) -> None:
    cfg = model / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | fields))


def edit_tensors(model: Path, **tensors: torch.Tensor) -> None:
    file = model / "model.safetensors"
    sd = load_file(file)
    sd.update({k.replace("__", "."): v for k, v in tensors.items()})
    save_file(sd, file, metadata={"format": "pt"})


def test_pristine_checkpoint_is_ok_in_both(model: Path) -> None:
    data = last_json(invoke("info", model, "--json"))
    assert (data["hidden_size"], data["num_layers"], data["expert_intermediate"]) == (32, 2, 64)
    result = invoke("generate", model, "--prompt", "ROMEO:", "--max-new-tokens", 2, "--device", "cpu")
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"hidden_size": 64}, ("has shape", "expected")),
        ({"num_hidden_layers": 1}, ("model.layers.1.", "config.json does not account for")),
        ({"vocab_size": 128}, ("model.embed_tokens.weight", "[96, 32]", "[128, 32]")),
        ({"num_attention_heads": 8}, ("self_attn.q_proj.weight", "has shape", "expected")),
    ],
)
def test_config_contradicting_the_tensors(model: Path, fields: dict[str, int], needles: tuple[str, ...]) -> None:
    edit_config(model, **fields)
    line = both_refuse(model)
    for needle in needles:
        assert needle in line, line


def test_misshaped_non_expert_tensor(model: Path) -> None:
    edit_tensors(model, model__norm__weight=torch.ones(33))
    line = both_refuse(model)
    assert "model.norm.weight" in line and "[33]" in line and "[32]" in line


def test_integer_non_expert_tensor(model: Path) -> None:
    edit_tensors(model, model__layers__0__input_layernorm__weight=torch.ones(32, dtype=torch.int32))
    line = both_refuse(model)
    assert "model.layers.0.input_layernorm.weight" in line and "torch.int32" in line


@pytest.fixture
def tiered(model: Path) -> Path:
    """The copy with its int4 tier, under MODEL/moetier-quant/int4-g128."""
    assert invoke("quantize", model, "--precisions", "int4").exit_code == 0
    return model / "moetier-quant" / "int4-g128"


def tier_rows(model: Path) -> list[dict[str, Any]]:
    return list(last_json(invoke("info", model, "--json"))["quantized_tiers"])


def run_int4(model: Path) -> Any:
    return invoke("generate", model, "--prompt", "ROMEO:", "--max-new-tokens", 2, "--device", "cpu",
                  "--precision", "int4")  # fmt: skip


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_tier_is_damaged_not_ok(model: Path, tiered: Path, damage: str) -> None:
    (row,) = tier_rows(model)
    assert row["status"] == "ok" and row["reason"] is None
    assert run_int4(model).exit_code == 0
    layer = tiered / "layer-001.safetensors"
    data = layer.read_bytes()
    if damage == "truncate":
        layer.write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        layer.write_bytes(data[:-50] + bytes([data[-50] ^ 0xFF]) + data[-49:])
    else:
        layer.unlink()
    (row,) = tier_rows(model)
    assert row["status"] == "damaged", row
    assert str(layer) in row["reason"] and "moetier quantize" in row["reason"]
    assert {"truncate": "truncated", "flip": "sha256", "delete": "missing"}[damage] in row["reason"]
    assert row["reason"] in error_line(run_int4(model))  # what loading it says, word for word
    text = invoke("info", model)
    assert text.exit_code == 0 and f"damaged: {row['reason']}" in text.stdout.replace("\n", "")


def test_stale_tier_says_why(model: Path, tiered: Path) -> None:
    file = model / "model.safetensors"
    with open(file, "r+b") as f:  # one byte in the middle, same size
        f.seek(file.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    (row,) = tier_rows(model)
    assert row["status"] == "stale" and f"{file} changed (data differs)" in row["stale_reason"]
    assert row["stale_reason"] in error_line(run_int4(model))
