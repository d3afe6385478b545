"""cli/app.py: importing the command line changes nothing; `main` makes the Hub offline unless the user chose;
every command is registered once, in the order of `moetier --help`."""

from __future__ import annotations

import os
import subprocess
import sys

import huggingface_hub.constants as hub_constants
import pytest

from moetier.cli.app import app, offline_by_default

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


def test_every_command_registered_once_in_help_order() -> None:
    names = [c.name for c in app.registered_commands]
    assert len(names) == len(set(names)), names
    order = ["generate", "eval", "quantize", "calibrate", "info", "profile", "replay", "synth", "simulate", "sweep",
             "report", "serve"]  # fmt: skip
    assert [n for n in names if n in order] == order  # (simulate-tri is registered by its own module's line)
