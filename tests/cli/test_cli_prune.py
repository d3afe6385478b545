"""`moetier prune` writes the pruning file `--prune` reads; `generate` / `eval` take the routing flags and refuse
bad values with one-line errors."""

from __future__ import annotations

from pathlib import Path

from test_cli import assert_user_error, invoke, last_json

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
TEXT = Path(__file__).resolve().parents[2] / "data" / "shakespeare_heldout.txt"


def test_prune_then_generate_and_eval_with_it(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    got = last_json(invoke("prune", MODEL, "--text", TEXT, "--fraction", 0.25, "--max-tokens", 600, "--window", 256,
                           "--out", out, "--json"))  # fmt: skip
    assert got["out"] == str(out) and got["tokens"] == 600
    assert sorted(got["pruned"]) == ["0", "1", "2", "3"] and all(len(v) == 8 for v in got["pruned"].values())
    res = last_json(invoke("generate", MODEL, "--prompt", "ROMEO:", "--max-new-tokens", 4, "--prune", out,
                           "--max-experts-per-token", 3, "--json"))  # fmt: skip
    assert res["routing"]["pruned_experts"] == 32 and res["routing"]["experts_per_token"] <= 3


def test_bad_routing_flags_are_one_line_errors(tmp_path: Path) -> None:
    base = ("generate", MODEL, "--prompt", "x", "--max-new-tokens", 1)
    assert_user_error(invoke(*base, "--expert-threshold", 1.0), "threshold must be in [0, 1)")
    assert_user_error(invoke(*base, "--max-experts-per-token", 0), "at least 1")
    assert_user_error(invoke(*base, "--max-experts-per-token", 5), "exceeds the model's top-k of 4")
    assert_user_error(invoke(*base, "--prune", tmp_path / "none.json"), "no such file")
    assert_user_error(invoke(*base, "--follow-trace", tmp_path / "none.parquet"), "no such file")
    assert_user_error(invoke("prune", MODEL, "--text", TEXT, "--fraction", 1.0, "--out", tmp_path / "p.json"),
                      "--fraction must be in (0, 1)")  # fmt: skip
