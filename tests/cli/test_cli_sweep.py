"""`moetier sweep` (cli_sweep.register): the JSON line, resume, one-line errors, --ray without ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moetier.cli.sweep import register

app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test app."""


register(app)
register(app)  # idempotent
runner = CliRunner()
GRID = """point = "simulate"
metrics = ["tbt_s", "hit_rate"]
[params]
profile = "a6000-5220r"
model = "deepseek-v2-lite"
steps = 3
prompt_len = 8
[grid]
schedulers = ["hybrimoe", "fiddler"]
"""


def _grid(tmp_path: Path, text: str = GRID) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def test_json_line_then_resume(tmp_path: Path) -> None:
    grid, out = _grid(tmp_path), tmp_path / "out"
    res = runner.invoke(app, ["sweep", str(grid), "--out", str(out), "--jobs", "1", "--json"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert (d["points"], d["ran"], d["done_before"], d["errors"], d["runner"]) == (2, 2, 0, 0, "inline")
    assert d["results"] == str(out / "results.parquet") and Path(d["results"]).is_file()
    assert sorted(Path(p).name for p in d["plots"]) == ["hit_rate_deepseek-v2-lite.png", "tbt_s_deepseek-v2-lite.png"]
    res = runner.invoke(app, ["sweep", str(grid), "--out", str(out), "--metric", "ttft_s", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert (d["ran"], d["done_before"]) == (0, 2)
    assert [Path(p).name for p in d["plots"]] == ["ttft_s_deepseek-v2-lite.png"]


def test_table_output(tmp_path: Path) -> None:
    res = runner.invoke(app, ["sweep", str(_grid(tmp_path)), "--out", str(tmp_path / "o"), "--jobs", "1"])
    assert res.exit_code == 0, res.output
    text = "".join(res.stdout.split())  # long values fold over lines
    assert "2runnow" in text and "results.parquet" in text.replace("│", "")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (GRID.replace("schedulers", "shedulers"), "no parameter(s) ['shedulers']"),
        (GRID + "ndp_counts = [4, 8]\n", "cannot use ndp_count"),
        (GRID.replace('"fiddler"', '"nope"'), "unknown scheduler 'nope'"),
        ("[grid\n", "not a valid TOML"),
    ],
)
def test_bad_grid_is_one_line_error(tmp_path: Path, text: str, match: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["sweep", str(_grid(tmp_path, text)), "--out", str(out)])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and match in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()  # nothing ran


def test_missing_grid_and_bad_metric(tmp_path: Path) -> None:
    res = runner.invoke(app, ["sweep", str(tmp_path / "none.toml")])
    assert res.exit_code == 2 and "no such grid file" in res.stderr
    res = runner.invoke(app, ["sweep", str(_grid(tmp_path)), "--out", str(tmp_path / "o"), "--metric", "tpot"])
    assert res.exit_code == 2 and "unknown metric(s) ['tpot']" in res.stderr


def test_ray_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    res = runner.invoke(app, ["sweep", str(_grid(tmp_path)), "--out", str(tmp_path / "o"), "--ray", "local"])
    assert res.exit_code == 2 and "needs the ray package" in res.stderr
