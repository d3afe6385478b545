"""cli_engine.engine_flags: the engine flags are declared once (EngineFlags) and reach generate, eval and
serve alike, as one EngineFlags; a command that cannot take them is refused when it is decorated."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import typer

from moetier.cli.app import load_command
from moetier.cli.engine_flags import DEFAULT_FLAGS, EngineFlags, engine_flags
from moetier.config import EngineConfig
from moetier.errors import ConfigError


def _options(name: str) -> dict[str, object]:
    """param name -> default of the click command `moetier NAME`."""
    cmd = load_command(name)
    return {p.name: p.default for p in cmd.params}


@pytest.mark.parametrize("command", ["generate", "eval", "serve"])
def test_every_engine_flag_is_an_option_with_its_default(command: str) -> None:
    opts = _options(command)
    for f in fields(EngineFlags):
        assert f.name in opts, f"{command} lacks --{f.name.replace('_', '-')}"
        assert opts[f.name] == f.default, f.name
    assert "flags" not in opts


def test_values_reach_the_command_as_one_engineflags() -> None:
    seen: list[EngineFlags] = []
    cli = typer.Typer()

    @cli.command()
    @engine_flags
    def go(name: str = "x", flags: EngineFlags = DEFAULT_FLAGS, last: int = 0) -> None:
        seen.append(flags)
        assert (name, last) == ("y", 3)

    from typer.testing import CliRunner

    out = CliRunner().invoke(cli, ["--name", "y", "--sparsity", "0.5", "--group", "int4=32", "--prefetch",
                                   "--host-expert-mem", "1MiB", "--last", "3"])  # fmt: skip
    assert out.exit_code == 0, out.output
    (flags,) = seen
    assert (flags.sparsity, flags.group, flags.prefetch, flags.host_expert_mem) == (0.5, ["int4=32"], True, 2**20)
    config = flags.config()
    assert isinstance(config, EngineConfig)
    assert config.precision.groups == (("int4", 32),) and config.budgets.host_expert_bytes == 2**20


def test_config_names_a_bad_value() -> None:
    with pytest.raises(ConfigError, match="unknown cache policy 'nope'"):
        EngineFlags(cache_policy="nope").config()
    with pytest.raises(ConfigError, match="--group takes PREC=SIZE"):
        EngineFlags(group=["int4"]).config()


def test_a_command_without_flags_or_with_its_own_engine_flag_is_refused() -> None:
    def no_flags(model: Path) -> None: ...

    def clash(device: str = "cpu", flags: EngineFlags = DEFAULT_FLAGS) -> None: ...

    with pytest.raises(TypeError, match="no `flags: EngineFlags`"):
        engine_flags(no_flags)
    with pytest.raises(TypeError, match="declares engine flags itself: device"):
        engine_flags(clash)
