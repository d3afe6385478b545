"""`moetier profile`: measure this machine into a hardware profile, by default the user's
$XDG_CONFIG_HOME/moetier/profiles/NAME.json (~/.config/moetier/profiles/NAME.json), where `--profile NAME`
finds it before the shipped profiles (policies/hwprofile.py).

cli/app.py calls `register(app)`. The measurement is runtime/profile.py's; this module maps flags onto
ProfileOptions, shows a progress bar on stderr, prints a table and writes the JSON file.
Invariants (cli/app.py's): errors are one line `error: ...` with exit 2; with --json, stdout holds one JSON line;
nothing is written inside the installed package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moetier.cli.console import consoles, emit_json, progress_bar, register_command, user_errors
from moetier.cli.options import JsonOut
from moetier.errors import ConfigError
from moetier.policies.costmodel import profile_to_dict, save_profile
from moetier.policies.hwprofile import user_profiles_dir
from moetier.runtime.profile import ProfileOptions, measure, n_steps


def profile(
    out: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Where to write; default $XDG_CONFIG_HOME/moetier/profiles/NAME.json "
                                          "(~/.config/moetier/profiles/NAME.json), where --profile NAME finds it."),
    ] = None,
    name: Annotated[str, typer.Option(help="Profile name (also the default file name).")] = "this-machine",
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads to measure with; default torch's.")] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Few points, tiny sizes: seconds (tests, smoke runs).")
    ] = False,
    tmp_dir: Annotated[Path | None, typer.Option(metavar="DIR", help="Folder for the disk test's temp file.")] = None,
    json_out: JsonOut = False,
) -> None:
    """Measure this machine (expert compute vs tokens per precision, memory and disk bandwidth, host->GPU
    copies where CUDA exists) and write a hardware profile for the cost model and the simulator."""
    report, err = consoles(json_out)
    with user_errors():
        if not name or "/" in name:
            raise ConfigError(f"--name must be a plain file stem, got {name!r}")
        if tmp_dir is not None and not tmp_dir.is_dir():
            raise ConfigError(f"--tmp-dir {tmp_dir} is not a folder")
        opts = ProfileOptions(name=name, threads=threads, quick=quick, tmp_dir=tmp_dir).resolved()
        path = out if out is not None else user_profiles_dir() / f"{name}.json"
        with progress_bar(err) as progress:
            task = progress.add_task("profiling", total=n_steps(opts))
            started = [False]

            def step(desc: str) -> None:
                if started[0]:
                    progress.advance(task)
                started[0] = True
                progress.update(task, description=desc)

            prof, notes = measure(opts, step)
            progress.update(task, completed=n_steps(opts), description="done")
        written = save_profile(prof, path, notes)
        table = Table(title=f"{prof.name}: expert call time (us), H={opts.hidden} I={opts.inter}")
        rows = lut_table(dict(prof.cpu.luts))
        for col in rows[0]:
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(*(str(v) for v in r.values()))
        report.print(table)
        c = prof.cpu
        report.print(
            f"cpu: {c.mem_bw / 1e9:.2f} GB/s GEMV, {c.peak_flops / 1e9:.1f} GFLOP/s best expert rate, "
            f"{c.overhead_s * 1e6:.1f} us/expert, {c.layer_overhead_s * 1e6:.1f} us/layer, "
            f"first expert of a call +{c.first_expert_s * 1e6:.1f} us, {prof.cpu_threads} threads; "
            f"disk (page cache) {prof.disk.bandwidth / 1e9:.2f} GB/s; {notes['disk_cold']}",
            highlight=False,
        )
        if "cpu.first_expert_s" in notes:  # its note opens with the decision: recorded, or 0 and why
            report.print(f"first expert: {notes['cpu.first_expert_s'].split('. ', 1)[0]}", highlight=False)
        if prof.pcie is not None:
            report.print(f"host -> gpu: {prof.pcie.bandwidth / 1e9:.2f} GB/s (unverified path)", highlight=False)
        report.print(f"wrote {written}", highlight=False)
        if json_out:
            emit_json({"path": str(written), "profile": profile_to_dict(prof, notes)})


def lut_table(luts: dict[str, Sequence[tuple[int, float]]]) -> list[dict[str, Any]]:
    """Rows {tokens, <precision>_us, ...} for printing."""
    counts = sorted({n for pts in luts.values() for n, _ in pts})
    rows = []
    for n in counts:
        row: dict[str, Any] = {"tokens": n}
        for p, pts in luts.items():
            row[f"{p}_us"] = next((round(t * 1e6, 1) for m, t in pts if m == n), None)
        rows.append(row)
    return rows


def register(app: typer.Typer) -> None:
    """Add `moetier profile` to `app` (once)."""
    register_command(app, "profile", profile)
