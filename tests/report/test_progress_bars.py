"""Progress bars of the long commands: `replay` and `report` open cli_io.progress_bar on the stderr
console and advance it once per replay; with --json stdout stays one line. Checked by wrapping the
function (the bar itself draws nothing on a non-terminal, so its text is not asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.progress import Progress
from typer.testing import CliRunner

from moetier.cli import replay as cli_replay
from moetier.cli import report as cli_report
from moetier.cli.app import app

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "twelfth-night.parquet"
runner = CliRunner()


def spy(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[Progress]:
    bars: list[Progress] = []
    real = module.progress_bar

    def wrapped(err: Any, transient: bool = False) -> Progress:
        assert err.stderr  # bars go to stderr
        bars.append(real(err, transient))
        return bars[-1]

    monkeypatch.setattr(module, "progress_bar", wrapped)
    return bars


def test_replay_shows_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    bars = spy(monkeypatch, cli_replay)
    res = runner.invoke(app, ["replay", str(TRACE), "--cache-policy", "lru,lfu,mrs", "--json"])
    assert res.exit_code == 0, (res.stderr, res.exception)
    assert len(res.stdout.strip().splitlines()) == 1 and json.loads(res.stdout)["policies"] == ["lru", "lfu", "mrs"]
    assert len(bars) == 1
    (task,) = bars[0].tasks
    assert task.total == 3 and task.completed == 3


def test_report_shows_a_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bars = spy(monkeypatch, cli_report)
    res = runner.invoke(app, ["report", str(TRACE), "--out", str(tmp_path), "--cache-ratios", "0.1,0.5",
                              "--policies", "lru,mrs", "--json"])  # fmt: skip
    assert res.exit_code == 0, (res.stderr, res.exception)
    assert len(res.stdout.strip().splitlines()) == 1
    (task,) = bars[0].tasks
    assert task.total == 4 and task.completed == 4
