"""CLI flags of issue 5 on generate/eval: --cache-policy mrs, --prefetch/--no-prefetch, --prefetch-depth,
--prefetch-max, --prefetch-predictor, --scheduler, --profile; their stats rows and JSON; their errors (one line,
exit 2); history prefetch through the experts seam (--seam), gate refused there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import _save_tokenizer
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.cli.engine_flags import EngineFlags
from moetier.errors import ConfigError
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
    assert "predicted (gate, depth 1)" in table.stdout and "prefetch accuracy by distance" in table.stdout


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
    (("--scheduler", "adapmoe-gated"), "runs in the simulator only"),
    (("--scheduler", "adapmoe"), "one cache per MoE layer"),  # AdapMoE's per-layer DP caches: the simulator's only
    (("--profile", "no-such-machine"), "unknown hardware profile"),
    (("--prefetch-depth", "4"), "--prefetch-depth"),
    (("--prefetch-max", "0"), "--prefetch-max"),
    (("--prefetch-predictor", "oracle"), "prefetch predictor must be one of gate, history, got 'oracle'"),
])  # fmt: skip
def test_bad_flags_are_one_line_errors(tiny4: Path, flags: tuple[str, ...], needle: str) -> None:
    res = invoke("generate", tiny4, *GEN, "--prefetch", *flags)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output and needle in res.output


def test_prefetch_predictor_flag_maps_onto_the_config(tiny4: Path) -> None:
    assert EngineFlags().config().prefetch.predictor == "gate"
    cfg = EngineFlags(prefetch=True, prefetch_depth=2, prefetch_predictor="history").config().prefetch
    assert (cfg.enabled, cfg.depth, cfg.predictor) == (True, 2, "history")
    with pytest.raises(ConfigError, match="--prefetch-predictor needs --prefetch"):
        EngineFlags(prefetch_predictor="history").config()
    res = invoke("generate", tiny4, *GEN, "--prefetch", "--prefetch-depth", 2, "--prefetch-predictor", "history",
                 "--json")  # fmt: skip
    assert res.exit_code == 0, (res.stderr, res.exception)
    pf = json.loads(res.stdout.strip().splitlines()[-1])["prefetch"]
    assert pf["predictor"] == "history" and pf["predicted"] > 0
    assert set(pf["accuracy_by_distance"]) == {"1", "2"} and set(pf["history"]) == {"1", "2"}
    alone = invoke("generate", tiny4, *GEN, "--prefetch-predictor", "history")
    assert alone.exit_code == 2 and "--prefetch-predictor needs --prefetch" in alone.output


def test_history_prefetch_through_the_seam(tiny4: Path) -> None:
    seam = (*GEN, "--seam", "--prefetch-depth", 3, "--prefetch-predictor", "history")
    res = invoke("generate", tiny4, *seam, "--prefetch", "--json")
    assert res.exit_code == 0, (res.stderr, res.exception)
    data = json.loads(res.stdout.strip().splitlines()[-1])
    pf = data["prefetch"]
    assert pf["predictor"] == "history" and pf["depth"] == 3 and pf["issued"] > 0 and 0 <= pf["accuracy"] <= 1
    assert set(pf["accuracy_by_distance"]) == {"1", "2", "3"}
    assert all(0 <= a <= 1 for a in pf["accuracy_by_distance"].values())
    plain = invoke("generate", tiny4, *GEN, "--seam", "--json")
    assert plain.exit_code == 0, (plain.stderr, plain.exception)
    assert json.loads(plain.stdout.strip().splitlines()[-1])["token_ids"] == data["token_ids"]
    table = invoke("generate", tiny4, *seam, "--prefetch")
    assert table.exit_code == 0, (table.stderr, table.exception)
    by_d = ", ".join(f"d={d} {a:.1%}" for d, a in pf["accuracy_by_distance"].items())
    assert "predicted (history, depth 3)" in table.stdout and by_d in table.stdout  # same run, same figures


def test_gate_prefetch_through_the_seam_is_a_one_line_error(tiny4: Path) -> None:
    for flags in ((), ("--prefetch-predictor", "gate")):
        res = invoke("generate", tiny4, *GEN, "--seam", "--prefetch", *flags)
        assert res.exit_code == 2, (res.output, res.exception)
        assert "Traceback" not in res.output and "use --prefetch-predictor history" in res.output
