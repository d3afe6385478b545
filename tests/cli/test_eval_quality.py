"""`moetier eval --kl-ref full|FILE` and `--save-logits FILE` (KL divergence and top-1 agreement against a
reference), and eval's default window (a model's declared train_window), on test_cli's tiny checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from test_cli import _save_tokenizer, assert_user_error, invoke, last_json

from moetier.models.tiny import build_tiny_checkpoint

KL_FIELDS = {"kl_ref", "kl_tokens", "kl_mean", "kl_stderr", "kl_median", "kl_p99", "kl_max", "top1_pct", "ref_ppl"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny") / "qwen3_moe")
    _save_tokenizer(folder)
    return folder


def test_kl_ref_full_of_the_reference_itself_is_zero(tiny: Path, text_file: Path) -> None:
    plain = last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "fp32", "--json"))
    data = last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "fp32", "--kl-ref", "full",
                            "--json"))  # fmt: skip
    assert KL_FIELDS.issubset(data) and data["kl_ref"] == "full"
    assert data["kl_tokens"] == data["tokens"] == plain["tokens"]
    assert data["top1_pct"] == 100.0 and data["kl_max"] < 1e-5 and data["kl_mean"] >= -1e-9
    assert data["ppl"] == pytest.approx(plain["ppl"], rel=1e-6) and data["ref_ppl"] == pytest.approx(plain["ppl"])


def test_kl_ref_full_of_a_bf16_candidate(tiny: Path, text_file: Path) -> None:
    ref = last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "fp32", "--json"))
    data = last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "bf16", "--kl-ref", "full",
                            "--host-expert-mem", "24KiB", "--json"))  # fmt: skip
    assert data["dtype"] == "bfloat16" and data["misses"] > 0
    assert 0 < data["kl_mean"] < 0.05 and data["kl_median"] <= data["kl_p99"] <= data["kl_max"]
    assert data["kl_stderr"] > 0 and 50 <= data["top1_pct"] <= 100
    assert data["ref_ppl"] == pytest.approx(ref["ppl"], rel=1e-6) and data["ppl"] != data["ref_ppl"]


def test_save_logits_then_kl_ref_file_equals_kl_ref_full(tiny: Path, text_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "ref.safetensors"
    saved = last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "fp32", "--save-logits",
                             path, "--json"))  # fmt: skip
    assert path.is_file() and saved["saved_logits"] == str(path) and "kl_mean" not in saved
    args = ("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "bf16", "--json")
    from_file = last_json(invoke(*args, "--kl-ref", path))
    full = last_json(invoke(*args, "--kl-ref", "full"))
    assert from_file["kl_ref"] == str(path) and from_file["ref_ppl"] == pytest.approx(saved["ppl"], rel=1e-6)
    for key in ("kl_mean", "kl_median", "kl_p99", "top1_pct", "ref_ppl", "ppl"):
        assert from_file[key] == pytest.approx(full[key], rel=1e-6, abs=1e-9), key
    human = invoke("eval", tiny, "--text", text_file, "--window", 16, "--kl-ref", path)
    assert human.exit_code == 0, (human.stderr, human.exception)
    assert "KL divergence vs" in human.stdout and "top-1 agreement" in human.stdout


def test_kl_from_scores_the_later_positions_of_each_window(tiny: Path, text_file: Path) -> None:
    """--kl-from 8 of windows of 16: a window's positions 8-15 of its 16 scored ones (llama-perplexity's second
    half), each figure over those only (both perplexities too); --kl-from past every position is an error."""
    base = ("eval", tiny, "--text", text_file, "--window", 16, "--dtype", "bf16", "--kl-ref", "full", "--json")
    every, later = last_json(invoke(*base)), last_json(invoke(*base, "--kl-from", 8))
    full, rest = divmod(every["tokens"], 16)  # whole windows of 16 scored positions, and a shorter last one
    assert later["tokens"] == 8 * full + max(0, rest - 8) and later["kl_from"] == 8
    assert later["kl_mean"] != pytest.approx(every["kl_mean"], rel=1e-9) and later["kl_mean"] > 0
    assert later["ref_ppl"] != pytest.approx(every["ref_ppl"], rel=1e-6)  # the reference over the same positions
    assert_user_error(invoke(*base, "--kl-from", 16), "error:", "no position of any window")
    no_ref = invoke("eval", tiny, "--text", text_file, "--kl-from", 8)
    assert_user_error(no_ref, "error:", "--kl-from goes with --kl-ref")


def test_kl_ref_file_of_another_model_text_or_window(tiny: Path, text_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "ref.safetensors"
    last_json(invoke("eval", tiny, "--text", text_file, "--window", 16, "--save-logits", path, "--json"))
    base = ("eval", tiny, "--text", text_file)
    assert_user_error(invoke(*base, "--window", 8, "--kl-ref", path), "error:", str(path), "other windows")
    assert_user_error(invoke(*base, "--window", 16, "--max-tokens", 20, "--kl-ref", path), "error:", str(path),
                      "another text")  # fmt: skip
    other_text = tmp_path / "other.txt"
    other_text.write_text(text_file.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    assert_user_error(invoke("eval", tiny, "--text", other_text, "--window", 16, "--kl-ref", path), "error:",
                      "another text")  # fmt: skip
    other = build_tiny_checkpoint("qwen3_moe", tmp_path / "other_model", seed=5)
    _save_tokenizer(other)
    assert_user_error(invoke("eval", other, "--text", text_file, "--window", 16, "--kl-ref", path), "error:",
                      str(path), "another checkpoint")  # fmt: skip
    # the same text and vocabulary from another checkpoint (a quantized file of the model): accepted when asked
    crossed = last_json(invoke("eval", other, "--text", text_file, "--window", 16, "--kl-ref", path,
                               "--kl-other-checkpoint", "--json"))  # fmt: skip
    assert crossed["kl_mean"] > 0 and 0 <= crossed["top1_pct"] <= 100
    assert_user_error(invoke(*base, "--window", 16, "--kl-other-checkpoint"), "error:", "--kl-ref FILE")


def test_bad_kl_flags(tiny: Path, text_file: Path, tmp_path: Path) -> None:
    base = ("eval", tiny, "--text", text_file)
    assert_user_error(invoke(*base, "--kl-ref", tmp_path / "missing.st"), "error:", "missing.st", "no such file")
    (tmp_path / "junk.st").write_text("junk")
    assert_user_error(invoke(*base, "--kl-ref", tmp_path / "junk.st"), "error:", "junk.st", "not a safetensors")
    assert_user_error(invoke(*base, "--kl-ref", "full", "--save-logits", tmp_path / "x.st"), "error:",
                      "--save-logits and --kl-ref")  # fmt: skip
    assert_user_error(invoke(*base, "--save-logits", tmp_path), "error:", "is a directory")


def test_default_window_is_the_declared_train_window(tiny: Path, text_file: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny, tmp_path / "declared"))
    context = last_json(invoke("eval", model, "--text", text_file, "--json"))
    assert context["window_from"] == "context length"
    (model / "moetier.json").write_text(json.dumps({"train_window": 8}))
    data = last_json(invoke("eval", model, "--text", text_file, "--json"))
    explicit = last_json(invoke("eval", model, "--text", text_file, "--window", 8, "--json"))
    assert data["window"] == 8 and data["window_from"] == "train_window of moetier.json"
    assert explicit["window_from"] == "--window" and data["ppl"] == pytest.approx(explicit["ppl"], rel=1e-9)
    assert data["ppl"] != pytest.approx(context["ppl"], rel=1e-6)  # 8-token windows score differently
    human = invoke("eval", model, "--text", text_file)
    assert "(window 8, train_window of moetier.json)" in human.stdout
    (model / "moetier.json").write_text(json.dumps({"train_window": 0}))
    assert_user_error(invoke("eval", model, "--text", text_file), "error:", "moetier.json", "train_window")


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Path:
    """A bf16 checkpoint with expert inner size 64 (int4 needs groups of 32+), quantized to int8 and int4 and
    calibrated for sparsity."""
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny64") / "qwen3_moe", dtype=torch.bfloat16,
                                   moe_intermediate_size=64)  # fmt: skip
    _save_tokenizer(folder)
    last_json(invoke("quantize", folder, "--precisions", "int8,int4", "--json"))
    last_json(invoke("calibrate", folder, "--text", text_file, "--window", 32, "--json"))
    return folder


def test_kl_ref_full_for_every_engine_mode(tiny64: Path, text_file: Path) -> None:
    base = ("eval", tiny64, "--text", text_file, "--window", 32, "--kl-ref", "full", "--json")
    runs = {name: last_json(invoke(*base, *flags)) for name, flags in {
        "bf16": (), "int8": ("--precision", "int8"), "int4": ("--precision", "int4"),
        "dynamic": ("--precision", "dynamic", "--sync-switches", "--host-expert-mem", "80KiB"),
        "sparse": ("--sparsity", "0.7", "--sparsity-dense", "masked"),  # masked at every call size: windows are big
    }.items()}  # fmt: skip
    ref_ppl = runs["bf16"]["ref_ppl"]
    for name, data in runs.items():
        assert KL_FIELDS.issubset(data), name
        assert all(math.isfinite(data[k]) for k in KL_FIELDS - {"kl_ref"}), name
        assert data["ref_ppl"] == pytest.approx(ref_ppl, rel=1e-9), name  # one reference for every candidate
        assert data["kl_tokens"] == data["tokens"], name
    assert runs["int8"]["precision"] != runs["int4"]["precision"]
    assert runs["bf16"]["kl_mean"] < runs["int8"]["kl_mean"] < runs["int4"]["kl_mean"]
    assert runs["sparse"]["kl_mean"] > runs["bf16"]["kl_mean"] and runs["sparse"]["sparsity"]["target"] == 0.7
