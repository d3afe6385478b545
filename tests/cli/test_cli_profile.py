"""`moetier profile` on the command line (quick mode): writes a loadable profile, --json, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import moetier.cli.profile as cli_profile
from moetier.cli.profile import register
from moetier.policies.costmodel import load_profile
from moetier.policies.hwprofile import SHIPPED_PROFILES, find_profile, profile_names, user_profiles_dir

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
    # HybriMoE Fig. 3e: the file holds cpu.first_expert_s (>= 0) and the note that says why it is what it is
    first, note = line["profile"]["cpu"]["first_expert_s"], line["profile"]["notes"]["cpu.first_expert_s"]
    assert first == prof.cpu.first_expert_s >= 0 and note.startswith("recorded: " if first > 0 else "0: ")
    assert f"first expert of a call +{first * 1e6:.1f} us" in res.stderr and "first expert: " in res.stderr


def test_profile_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    res = runner.invoke(app, ["profile", "--quick", "--name", "a/b"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --name must be a plain file stem, got 'a/b'"
    res = runner.invoke(app, ["profile", "--quick", "--tmp-dir", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: --tmp-dir")
    res = runner.invoke(app, ["profile", "--threads", "0"])
    assert res.exit_code == 2


def test_profile_writes_to_the_user_folder_and_names_find_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --out the profile goes to $XDG_CONFIG_HOME/moetier/profiles/NAME.json (never into the package),
    and a profile name is looked up there before the shipped profiles."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "config" / "moetier" / "profiles"
    assert user_profiles_dir() == folder
    shipped = load_profile("this-machine")  # no user profile yet: the shipped one
    assert find_profile("this-machine") == Path(str(SHIPPED_PROFILES / "this-machine.json"))

    def measure(opts: Any, step: Any) -> tuple[Any, dict[str, Any]]:  # the measurement is runtime/profile.py's
        step("measuring")
        return shipped, {"disk_cold": "not measured (test)"}

    monkeypatch.setattr(cli_profile, "measure", measure)
    res = runner.invoke(app, ["profile", "--quick", "--name", "a6000", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip())["path"] == str(folder / "a6000.json")
    assert find_profile("a6000") == folder / "a6000.json"  # the user's shadows the shipped a6000
    assert load_profile("a6000") == shipped and "a6000" in profile_names() and "h100-8470" in profile_names()
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/dir")  # not absolute: ignored, as the XDG spec says
    assert user_profiles_dir() == Path.home() / ".config" / "moetier" / "profiles"
