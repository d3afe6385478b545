"""The `moetier` command line against a tiny random qwen3_moe checkpoint with a tiny tokenizer.

In-process through typer's CliRunner (stdout and stderr apart), plus one end-to-end
subprocess. The checkpoint has 2 MoE layers x 6 experts of 6144 bytes (fp32), so a
12KiB host budget holds 2 of its 12 experts.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from typer.testing import CliRunner

from moetier import traces
from moetier.cli.app import app
from moetier.cli.console import TokenStream
from moetier.cli.options import size_flag
from moetier.models.tiny import build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXPERT_BYTES = 6144  # 3 * 16 * 32 * 4: gate, up, down of one expert, fp32
SENTENCES = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "It is the east, and Juliet is the sun.",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "Deny thy father and refuse thy name.",
]
runner = CliRunner()


def _save_tokenizer(folder: Path) -> None:
    """A byte-level BPE of 90 tokens (the model's vocab is 96); ids 0-2 are pad, bos, eos as in config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=90, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], initial_alphabet=[], show_progress=False
    )
    tok.train_from_iterator(SENTENCES, trainer)
    assert tok.get_vocab_size() <= 96
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny") / "qwen3_moe")
    _save_tokenizer(folder)
    return folder



def invoke(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def last_json(result: Any) -> dict[str, Any]:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, f"--json stdout must be one line, got {lines}"
    data: dict[str, Any] = json.loads(lines[-1])
    return data


def assert_user_error(result: Any, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


# -- generate -----------------------------------------------------------------------
def test_generate_json_under_small_budget(tiny: Path) -> None:
    budget = 2 * EXPERT_BYTES
    data = last_json(
        invoke("generate", tiny, "--prompt", "ROMEO:", "--max-new-tokens", 7, "--ignore-eos",
               "--host-expert-mem", "12KiB", "--device", "cpu", "--json")
    )  # fmt: skip
    for key in ("ttft_s", "decode_tok_s", "new_tokens", "hits", "misses", "disk_bytes",
                "peak_host_expert_bytes", "peak_accel_expert_bytes", "text", "prompt_tokens", "decoder"):  # fmt: skip
        assert key in data, key
    assert data["new_tokens"] == 7 == len(data["token_ids"])
    assert data["misses"] > 0
    assert 0 < data["peak_host_expert_bytes"] <= budget
    assert data["tiers"]["host"]["budget_bytes"] == budget
    assert data["disk_bytes"] >= data["misses"] * EXPERT_BYTES


def test_generate_streams_text_then_table(tiny: Path) -> None:
    args = ("generate", tiny, "--prompt", "JULIET:", "--max-new-tokens", 5, "--ignore-eos", "--device", "cpu")
    data = last_json(invoke(*args, "--json"))
    result = invoke(*args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    from transformers import AutoTokenizer

    expected = str(AutoTokenizer.from_pretrained(tiny).decode(data["token_ids"], skip_special_tokens=True))
    assert result.stdout.startswith(expected + "\n")
    assert "time to first token" in result.stdout and "expert tiers" in result.stdout


def test_generate_sampling_is_seeded(tiny: Path) -> None:
    args = ("generate", tiny, "--prompt", "ROMEO:", "--max-new-tokens", 6, "--ignore-eos", "--temperature", "1.5",
            "--top-p", "0.9", "--seed", "7", "--json")  # fmt: skip
    assert last_json(invoke(*args))["token_ids"] == last_json(invoke(*args))["token_ids"]


def test_generate_no_lean_matches_lean(tiny: Path) -> None:
    args = ("generate", tiny, "--prompt", "ROMEO: But soft", "--max-new-tokens", 4, "--ignore-eos", "--json")
    lean, hf = last_json(invoke(*args)), last_json(invoke(*args, "--no-lean"))
    assert hf["decoder"] == "HFDecoder"
    assert lean["token_ids"] == hf["token_ids"]


def test_trace_written_and_readable(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "trace.parquet"
    data = last_json(
        invoke("generate", tiny, "--prompt", "ROMEO:", "--max-new-tokens", 3, "--ignore-eos",
               "--trace", out, "--trace-scores", "--json")
    )  # fmt: skip
    trace = traces.load(out)
    assert trace.metadata["num_experts"] == 6 and trace.metadata["top_k"] == 2
    # prefill: one row per prompt token per MoE layer; then one per decoded token fed back
    assert len(trace) == (data["prompt_tokens"] + data["new_tokens"] - 1) * 2
    assert all(len(s) == 6 for s in trace.table.column("scores").to_pylist())


def test_token_stream_holds_back_split_characters() -> None:
    pieces = {0: b"h", 1: b"\xc3", 2: b"\xa9", 3: b"\n", 4: b" w", 5: b"\xe2\x82", 6: b"\xac"}

    class Bytes:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    stream = TokenStream(cast(Any, SimpleNamespace(tokenizer=Bytes())), out)
    seen = []
    for token in (0, 1, 2, 3, 4, 5, 6):
        stream(token, "")
        seen.append(out.getvalue())
    stream.finish()
    assert out.getvalue() == "hé\n w€\n"
    assert seen[1] == "h" and seen[5] == "hé\n w"  # incomplete characters held back
    assert not any("\ufffd" in s for s in seen)


# -- eval -----------------------------------------------------------------------------
def test_eval_json(tiny: Path, text_file: Path) -> None:
    data = last_json(invoke("eval", tiny, "--text", text_file, "--host-expert-mem", "24KiB", "--json"))
    assert math.isfinite(data["ppl"]) and data["ppl"] > 1
    assert data["tokens"] > 10 and data["misses"] > 0
    assert data["peak_host_expert_bytes"] <= 24 * 1024
    short = last_json(invoke("eval", tiny, "--text", text_file, "--max-tokens", 10, "--window", 4, "--json"))
    assert short["tokens"] == 9


def test_eval_human_output(tiny: Path, text_file: Path) -> None:
    result = invoke("eval", tiny, "--text", text_file, "--max-tokens", 12)
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert result.stdout.startswith("perplexity ")


def test_eval_missing_or_binary_text_file(tiny: Path, tmp_path: Path) -> None:
    assert_user_error(invoke("eval", tiny, "--text", tmp_path / "nope.txt"), "error:", "nope.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    assert_user_error(invoke("eval", tiny, "--text", tmp_path / "bin.txt"), "error:", "bin.txt", "UTF-8")


# -- info -------------------------------------------------------------------------------
def test_info(tiny: Path) -> None:
    data = last_json(invoke("info", tiny, "--json"))
    assert data["family"] == "qwen3_moe" and data["architecture"] == "Qwen3MoeForCausalLM"
    assert (data["num_experts"], data["top_k"], data["moe_layers"]) == (6, 2, [0, 1])
    assert data["expert_bytes"] == EXPERT_BYTES
    assert data["total_expert_bytes"] == EXPERT_BYTES * 6 * 2
    assert data["non_expert_bytes"] > 0
    text = invoke("info", tiny)
    assert text.exit_code == 0
    for needle in ("qwen3_moe", "Qwen3MoeForCausalLM", "6144 B", "73728 B", "F32"):
        assert needle in text.stdout, needle


def test_info_allocates_no_expert_pool(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """info must work for models whose experts do not fit in memory: it never builds a store."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("info built an ExpertStore")

    monkeypatch.setattr("moetier.store.store.ExpertStore.__init__", refuse)
    assert last_json(invoke("info", tiny, "--json"))["num_experts"] == 6


# -- errors -------------------------------------------------------------------------------
def test_size_parsing() -> None:
    assert size_flag("512MiB") == 512 * 2**20
    assert size_flag("2GiB") == 2 * 2**30
    assert size_flag("4096") == 4096


@pytest.mark.parametrize(("value", "needle"), [("12 parsecs", "cannot parse size"), ("-5", "negative")])
def test_bad_sizes_exit_2(tiny: Path, value: str, needle: str) -> None:
    result = invoke("generate", tiny, "--prompt", "x", "--host-expert-mem", value)
    assert result.exit_code == 2 and needle in result.output


def test_budget_smaller_than_one_expert(tiny: Path) -> None:
    result = invoke("generate", tiny, "--prompt", "ROMEO:", "--host-expert-mem", "100")
    assert_user_error(result, "error:", "100 bytes", f"{EXPERT_BYTES} bytes")


def test_unknown_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    for args in (("info", tmp_path), ("generate", tmp_path, "--prompt", "x")):
        assert_user_error(invoke(*args), "error:", "LlamaForCausalLM")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda(tiny: Path) -> None:
    assert_user_error(invoke("generate", tiny, "--prompt", "x", "--device", "cuda"), "error:", "CUDA")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    assert_user_error(invoke("info", tmp_path / "missing"), "error:", "missing", "neither an existing path nor a "
                      "Hugging Face hub id")  # fmt: skip
    assert_user_error(invoke("info", tmp_path), "error:", "config.json")  # a folder, but not a checkpoint


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint without tokenizer files."""
    return build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bare") / "qwen3_moe")


def test_checkpoint_without_tokenizer(bare: Path) -> None:
    assert_user_error(invoke("generate", bare, "--prompt", "x"), "error:")


def test_checkpoint_without_tokenizer_names_it(bare: Path) -> None:
    assert_user_error(invoke("generate", bare, "--prompt", "x"), "tokenizer")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--device", "tpu"), "tpu"),
        (("--dtype", "int3"), "int3"),
        (("--cache-policy", "nope"), "unknown cache policy"),
        (("--top-p", "0"), "top_p"),
        (("--temperature", "-1"), "temperature"),
        (("--max-new-tokens", "0"), "max-new-tokens"),
        (("--trace-scores",), "--trace"),
    ],
)
def test_bad_flags_exit_2(tiny: Path, flags: tuple[str, ...], needle: str) -> None:
    result = invoke("generate", tiny, "--prompt", "x", *flags)
    assert result.exit_code == 2, (result.output, result.exception)
    assert needle in result.output and "Traceback" not in result.output


# -- end to end ------------------------------------------------------------------------------
def test_subprocess_json_stdout_is_one_line(tiny: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "generate", str(tiny), "--prompt", "ROMEO:",
         "--max-new-tokens", "3", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["new_tokens"] == 3
