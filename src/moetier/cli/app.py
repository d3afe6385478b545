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
- the Hugging Face Hub is reached only to resolve a hub id given as MODEL (cli/model_arg.py), and not at
  all when the user set HF_HUB_OFFLINE=1; once MODEL is resolved, the command runs offline
  (`offline_by_default`: HF_HUB_OFFLINE=1 unless the user set it); importing this module changes neither the
  environment nor huggingface_hub;
- a command's module is imported only when that command runs or shows its own help (`COMMANDS`,
  `LazyGroup`): `moetier --help` and the study commands (simulate, replay, synth, sweep, report) never
  import torch or transformers, which the engine's commands need and which take seconds to import.
  This is the one place that loads modules on demand, and nothing imports cli/, so it cannot hide an
  import cycle (tests/test_layers.py checks the rest of the tree has no import inside a function).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import huggingface_hub.constants as hub_constants
import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from moetier import __version__

if TYPE_CHECKING:  # the click types typer's classes use (typer vendors click as typer._click)
    from typer._click import Command, Context


@dataclass(frozen=True)
class Entry:
    """One command: the module whose `register(app)` adds it, and its one-line help in `moetier --help`
    (tests/cli/test_cli_app.py checks it is the command's own)."""

    module: str
    help: str


COMMANDS: dict[str, Entry] = {  # the order of `moetier --help`
    "generate": Entry("moetier.cli.generate",
                      "Generate text from a prompt, streaming tokens, then print timing and memory statistics."),
    "eval": Entry("moetier.cli.eval", "Perplexity of a text file over non-overlapping windows."),
    "quantize": Entry("moetier.cli.quantize", "Write quantized disk tiers of the routed experts, one per precision "
                      "(resumable: rerun to go on)."),
    "calibrate": Entry("moetier.cli.calibrate", "Thresholds of intra-expert activation sparsity: per MoE layer, "
                       "routed-expert sparsity 0-0.99 -> threshold on |act(gate x)| of routed experts (shared "
                       "experts stay dense; the engine turns a total target into a routed one)."),
    "prune": Entry("moetier.cli.prune", "Prune the least salient routed experts of each MoE layer by REAP's "
                   "saliency (gate weight x output norm, averaged over the tokens routed to the expert) on "
                   "calibration text; writes the file --prune reads."),
    "info": Entry("moetier.cli.info", "Shape of a checkpoint: family, layers, experts, top-k, sizes, expert and "
                  "non-expert bytes; its quantized tiers and sparsity table."),
    "profile": Entry("moetier.cli.profile", "Measure this machine (expert compute vs tokens per precision, memory "
                     "and disk bandwidth, host->GPU copies where CUDA exists) and write a hardware profile for the "
                     "cost model and the simulator."),
    "replay": Entry("moetier.cli.replay", "Replay a routing trace through cache policies: hit rate per layer, "
                    "overall and in decode."),
    "synth": Entry("moetier.cli.synth", "Write a synthetic routing trace from a model's preset, a fit to a "
                   "recorded trace, or a knobs file."),
    "simulate": Entry("moetier.cli.simulate", "Simulate a trace on a two-domain (GPU + CPU) machine profile: TTFT, "
                      "TBT, utilisation, hit rate, link bytes."),
    "simulate-tri": Entry("moetier.cli.simulate_tri", "Simulate decode on the three-domain GPU + AMX CPU + DIMM-NDP "
                          "machine (TriMoE): MoE and step time, busy time and FLOP utilisation per domain, predictor "
                          "accuracy, background migrations."),
    "sweep": Entry("moetier.cli.sweep", "Run a grid of simulations in parallel (processes or Ray), resumable; write "
                   "Parquet results and plots."),
    "report": Entry("moetier.cli.report", "Figures (PNG) and an HTML index of a run, a simulation or a routing trace."),
    "serve": Entry("moetier.cli.serve", "Serve the model over an OpenAI-compatible HTTP API (completions, chat, "
                   "streaming, /metrics)."),
}  # fmt: skip


def load_command(name: str) -> Command:
    """The click command `moetier NAME`, importing its module (ConfigError-free: NAME is a key of COMMANDS)."""
    one = typer.Typer(add_completion=False)
    importlib.import_module(COMMANDS[name].module).register(one)
    return typer.main.get_command(one)


def all_commands() -> dict[str, Command]:
    """Every command, loaded (the CLI reference and the tests; importing the engine's modules takes seconds)."""
    return {name: load_command(name) for name in COMMANDS}


class LazyGroup(TyperGroup):
    """The root group: lists COMMANDS from the table and imports a command's module only to run it or show
    its help. The listing (`moetier --help`) uses stand-ins that carry the table's one-line help."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        entry = COMMANDS.get(cmd_name)
        return None if entry is None else TyperCommand(name=cmd_name, help=entry.help)

    def resolve_command(
        self, ctx: Context, args: list[str]
    ) -> tuple[str | None, Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        return name, (load_command(name) if name in COMMANDS else cmd), rest


app = typer.Typer(
    cls=LazyGroup,
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


def offline_by_default() -> None:
    """HF_HUB_OFFLINE=1 unless the user set it. huggingface_hub read the variable when it was imported
    (before main ran), so its constant is updated too. Called by cli/model_arg.open_model once MODEL is
    resolved: the rest of the command (transformers reading the local checkpoint) never reaches the network."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True


def main() -> None:
    """Console-script entry point (`moetier = "moetier.cli.app:main"`). The Hub stays reachable (unless
    HF_HUB_OFFLINE is set) until a command has resolved its MODEL (cli/model_arg.open_model), which then
    makes the rest of the run offline."""
    app()


if __name__ == "__main__":
    main()


__all__ = ["COMMANDS", "Entry", "LazyGroup", "all_commands", "app", "load_command", "main", "offline_by_default"]
