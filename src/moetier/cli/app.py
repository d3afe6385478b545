"""The `moetier` command line: the typer app, its root options (--version), the registration of every command
(one module per command: generate, eval, quantize, calibrate, info, profile, replay, synth, simulate, sweep,
report, serve) and `main`, the console-script entry point.

Thin by design (DESIGN.md): each command module maps its flags (declared in options.py; the engine ones
gathered in engine_flags.EngineFlags) onto the frozen config dataclasses of moetier.config and calls the
Python API; console output, errors and progress bars are console.py's, tables tables.py's.
Invariants:
- every MoetierError, and any OSError on a file named by a flag, becomes one line
  `error: <message>` on stderr and exit code 2, never a traceback; bad flag values
  (an unparseable or negative size, an unknown device) exit 2 with click's message;
- with `--json`, stdout holds exactly one line, a JSON object; tokens, progress and
  tables go to stderr;
- `main` makes Hugging Face Hub access offline unless HF_HUB_OFFLINE is set explicitly; importing
  this module changes neither the environment nor huggingface_hub.
"""

from __future__ import annotations

import os
from typing import Annotated

import huggingface_hub.constants as hub_constants
import typer

from moetier import __version__
from moetier.cli import calibrate, generate, info, profile, quantize, replay, report, serve, simulate, sweep, synth
from moetier.cli import eval as eval_cmd
from moetier.cli import simulate_tri as simulate_tri_cmd

app = typer.Typer(
    name="moetier",
    help="Run Mixture-of-Experts LMs with expert weights in tiered, budgeted memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moetier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run Mixture-of-Experts LMs with expert weights in tiered, budgeted memory."""


# the order of `moetier --help`
for _command in (generate, eval_cmd, quantize, calibrate, info, profile, replay, synth, simulate, sweep, report, serve):
    _command.register(app)
simulate_tri_cmd.register(app)  # `moetier simulate-tri`, the three-domain machine


def offline_by_default() -> None:
    """HF_HUB_OFFLINE=1 unless the user set it. huggingface_hub read the variable when it was imported
    (before main ran), so its constant is updated too."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True


def main() -> None:
    """Console-script entry point (`moetier = "moetier.cli.app:main"`): offline by default, then the app."""
    offline_by_default()
    app()


if __name__ == "__main__":
    main()


__all__ = ["app", "main", "offline_by_default"]
