"""`moetier report` end to end (in-process via typer's CliRunner): on a recorded trace, on run directories
written by `generate --run-dir` on the bundled model (dynamic precision; sparsity), on an `eval --run-dir`,
on a `simulate --run-dir`; the PNGs are real images the HTML index references; bad input is one line
`error: ...` with exit 2; --json stdout is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetier.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
TRACE = ROOT / "data" / "traces" / "macbeth-field.parquet"
runner = CliRunner()
FAST = ["--cache-ratios", "0.25,0.5", "--policies", "lru,belady"]


def _ok(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    return res.stdout


def _check_png(path: Path) -> None:
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(blob) > 5000, (path, len(blob))  # a drawn figure, not an empty canvas


def _report(inp: Path, out: Path) -> tuple[dict[str, Any], str]:
    """Run the report with --json; returns (the JSON line, index.html text); checks every PNG is referenced."""
    stdout = _ok(["report", str(inp), "--out", str(out), *FAST, "--json"])
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    html = (out / "index.html").read_text()
    figures = data["figures"]
    assert isinstance(figures, dict)
    for path in figures.values():
        _check_png(Path(path))
        assert f"src='{Path(path).name}'" in html
    assert sorted(p.name for p in out.glob("*.png")) == sorted(Path(p).name for p in figures.values())
    return data, html


@pytest.fixture(scope="module")
def dyn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "dyn"
    quant = tmp_path_factory.mktemp("quant")  # a fresh clone has no quantized tier next to the bundled model
    _ok(["quantize", str(MODEL), "--precisions", "int4,int2", "--out", str(quant)])
    _ok(["generate", str(MODEL), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--precision", "dynamic",
         "--hi", "int4", "--lo", "int2", "--quant-dir", str(quant), "--host-expert-mem", "5MiB", "--period", "2",
         "--run-dir", str(run), "--trace-scores", "--sync-switches", "--json"])  # fmt: skip
    return run  # --sync-switches: no switch may land between the last token's stats line and the result


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "sparse"
    _ok(["generate", str(MODEL), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--sparsity", "0.5",
         "--sparsity-tipping", "16", "--run-dir", str(run)])  # fmt: skip
    return run


def test_report_on_a_recorded_trace(tmp_path: Path) -> None:
    data, html = _report(TRACE, tmp_path / "out")
    assert data["kind"] == "trace"
    assert set(data["figures"]) == {"activation", "hit_rate"}
    hit = data["hit_rates"]
    assert isinstance(hit, dict) and set(hit) == {"lru", "belady"}
    for lru, opt in zip(hit["lru"], hit["belady"], strict=True):
        assert 0.0 <= lru["hit_rate"] <= opt["hit_rate"] <= 1.0  # Belady is optimal
    assert "skipped: no precision data: the input is a trace" in html
    assert "skipped: no timeline" in html
    assert "<td>lru</td>" in html and "<th>0.25</th>" in html


def test_report_on_a_dynamic_precision_run(dyn_run: Path) -> None:
    assert {p.name for p in dyn_run.iterdir()} >= {"trace.parquet", "stats.jsonl", "run.json"}
    lines = [json.loads(x) for x in (dyn_run / "stats.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))  # one line per generated token
    assert set(lines[-1]["precision"]) == {"int4", "int2"} and sum(lines[-1]["precision"].values()) == 128
    run = json.loads((dyn_run / "run.json").read_text())
    assert run["command"] == "generate" and run["config"]["precision"]["mode"] == "dynamic"
    assert run["result"]["promotions"] == lines[-1]["promotions"]
    data, html = _report(dyn_run, dyn_run / "report")
    assert set(data["figures"]) == {"activation", "hit_rate", "precision"}
    assert "no sparsity data: run was not --sparsity" in html


def test_report_on_a_sparsity_run_default_out(sparse_run: Path) -> None:
    res = runner.invoke(app, ["report", str(sparse_run), *FAST])
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    out = sparse_run / "report"  # the default for a directory
    _check_png(out / "sparsity.png")
    html = (out / "index.html").read_text()
    assert "src='sparsity.png'" in html
    assert "no precision data: run was not --precision dynamic" in html
    assert "sparsity: " + str(out / "sparsity.png") in res.stdout


def test_report_on_an_eval_run(tmp_path: Path) -> None:
    run, text_file = tmp_path / "ev", tmp_path / "t.txt"
    text_file.write_text((ROOT / "data" / "shakespeare_heldout.txt").read_text()[:2000])
    _ok(["eval", str(MODEL), "--text", str(text_file), "--max-tokens", "24", "--window", "8", "--run-dir", str(run)])
    lines = (run / "stats.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]  # one line per window
    data, _ = _report(run, tmp_path / "out")
    assert set(data["figures"]) == {"activation", "hit_rate"}


def test_report_on_a_simulation(tmp_path: Path) -> None:
    sim = tmp_path / "sim"
    _ok(["simulate", "--profile", "a6000-5220r", "--spec", "tiny-shakespeare-moe", "--trace", str(TRACE),
         "--steps", "4", "--run-dir", str(sim), "--json"])  # fmt: skip
    assert json.loads((sim / "result.json").read_text())["trace"] == str(TRACE)
    assert (sim / "timeline.jsonl").read_text().count("\n") > 0
    data, html = _report(sim, tmp_path / "out")
    assert set(data["figures"]) == {"activation", "hit_rate", "timeline"}
    assert "<td>hybrimoe</td>" in html


def test_run_dir_and_trace_conflict(tmp_path: Path) -> None:
    res = runner.invoke(app, ["generate", str(MODEL), "--prompt", "a", "--run-dir", str(tmp_path / "r"),
                              "--trace", str(tmp_path / "t.parquet")])  # fmt: skip
    assert res.exit_code == 2 and res.stderr.startswith("error: --run-dir records its own trace")


@pytest.mark.parametrize("kind", ["missing", "random", "empty", "json"])
def test_bad_input_is_one_line_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x"
    if kind == "random":
        path.write_bytes(b"not a trace at all \x00\x01")
    elif kind == "empty":
        path.mkdir()
    elif kind == "json":
        path.mkdir()
        (path / "run.json").write_text("[1, 2")
    res = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), res.stderr
    expect = {"missing": "no such file or directory", "random": "not a run directory, simulation directory or "
              "routing trace", "empty": "not a run directory", "json": "not valid JSON"}[kind]  # fmt: skip
    assert expect in lines[0]


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--cache-ratios", "0.5,1.5", "cache ratio must lie in (0, 1]"),
    ("--cache-ratios", "a,b", "--cache-ratios must be comma-separated numbers"),
    ("--policies", "lru,nope", "unknown cache policy 'nope'"),
])  # fmt: skip
def test_bad_flags(flag: str, value: str, needle: str) -> None:
    res = runner.invoke(app, ["report", str(TRACE), flag, value])
    assert res.exit_code == 2 and needle in res.stderr, res.stderr
