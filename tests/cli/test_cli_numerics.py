"""NaN / Inf in `moetier eval` and `moetier generate`: a one-line `error: ...`, exit 2, and never a bare NaN.

Faults injected: the engine raising NumericalError from perplexity and from generate (monkeypatched, the CLI's own
behaviour); the engine returning a NaN perplexity without raising (the CLI's last line of defence); a finite NLL
whose perplexity overflows (valid JSON: null, listed in `non_finite`); NaN logits handed to the quality math
(`collect`, `compare`); and end to end, a tiny checkpoint with NaN in one expert run through the CLI (the
engine's own detection, runtime/engine.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import _save_tokenizer, assert_user_error, invoke

from moetier.cli.console import emit_json
from moetier.errors import NumericalError
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime import engine as engine_mod
from moetier.runtime.quality import RefLogprobs, collect, compare

DAMAGE = "model.safetensors: expert tensor 'model.layers.0.mlp.experts.3.up_proj.weight' (layer 0, expert 3) has NaN"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("num") / "qwen3_moe")
    _save_tokenizer(folder)
    return folder


def strict_json(line: str) -> dict[str, Any]:
    """json.loads that refuses NaN / Infinity (Python's default accepts them; JSON does not)."""

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in the JSON line: {line}")

    data: dict[str, Any] = json.loads(line, parse_constant=refuse)
    return data


def no_json_line(result: Any) -> None:
    assert result.stdout.strip() == "", result.stdout  # no figure, no bare NaN: nothing at all


def test_eval_numerical_error_is_one_line_and_no_json(tiny: Path, text_file: Path, monkeypatch) -> None:
    def damaged(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NumericalError(DAMAGE)

    monkeypatch.setattr(engine_mod.Engine, "perplexity", damaged)
    for extra in ((), ("--json",)):
        result = invoke("eval", tiny, "--text", text_file, "--max-tokens", 12, *extra)
        assert_user_error(result, "error: ", DAMAGE)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        if extra:
            no_json_line(result)


def test_eval_nan_perplexity_without_an_error_is_refused(tiny: Path, text_file: Path, monkeypatch) -> None:
    def nan(self: Any, *args: Any, **kwargs: Any) -> engine_mod.EvalResult:
        return engine_mod.EvalResult(ppl=float("nan"), tokens=11, nll=float("nan"))

    monkeypatch.setattr(engine_mod.Engine, "perplexity", nan)
    result = invoke("eval", tiny, "--text", text_file, "--max-tokens", 12, "--json")
    assert_user_error(result, "error: ", "not finite", str(tiny))
    no_json_line(result)


def test_eval_overflowed_perplexity_is_null_in_valid_json(tiny: Path, text_file: Path, monkeypatch) -> None:
    def huge(self: Any, *args: Any, **kwargs: Any) -> engine_mod.EvalResult:
        return engine_mod.EvalResult(ppl=float("inf"), tokens=11, nll=800.0)

    monkeypatch.setattr(engine_mod.Engine, "perplexity", huge)
    result = invoke("eval", tiny, "--text", text_file, "--max-tokens", 12, "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    (line,) = result.stdout.strip().splitlines()
    data = strict_json(line)
    assert data["ppl"] is None and data["nll"] == 800.0 and data["non_finite"] == ["ppl"]


def test_generate_numerical_error_is_one_line_and_no_json(tiny: Path, monkeypatch) -> None:
    def damaged(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NumericalError(DAMAGE)

    monkeypatch.setattr(engine_mod.Engine, "generate", damaged)
    for extra in (("--temperature", 0), ("--temperature", 0.8, "--seed", 1, "--json")):
        result = invoke("generate", tiny, "--prompt", "ROMEO:", "--max-new-tokens", 4, *extra)
        assert_user_error(result, "error: ", DAMAGE)
        if "--json" in extra:
            no_json_line(result)


def test_emit_json_is_strict(capsys: pytest.CaptureFixture[str]) -> None:
    emit_json({"a": float("nan"), "b": {"c": [1.0, float("-inf")]}, "d": 2.5, "e": "nan"})
    data = strict_json(capsys.readouterr().out)
    assert data == {"a": None, "b": {"c": [1.0, None]}, "d": 2.5, "e": "nan", "non_finite": ["a", "b.c[1]"]}


class FakeScorer:
    """window_logits over fixed windows; NaN in row 1 of window 1 when `damaged`."""

    def __init__(self, damaged: bool) -> None:
        self.damaged = damaged

    def window_logits(self, ids: list[int], window: int = 0, on_window: Any = None) -> Iterator[Any]:
        gen = torch.Generator().manual_seed(0)
        for i, start in enumerate(range(0, len(ids) - 1, window)):
            tgt = torch.tensor(ids[start + 1 : start + window + 1])  # [T]
            logits = torch.randn(len(tgt), 16, generator=gen)  # [T, V]
            if self.damaged and i == 1:
                logits[1, 5] = float("nan")
            yield start, logits, tgt


def test_quality_math_refuses_nan_logits() -> None:
    ids = list(range(1, 14))
    ref = collect(FakeScorer(False), ids, 4, {})
    assert isinstance(ref, RefLogprobs) and ref.tokens == 12
    with pytest.raises(NumericalError, match=r"window 1 \(at token 4\): 1 of 4 positions have NaN / Inf"):
        compare(FakeScorer(True), ids, 4, ref, "the reference")
    with pytest.raises(NumericalError, match=r"reference's window at token 4"):
        collect(FakeScorer(True), ids, 4, {})


@pytest.fixture
def nan_expert(tiny: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with one NaN in expert 4 of layer 0 (which the prompt below routes to on most tokens)."""
    model = Path(shutil.copytree(tiny, tmp_path / "nan"))
    file = model / "model.safetensors"
    sd = load_file(file)
    sd["model.layers.0.mlp.experts.4.up_proj.weight"][2, 5] = float("nan")
    save_file(sd, file, metadata={"format": "pt"})
    return model


def test_nan_expert_end_to_end_through_the_cli(nan_expert: Path, text_file: Path) -> None:
    """The engine's own detection (runtime/engine.py): greedy and sampled generate and eval exit 2, one line."""
    for args in (
        ("generate", nan_expert, "--prompt", "ROMEO: But soft, what light", "--max-new-tokens", 4),
        ("generate", nan_expert, "--prompt", "ROMEO: But soft, what light", "--max-new-tokens", 4,
         "--temperature", 0.8, "--seed", 1),
        ("eval", nan_expert, "--text", text_file, "--max-tokens", 40, "--json"),
    ):  # fmt: skip
        result = invoke(*args, "--device", "cpu")
        assert_user_error(result, "error: ")
        assert "NaN" in result.stderr or "Inf" in result.stderr, result.stderr
        if "--json" in args:
            no_json_line(result)
