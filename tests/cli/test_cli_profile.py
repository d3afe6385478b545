"""`moetier profile` on the command line (quick mode): writes a loadable profile, --json, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from moetier.cli.profile import register
from moetier.policies.costmodel import load_profile

runner = CliRunner()
app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test app: only the profile command."""


register(app)


def test_profile_quick_writes_a_profile(tmp_path: Path) -> None:
    out = tmp_path / "p" / "mine.json"
    res = runner.invoke(app, ["profile", "--quick", "--out", str(out), "--name", "mine", "--threads", "1",
                              "--tmp-dir", str(tmp_path), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip())
    assert line["path"] == str(out) and line["profile"]["name"] == "mine"
    prof = load_profile(out)
    assert prof.name == "mine" and prof.cpu_threads == 1 and prof.cpu.lut_shape == (256, 128)
    assert "expert call time" in res.stderr and "wrote" in res.stderr


def test_profile_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    res = runner.invoke(app, ["profile", "--quick", "--name", "a/b"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --name must be a plain file stem, got 'a/b'"
    res = runner.invoke(app, ["profile", "--quick", "--tmp-dir", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: --tmp-dir")
    res = runner.invoke(app, ["profile", "--threads", "0"])
    assert res.exit_code == 2
