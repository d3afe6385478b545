"""cli/app.py: importing the command line changes nothing; `offline_by_default` (which a command calls once its MODEL
is resolved, cli/model_arg.py) makes the Hub offline unless the user chose;
every command is registered once, in the order of `moetier --help`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
from typer.core import TyperCommand, TyperGroup
from typer.testing import CliRunner

from moetier.cli.app import COMMANDS, all_commands, app, offline_by_default

IMPORT_CHECK = """
import os
before = dict(os.environ)
import moetier.cli.app
import huggingface_hub.constants as hub
assert dict(os.environ) == before, sorted(set(os.environ.items()) ^ set(before.items()))
assert hub.HF_HUB_OFFLINE is False, hub.HF_HUB_OFFLINE
print("unchanged")
"""


def test_importing_the_cli_leaves_the_environment_and_the_hub_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    res = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "unchanged"


def test_main_is_offline_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    offline_by_default()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and hub_constants.HF_HUB_OFFLINE is True
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's choice stands
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    offline_by_default()
    assert os.environ["HF_HUB_OFFLINE"] == "0" and hub_constants.HF_HUB_OFFLINE is False


def test_every_command_listed_in_help_order_with_its_own_help() -> None:
    order = ["generate", "eval", "quantize", "calibrate", "prune", "info", "profile", "replay", "synth", "simulate",
             "simulate-tri", "sweep", "report", "serve"]  # fmt: skip
    assert list(COMMANDS) == order
    for name, cmd in all_commands().items():
        assert cmd.name == name and isinstance(cmd, TyperCommand) and not isinstance(cmd, TyperGroup)
        assert COMMANDS[name].help == cmd.get_short_help_str(limit=1000), name  # the listing shows the command's own
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and all(name in result.output for name in order)


def test_help_and_study_commands_load_no_torch(tmp_path: Path) -> None:
    """`moetier --help` and `moetier simulate` import neither torch nor transformers (a fresh process)."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from moetier.cli.app import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "r = CliRunner().invoke(app, ['simulate', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_unknown_command_is_refused() -> None:
    result = CliRunner().invoke(app, ["nosuch"])
    assert result.exit_code == 2 and "No such command" in result.output
