"""The sparsity commands and flags: `moetier calibrate` writes the threshold table (with a JSON
report), `generate`/`eval --sparsity` use it and report the achieved sparsity; `--sparsity-scope` and
`--sparsity-dense` reach the config; bad values and missing or foreign tables exit 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import _save_tokenizer, assert_user_error, invoke, last_json

from moetier.kernels.sparse import default_table_path
from moetier.models.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("m") / "qwen3_moe", dtype=torch.bfloat16,
                                   moe_intermediate_size=64)  # fmt: skip
    _save_tokenizer(folder)
    return folder



@pytest.fixture(scope="module")
def calibrated(model: Path, text_file: Path) -> dict[str, object]:
    return last_json(invoke("calibrate", model, "--text", text_file, "--window", 32, "--json"))


def test_calibrate_writes_the_default_table(model: Path, calibrated: dict[str, object]) -> None:
    path = default_table_path(model)
    assert calibrated["table"] == str(path) and path.is_file()
    table = json.loads(path.read_text())
    assert table["format"] == "moetier-sparsity-table" and table["shared_experts"] == "dense"
    assert table["targets"][0] == 0 and table["targets"][-1] == 0.99 and 0.95 in table["targets"]
    for rows in table["thresholds"].values():
        assert set(rows) == {"1", "4", "8", "16", "32"}
        assert rows["1"] == sorted(rows["1"]) and rows["1"][0] == 0 and rows["1"][-1] > 0
    assert table["calibration"]["tokens"] == calibrated["tokens"]


def test_calibrate_out_file(model: Path, text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    data = last_json(invoke("calibrate", model, "--text", text_file, "--out", out, "--max-tokens", 40, "--json"))
    assert data["table"] == str(out) and out.is_file() and data["tokens"] == 40


def test_eval_and_generate_report_sparsity(model: Path, text_file: Path, calibrated: dict[str, object]) -> None:
    del calibrated
    dense = last_json(invoke("eval", model, "--text", text_file, "--window", 32, "--json"))
    base = ("eval", model, "--text", text_file, "--window", 32, "--sparsity", "0.7", "--json")
    sparse = last_json(invoke(*base, "--sparsity-dense", "masked"))  # the sparse model at every batch size
    sp = sparse["sparsity"]
    assert sp["target"] == 0.7 and abs(sp["achieved"] - 0.7) < 0.05, sp
    assert sp["dense_path"] == "masked" and sp["scope"] == "total" and sp["shared_neurons_per_token"] == 0
    assert sparse["ppl"] != dense["ppl"] and "sparsity" not in dense
    # the default dense path is the original expert: calls at or above the tipping point skip nothing (every
    # window's call here: one path a call, by its mean tokens per expert), calls below it all their experts' share
    default = last_json(invoke(*base, "--sparsity-tipping", "1"))["sparsity"]
    assert default["dense_path"] == "original" and default["tipping_source"] == "configured"
    assert default["achieved"] == 0.0
    below = last_json(invoke(*base, "--sparsity-tipping", "1000"))["sparsity"]
    assert below["dense_path"] == "original" and abs(below["achieved_masked"] - 0.7) < 0.05
    assert abs(below["achieved"] - below["achieved_masked"]) < 1e-9
    routed = last_json(invoke(*base, "--sparsity-scope", "routed"))["sparsity"]
    assert routed["scope"] == "routed" and routed["routed_target"] == 0.7
    gen = invoke("generate", model, "--prompt", "ROMEO:", "--max-new-tokens", 4, "--ignore-eos", "--sparsity", "0.5",
                 "--sparsity-block", "4", "--sparsity-tipping", "3")  # fmt: skip
    assert gen.exit_code == 0, (gen.stdout, gen.stderr)
    assert "sparsity target / achieved" in gen.stdout and "intra-expert sparsity per MoE layer" in gen.stdout
    assert "blocks of 4" in gen.stdout and "3 tokens per expert" in gen.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--sparsity", "0.97"), "Error"),  # click's range check
        (("--sparsity", "0.5", "--sparsity-block", "3"), "sparsity block must be one of"),
        (("--sparsity", "0.5", "--sparsity-table", "NOPE"), "moetier calibrate"),
        (("--sparsity", "0.5", "--precision", "int8"), "--for-sparsity"),
        (("--sparsity", "0.5", "--precision", "dynamic", "--lo", "int8"), "--precision dynamic"),
        (("--sparsity", "0.5", "--sparsity-tipping", "-1"), "Error"),
        (("--sparsity", "0.5", "--sparsity-scope", "shared"), "sparsity scope must be 'total' or 'routed'"),
        (("--sparsity", "0.5", "--sparsity-dense", "exact"), "dense path must be 'original' or 'masked'"),
    ],
)
def test_bad_sparsity_flags_exit_2(
    model: Path, text_file: Path, calibrated: dict[str, object], flags: tuple[str, ...], needle: str, tmp_path: Path
) -> None:
    del calibrated
    flags = tuple(str(tmp_path / "missing.json") if f == "NOPE" else f for f in flags)
    result = invoke("eval", model, "--text", text_file, *flags)
    assert_user_error(result, needle)


def test_foreign_table_is_refused(model: Path, text_file: Path, calibrated: dict[str, object], tmp_path: Path) -> None:
    other = build_tiny_checkpoint("qwen3_moe", tmp_path / "other", seed=7, dtype=torch.bfloat16,
                                  moe_intermediate_size=64)  # fmt: skip
    _save_tokenizer(other)
    result = invoke("eval", other, "--text", text_file, "--sparsity", "0.5", "--sparsity-table", calibrated["table"])
    assert_user_error(result, "error:", "calibrated for another model", "fingerprint")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_calibrate_errors(model: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert_user_error(invoke("calibrate", model, "--text", empty), "error:", "tokens")
    assert_user_error(invoke("calibrate", model, "--text", tmp_path / "none.txt"), "error:")
    assert_user_error(invoke("calibrate", model, "--text", empty, "--out", tmp_path), "error:", "is a directory")


def test_quantize_for_sparsity_then_eval(model: Path, text_file: Path, calibrated: dict[str, object]) -> None:
    del calibrated
    data = last_json(invoke("quantize", model, "--precisions", "int4", "--group", "int4=32", "--method", "rtn",
                            "--for-sparsity", "--json"))  # fmt: skip
    (tier,) = data["tiers"]
    assert tier["path"].endswith("int4-g32-rows") and Path(tier["path"], "manifest.json").is_file()
    out = last_json(invoke("eval", model, "--text", text_file, "--window", 32, "--precision", "int4", "--group",
                           "int4=32", "--sparsity", "0.6", "--sparsity-dense", "masked", "--json"))  # fmt: skip
    assert out["precision"]["int4"]["experts"] > 0
    assert abs(out["sparsity"]["achieved"] - 0.6) < 0.1, out["sparsity"]
    # the original dense path on quantized rows: the unmasked expert on dequantised weights
    orig = last_json(invoke("eval", model, "--text", text_file, "--window", 32, "--precision", "int4", "--group",
                            "int4=32", "--sparsity", "0.6", "--sparsity-tipping", "0", "--json"))  # fmt: skip
    assert orig["sparsity"]["achieved"] == 0.0 and orig["ppl"] != out["ppl"]


def test_info_shows_the_sparsity_table(model: Path, calibrated: dict[str, object], tmp_path: Path) -> None:
    data = last_json(invoke("info", model, "--json"))
    table = data["sparsity_table"]
    assert table["path"] == calibrated["table"] and table["status"] == "ok"
    assert table["tokens"] == calibrated["tokens"]
    other = build_tiny_checkpoint("qwen3_moe", tmp_path / "o", seed=5, dtype=torch.bfloat16, moe_intermediate_size=64)
    assert last_json(invoke("info", other, "--json"))["sparsity_table"] is None
    foreign = default_table_path(other)
    foreign.parent.mkdir(parents=True)
    foreign.write_text(Path(str(calibrated["table"])).read_text())
    status = last_json(invoke("info", other, "--json"))["sparsity_table"]["status"]
    assert status.startswith("refused:") and "another model" in status
