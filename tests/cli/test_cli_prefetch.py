"""CLI flags of issue 5 on generate/eval: --cache-policy mrs, --prefetch/--no-prefetch, --prefetch-depth,
--prefetch-max, --scheduler, --profile; their stats rows and JSON; their errors (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import _save_tokenizer
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.models.tiny import build_tiny_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny4") / "q", num_hidden_layers=4)
    _save_tokenizer(folder)
    return folder


def invoke(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args])


GEN = ("--prompt", "ROMEO: But soft", "--max-new-tokens", 5, "--ignore-eos", "--device", "cpu",
       "--host-expert-mem", "24KiB")  # fmt: skip


def test_prefetch_mrs_json_and_table(tiny4: Path) -> None:
    res = invoke("generate", tiny4, *GEN, "--cache-policy", "mrs", "--prefetch", "--prefetch-depth", 2,
                 "--prefetch-max", 2, "--scheduler", "hybrimoe", "--json")  # fmt: skip
    assert res.exit_code == 0, (res.stderr, res.exception)
    data = json.loads(res.stdout.strip().splitlines()[-1])
    pf = data["prefetch"]
    assert data["cache_policy"] == "mrs" and data["scheduler"] == "hybrimoe" and data["hybrid"] is False
    assert pf["depth"] == 2 and pf["predicted"] > 0 and 0 <= pf["accuracy"] <= 1 and pf["issued"] >= pf["used"]
    assert 0 <= data["hit_rate"] <= 1 and data["hit_rate"] == data["hits"] / (data["hits"] + data["misses"])
    plain = json.loads(invoke("generate", tiny4, *GEN, "--json").stdout.strip().splitlines()[-1])
    assert plain["token_ids"] == data["token_ids"]  # prefetch and policy never change the output
    assert "prefetch" not in plain
    table = invoke("generate", tiny4, *GEN, "--prefetch")
    assert table.exit_code == 0
    assert "prefetch accuracy" in table.stdout and "expert hit rate" in table.stdout
    assert "prefetched used / issued" in table.stdout


def test_eval_takes_the_flags(tiny4: Path, text_file: Path) -> None:
    args = ("eval", tiny4, "--text", text_file, "--max-tokens", 24, "--device", "cpu", "--host-expert-mem", "24KiB")
    on = invoke(*args, "--prefetch", "--cache-policy", "lfu", "--json")
    off = invoke(*args, "--no-prefetch", "--json")
    assert on.exit_code == 0 == off.exit_code, (on.stderr, off.stderr)
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (on, off))
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and "prefetch" in a and "prefetch" not in b


@pytest.mark.parametrize(("flags", "needle"), [
    (("--cache-policy", "belady"), "future"),
    (("--scheduler", "nope"), "unknown scheduler 'nope'"),
    (("--scheduler", "adapmoe"), "runs in the simulator only"),
    (("--profile", "no-such-machine"), "unknown hardware profile"),
    (("--prefetch-depth", "4"), "--prefetch-depth"),
    (("--prefetch-max", "0"), "--prefetch-max"),
])  # fmt: skip
def test_bad_flags_are_one_line_errors(tiny4: Path, flags: tuple[str, ...], needle: str) -> None:
    res = invoke("generate", tiny4, *GEN, "--prefetch", *flags)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output and needle in res.output
