"""docs/guide/cli.md is what tools/gen_cli_reference.py renders from the typer app now (never stale)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "tools" / "gen_cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current() -> None:
    tool = _tool()
    current = tool.TARGET.read_text(encoding="utf-8")
    assert current == tool.render(), "docs/guide/cli.md is stale: run python tools/gen_cli_reference.py"


def test_cli_reference_lists_every_command_and_flag() -> None:

    from moetier.cli.app import all_commands

    text = (ROOT / "docs" / "guide" / "cli.md").read_text(encoding="utf-8")
    commands = all_commands()
    assert len(commands) >= 12
    for name, cmd in commands.items():
        section = text.split(f"## `moetier {name}`", 1)
        assert len(section) == 2, f"no section for moetier {name}"
        body = re.split(r"\n## ", section[1], maxsplit=1)[0]
        for param in cmd.params:
            if param.name != "help" and param.param_type_name == "option":
                assert f"`{param.opts[0]}" in body, f"moetier {name} {param.opts[0]} missing from cli.md"
