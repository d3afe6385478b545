"""`moetier simulate` (cli/simulate.py): the JSON line, the table, the timeline, one-line errors; the three-domain
machine's flags and schedulers are not its own (`moetier simulate-tri`, tests/cli/test_cli_simulate_tri.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from moetier.cli.simulate import register

app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test app."""


register(app)
register(app)  # idempotent
runner = CliRunner()
BASE = ["simulate", "--spec", "deepseek-v2-lite", "--profile", "a6000-5220r", "--synthetic", "--steps", "3",
        "--prompt-len", "8"]  # fmt: skip


def test_json_line_has_the_keys(tmp_path: Path) -> None:
    png = tmp_path / "tl.png"
    res = runner.invoke(app, [*BASE, "--scheduler", "hybrimoe", "--cache-ratio", "0.5", "--prefetch", "--json",
                              "--timeline", str(png)])  # fmt: skip
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    d = json.loads(lines[0])
    for key in (
        "ttft_s",
        "tbt_s",
        "throughput_tok_s",
        "moe_layer_s",
        "hit_rate",
        "utilization",
        "link_bytes",
        "prefetch",
    ):
        assert key in d
    assert set(d["utilization"]) == {"gpu", "cpu", "pcie"}
    assert d["cache_policy"] == "mrs" and d["cache_ratio"] == 0.5 and d["steps"] == 3 and d["prompt_len"] == 8
    assert d["prefetch"]["enabled"] is True and d["prefetch"]["predicted"] > 0
    assert d["tbt_s"] > 0 and d["ttft_s"] > d["tbt_s"]
    assert png.is_file() and png.stat().st_size > 1000


def test_prefetch_predictor_flags() -> None:
    # default: the history predictor, its accuracy per distance in the JSON and the table
    res = runner.invoke(app, [*BASE, "--prefetch", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["predictor"] == "history" and set(d["prefetch"]["accuracy_by_distance"]) == {"1", "2", "3"}
    # the corrupted-future oracle only when asked, at the accuracy asked
    res = runner.invoke(app, [*BASE, "--prefetch", "--prefetch-oracle-accuracy", "1,1,1", "--json"])
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["predictor"] == "oracle" and set(d["prefetch"]["accuracy_by_distance"].values()) == {1.0}
    res = runner.invoke(app, [*BASE, "--prefetch"])
    assert "prediction accuracy (history)" in res.stdout and "d=1:" in res.stdout
    res = runner.invoke(app, [*BASE, "--prefetch", "--prefetch-oracle-accuracy", "x"])
    assert res.exit_code == 2 and "--prefetch-oracle-accuracy" in res.output
    # adapmoe-gated's adaptive gating is reported; the default adapmoe does not gate
    res = runner.invoke(app, [*BASE, "--scheduler", "adapmoe-gated", "--gate-drop", "0.25", "--json"])
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["gating"]["routed"] > 0 and 0.0 <= d["gating"]["dropped_frac"] < 0.5
    res = runner.invoke(app, [*BASE, "--scheduler", "adapmoe", "--json"])
    assert json.loads(res.stdout.strip().splitlines()[-1])["gating"] == {}


def test_table_output() -> None:
    res = runner.invoke(app, [*BASE, "--scheduler", "ktransformers"])
    assert res.exit_code == 0, res.output
    assert "TBT" in res.stdout and "utilization cpu" in res.stdout and "lfu" in res.stdout


def test_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    cases = [
        ([*BASE, "--scheduler", "nope"], "unknown scheduler"),
        (["simulate", "--spec", "nope", "--profile", "a6000-5220r", "--synthetic"], "unknown model spec"),
        (["simulate", "--spec", "deepseek-v2-lite", "--profile", "nope", "--synthetic"], "hardware profile"),
        (["simulate", "--spec", "deepseek-v2-lite", "--profile", "a6000-5220r"], "exactly one of"),
        ([*BASE, "--cache-ratio", "1.5"], "cache_ratio must be in [0, 1]"),
        ([*BASE, "--scheduler", "trimoe"], "'trimoe' is a three-domain"),
        ([*BASE, "--cache-policy", "belady"], "belady"),
        (["simulate", "--profile", "a6000-5220r", "--trace", str(tmp_path / "missing.parquet")], "no such file"),
        (["simulate", "--profile", "a6000-5220r", "--trace", str(bad)], "Parquet"),
        ([*BASE, "--timeline-steps", "x"], "FIRST:LAST"),
    ]
    for args, msg in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], (args, res.stderr)


def _json(args: list[str]) -> dict[str, object]:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def test_study_flags_reach_the_simulation() -> None:
    """--precision full moves more bytes per expert than the default int4; --warmup-steps and --stats change the
    run."""
    base = [*BASE, "--scheduler", "gpu-lru", "--cache-ratio", "0.25"]
    full, int4 = _json([*base, "--precision", "full"]), _json(base)
    assert int4["precision"] == "int4" and full["precision"] == "full"
    moves_full, moves_int4 = full["moves"], int4["moves"]
    assert isinstance(moves_full, dict) and isinstance(moves_int4, dict)
    bytes_full, bytes_int4 = full["link_bytes"], int4["link_bytes"]
    assert isinstance(bytes_full, dict) and isinstance(bytes_int4, dict)
    per_move = bytes_full["pcie"] / moves_full["demand"], bytes_int4["pcie"] / moves_int4["demand"]
    assert per_move[1] < per_move[0] / 3  # 4-bit experts (with scales) are over 3x smaller than bf16
    warm = _json([*base, "--warmup-steps", "4", "--stats", "trimoe", "--prefill-stage"])
    assert warm["warmup_steps"] == 4 and warm["steps"] == 3 and "trimoe statistics" in str(warm["source"])


def test_no_flags_run_hybrimoes_setting() -> None:
    """Without scheduler or study flags `moetier simulate` runs HybriMoE as its paper does: the hybrid schedule, the
    MRS cache, impact-driven prefetch 3 layers ahead, 4-bit experts, Fig. 9's trace statistics behind a 128-step
    warm-up; a named baseline gets its own paper's prefetch (AdapMoE: distance 1; kTransformers: none)."""
    d = _json(BASE)
    assert (d["scheduler"], d["cache_policy"], d["precision"], d["warmup_steps"]) == ("hybrimoe", "mrs", "int4", 128)
    assert d["prefetch"]["enabled"] is True and d["prefetch_depth"] == 3 and d["prefetch"]["predicted"] > 0
    assert "hybrimoe statistics" in str(d["source"]) and d["gating"] == {}
    a = _json([*BASE, "--scheduler", "adapmoe"])
    assert a["prefetch"]["enabled"] is True and a["prefetch_depth"] == 1 and a["gating"] == {}
    k = _json([*BASE, "--scheduler", "ktransformers"])
    assert k["prefetch"]["enabled"] is False and k["cache_policy"] == "lfu"
    off = _json([*BASE, "--no-prefetch"])
    assert off["prefetch"]["enabled"] is False and off["scheduler"] == "hybrimoe"


def test_stats_needs_a_synthetic_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.parquet"
    trace.write_bytes(b"")
    res = runner.invoke(app, ["simulate", "--profile", "a6000-5220r", "--trace", str(trace), "--stats", "hybrimoe"])
    assert res.exit_code == 2 and "--stats applies to --synthetic" in res.output


def test_three_domain_flags_are_not_flags_of_simulate() -> None:
    for flag in ("--ndp-count", "--cpu-tflops-scale", "--hbm-ratio", "--drift", "--contention"):
        res = runner.invoke(app, [*BASE, flag, "1"])
        assert res.exit_code == 2 and "No such option" in res.output and flag in res.output, (flag, res.output)
    for flag in ("--no-refinement", "--no-relayout"):
        res = runner.invoke(app, [*BASE, flag])
        assert res.exit_code == 2 and "No such option" in res.output, (flag, res.output)
