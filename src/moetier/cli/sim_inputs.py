"""What `moetier simulate` (simulate.py) and `moetier simulate-tri` (simulate_tri.py) share: the flags naming
the routing to replay (--spec, --trace, --synthetic, --seed) and turning them into a model spec and its
layer calls.

Invariants: exactly one of --trace and --synthetic; --synthetic needs --spec; a trace's spec comes from
--spec or the trace's metadata and must agree with it on experts and top-k (TraceError otherwise); a missing
trace file is `error: PATH: no such file`. Nothing here imports another command module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetier import traces
from moetier.cli.console import require_trace
from moetier.errors import ConfigError, TraceError
from moetier.specs import ModelSpec, load_spec, spec_from_trace_metadata

PANEL = "Simulation"
SpecOpt = Annotated[str | None, typer.Option("--spec", rich_help_panel=PANEL,
                    help="Model spec: a shipped spec name, a spec .json, or a checkpoint folder "
                         "(default: the trace's).")]  # fmt: skip
TraceOpt = Annotated[Path | None, typer.Option("--trace", rich_help_panel=PANEL, help="Routing trace (.parquet).")]
SyntheticOpt = Annotated[bool, typer.Option("--synthetic", rich_help_panel=PANEL,
                         help="Generate a synthetic trace from the spec's preset (studies.synthetic).")]  # fmt: skip
SeedOpt = Annotated[int, typer.Option("--seed", rich_help_panel=PANEL, help="Synthetic trace and prediction seed.")]


def source_spec(spec_name: str | None, trace: Path | None, synthetic: bool) -> ModelSpec | None:
    """Checks that exactly one of --trace and --synthetic is given; the --spec a synthetic trace needs, else None."""
    if (trace is None) == (not synthetic):
        raise ConfigError("give exactly one of --trace TRACE and --synthetic")
    if not synthetic:
        return None
    if spec_name is None:
        raise ConfigError("--synthetic needs --spec")
    return load_spec(spec_name)


def trace_calls(spec_name: str | None, trace: Path) -> tuple[ModelSpec, list[traces.Call], str]:
    """(spec, every layer call of the trace, source line) of --trace, the spec from --spec or the metadata."""
    require_trace(trace)
    loaded = traces.load(trace)
    spec = load_spec(spec_name) if spec_name else spec_from_trace_metadata(loaded.metadata)
    if spec is None:
        raise ConfigError(f"{trace}: no spec matches the trace's metadata; name one with --spec")
    meta = loaded.metadata
    if int(meta["num_experts"]) != spec.num_experts or int(meta["top_k"]) != spec.top_k:
        raise TraceError(f"{trace}: trace has {meta['num_experts']} experts, top-{meta['top_k']}; spec "
                         f"{spec.name!r} has {spec.num_experts}, top-{spec.top_k}")  # fmt: skip
    return spec, traces.iter_calls(loaded), str(trace)


__all__ = ["PANEL", "SeedOpt", "SpecOpt", "SyntheticOpt", "TraceOpt", "source_spec", "trace_calls"]
