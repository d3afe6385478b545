"""`moetier quantize` killed with SIGKILL at chosen write steps leaves a tier that verifies or is resumed.

Each trial runs the `moetier quantize` command (cli/app.py's typer app, the code `python -m moetier.cli` runs) in a
forked child process on a tiny 3-layer checkpoint. In the child only, every write step of formats/quantize.py's
`_TierWriter` (`claim`'s and `end_layer`'s `_write_manifest`, `begin_layer` opening a layer's `.tmp` file, each
`_write` into it, `end_layer` fsyncing and renaming it) is wrapped so that entering and leaving it are numbered
points, in call order; the child SIGKILLs itself on reaching its trial's point. An uninterrupted run numbers the
points the same way, and the trials' points are chosen from that count (fixed seed): before the first manifest,
right after the last, after the first layer file's rename but before the manifest records it, and one at random
in each of the remaining equal strata of the points between (alternately a "before" and an "after" point). So
the outcome of every trial is known in advance, whatever the machine's speed, and is checked. Then the test checks
what the kill left:
- every layer the manifest records is complete, byte for byte the uninterrupted run's (never a partial layer);
- a kill inside a layer's writing left its `.tmp` file, never the layer file itself;
- `QuantTier.open(verify=True)` either refuses with a CheckpointError or succeeds with every layer identical;
- a rerun finishes with exit 0 to a tier identical to the uninterrupted run's (layer files and manifest records),
  leaving no `.tmp` file.

A fork rather than a fresh interpreter: importing torch and transformers costs seconds per process on a busy
machine, and the child runs the same command code (one thread: OMP_NUM_THREADS=1 from conftest, so the fork
inherits no thread pool). The wrapping is done after the fork, so the test process's `_TierWriter` is untouched.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.cli.app import app, load_command
from moetier.errors import CheckpointError
from moetier.formats.qtier import QuantTier
from moetier.formats.quantize import _TierWriter
from moetier.models.open import open_checkpoint
from moetier.models.tiny import build_tiny_checkpoint

pytestmark = pytest.mark.slow

PRECISIONS = ("int8", "int4", "int2")
TRIALS = 10
SEED = 18
# _TierWriter's methods that write to the tier directory; entering and leaving each is a kill point
WRITE_STEPS = ("_write_manifest", "begin_layer", "_write", "end_layer")


def number_write_steps(points: list[str], kill_at: int | None) -> None:
    """In a forked child only: wrap _TierWriter's WRITE_STEPS so that entering and leaving each appends
    "before NAME" / "after NAME" to `points`, and the process SIGKILLs itself on reaching point number `kill_at`
    (0-based, before appending it: a "before" point's step has not run, an "after" point's step has finished)."""

    def point(name: str) -> None:
        if len(points) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # delivered before kill() returns: nothing after it runs
        points.append(name)

    def numbered(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def wrapper(self: _TierWriter, *args: Any, **kwargs: Any) -> Any:
            point(f"before {name}")
            result = step(self, *args, **kwargs)
            point(f"after {name}")
            return result

        return wrapper

    for name in WRITE_STEPS:
        setattr(_TierWriter, name, numbered(name, getattr(_TierWriter, name)))


def fork_quantize(src: Path, out: Path, kill_at: int | None = None, points_file: Path | None = None) -> int:
    """Start `moetier quantize SRC --precisions int8,int4,int2 --out OUT` in a forked child; its pid.
    `kill_at`: the write-step point (number_write_steps) at which the child SIGKILLs itself, if any;
    `points_file`: where a child that ran to its end writes the points it passed, as a JSON list."""
    args = ["quantize", str(src), "--precisions", ",".join(PRECISIONS), "--out", str(out)]
    pid = os.fork()
    if pid == 0:  # the child: run the command, never return into pytest
        code = 98
        points: list[str] = []
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            number_write_steps(points, kill_at)
            app(args, prog_name="moetier")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            code = 99
        finally:
            try:
                if points_file is not None:
                    points_file.write_text(json.dumps(points))
            finally:
                os._exit(code)
    return pid


def wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def tier_state(out: Path) -> dict[str, dict[str, bytes]]:
    """tier name -> {file name -> bytes} of its layer files."""
    return {
        d.name: {f.name: f.read_bytes() for f in sorted(d.glob("layer-*.safetensors"))}
        for d in sorted(out.iterdir())
        if d.is_dir()
    }


def records(tier: Path) -> list[dict]:
    return json.loads((tier / "manifest.json").read_text())["layers"]


def outcome(out: Path, code: int) -> str:
    """finished | before-write (no manifest yet) | mid-write (a tier without every layer recorded) | killed-late."""
    if code == 0:
        return "finished"
    manifests = list(out.glob("*/manifest.json"))
    if not manifests:
        return "before-write"
    complete = [json.loads(m.read_text())["complete"] for m in manifests]
    return "mid-write" if len(manifests) < len(PRECISIONS) or not all(complete) else "killed-late"


def expected_outcome(points: list[str], kill_at: int) -> str:
    """What outcome() must say after a kill at point `kill_at` of the uninterrupted run's `points`."""
    if kill_at >= len(points):
        return "finished"
    written = points[: kill_at + 1].count("after _write_manifest")  # the point itself counts if it is an "after"
    if written == 0:
        return "before-write"
    return "killed-late" if written == points.count("after _write_manifest") else "mid-write"


def kill_points(points: list[str], rng: random.Random) -> list[int]:
    """TRIALS points of `points`, ascending: before the first manifest, after the last one, after the first layer
    file's rename but before its manifest record, and one per stratum of the points between the first two (seeded;
    alternately a "before" and an "after" point)."""
    first = points.index("before _write_manifest")
    last = len(points) - 1 - points[::-1].index("after _write_manifest")
    renamed = points.index("before _write_manifest", points.index("before end_layer"))  # inside end_layer
    chosen = {first, last, renamed}
    strata = TRIALS - len(chosen)
    inner = range(first + 1, last)
    for s in range(strata):
        stratum = inner[s * len(inner) // strata : (s + 1) * len(inner) // strata]
        phase = ("before ", "after ")[s % 2]
        candidates = [i for i in stratum if points[i].startswith(phase) and i not in chosen]
        chosen.add(rng.choice(candidates))
    assert len(chosen) == TRIALS
    return sorted(chosen)


def test_sigkill_at_random_points_never_leaves_a_partial_layer(tmp_path: Path) -> None:
    load_command("quantize")  # imported before forking: the children start at once
    src = build_tiny_checkpoint(
        "qwen3_moe", tmp_path / "model", num_hidden_layers=3, num_experts=8, hidden_size=64, moe_intermediate_size=64
    )
    reader = open_checkpoint(src, "auto", torch.device("cpu")).reader
    # 1. the uninterrupted run: the reference tiers and its numbered write-step points
    ref, points_file = tmp_path / "ref", tmp_path / "points.json"
    assert wait(fork_quantize(src, ref, points_file=points_file)) == 0
    points: list[str] = json.loads(points_file.read_text())
    want = tier_state(ref)
    want_records = {name: records(ref / name) for name in want}
    assert set(want) == {"int8-gK", "int4-g128", "int2-g64"} and all(len(files) == 3 for files in want.values())
    steps = Counter(p.split()[1] for p in points if p.startswith("before "))
    # per tier: one manifest at claim and one per layer, one .tmp opened, written to and renamed per layer
    assert steps["_write_manifest"] == 3 * (1 + 3) and steps["begin_layer"] == steps["end_layer"] == 3 * 3, steps
    assert steps["_write"] > 2 * steps["begin_layer"], steps  # a header and the experts' tensors per layer file
    assert len(points) == 2 * steps.total()
    chosen = kill_points(points, random.Random(SEED))
    expected = [expected_outcome(points, k) for k in chosen]
    assert Counter(expected) == {"before-write": 1, "mid-write": TRIALS - 2, "killed-late": 1}, (chosen, expected)
    outcomes: list[str] = []
    for trial, kill_at in enumerate(chosen):
        out = tmp_path / f"run{trial}"
        where = (trial, kill_at, points[kill_at])
        # 2. a run killed at its point
        code = wait(fork_quantize(src, out, kill_at=kill_at))
        assert code == -signal.SIGKILL, (where, code)
        outcomes.append(outcome(out, code))
        # 3. what it left: a layer being written is only a .tmp file; recorded layers are whole; open either
        # refuses or serves the reference bytes
        if points[kill_at].endswith(" _write"):
            assert list(out.glob("*/layer-*.safetensors.tmp")), where
        if points[kill_at - 1 : kill_at + 1] == ["before end_layer", "before _write_manifest"]:  # renamed, unrecorded
            assert any(
                {f.name for f in (out / name).glob("layer-*.safetensors")} > {r["file"] for r in records(out / name)}
                for name in want
            ), where
        for name in sorted(want):
            tier = out / name
            if not (tier / "manifest.json").exists():
                continue
            for rec in records(tier):
                assert (tier / rec["file"]).read_bytes() == want[name][rec["file"]], (where, name, rec["file"])
            precision = name.split("-")[0]
            try:
                opened = QuantTier.open(src, precision, root=out, reader=reader, verify=True)
            except CheckpointError as exc:
                assert "moetier quantize" in str(exc), (where, str(exc))  # names the command that finishes it
                continue
            opened.close()
            assert tier_state(out)[name] == want[name], (where, name)
        # 4. a rerun resumes and completes to the same tiers, with no partial file left
        assert wait(fork_quantize(src, out)) == 0, f"{where}: the rerun failed"
        assert tier_state(out) == want, where
        assert {name: records(out / name) for name in want} == want_records, where
        assert not list(out.rglob("*.tmp")), where
        for precision in PRECISIONS:
            QuantTier.open(src, precision, root=out, reader=reader, verify=True).close()
        shutil.rmtree(out)
    reader.close()
    assert outcomes == expected, list(zip(chosen, outcomes, expected, strict=True))
