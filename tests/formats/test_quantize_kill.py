"""`moetier quantize` killed with SIGKILL at random points leaves a tier that verifies or is resumed.

Each trial runs the `moetier quantize` command (cli/app.py's typer app, the code `python -m moetier.cli` runs) in a
forked child process on a tiny 3-layer checkpoint, SIGKILLs it after a random delay spread over an uninterrupted
run's duration (one in each tenth of it, fixed seed), then checks what the kill left:
- every layer the manifest records is complete, byte for byte the uninterrupted run's (never a partial layer);
- `QuantTier.open(verify=True)` either refuses with a CheckpointError or succeeds with every layer identical;
- a rerun finishes with exit 0 to a tier identical to the uninterrupted run's (layer files and manifest records),
  leaving no `.tmp` file.

A fork rather than a fresh interpreter: importing torch and transformers costs seconds per process on a busy
machine, and the child runs the same command code (one thread: OMP_NUM_THREADS=1 from conftest, so the fork
inherits no thread pool).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from moetier.cli.app import app, load_command
from moetier.errors import CheckpointError
from moetier.formats.qtier import QuantTier
from moetier.models.open import open_checkpoint
from moetier.models.tiny import build_tiny_checkpoint

pytestmark = pytest.mark.slow

PRECISIONS = ("int8", "int4", "int2")
TRIALS = 10
SEED = 18


def fork_quantize(src: Path, out: Path) -> int:
    """Start `moetier quantize SRC --precisions int8,int4,int2 --out OUT` in a forked child; its pid."""
    args = ["quantize", str(src), "--precisions", ",".join(PRECISIONS), "--out", str(out)]
    pid = os.fork()
    if pid == 0:  # the child: run the command, never return into pytest
        code = 98
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            app(args, prog_name="moetier")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            code = 99
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


def test_sigkill_at_random_points_never_leaves_a_partial_layer(tmp_path: Path) -> None:
    load_command("quantize")  # imported before forking: the children start at once
    src = build_tiny_checkpoint(
        "qwen3_moe", tmp_path / "model", num_hidden_layers=3, num_experts=8, hidden_size=64, moe_intermediate_size=64
    )
    reader = open_checkpoint(src, "auto", torch.device("cpu")).reader
    # 1. the uninterrupted run: the reference tiers and the run's duration
    ref = tmp_path / "ref"
    t0 = time.monotonic()
    assert wait(fork_quantize(src, ref)) == 0
    duration = time.monotonic() - t0
    want = tier_state(ref)
    want_records = {name: records(ref / name) for name in want}
    assert set(want) == {"int8-gK", "int4-g128", "int2-g64"} and all(len(files) == 3 for files in want.values())
    rng = random.Random(SEED)
    outcomes: list[str] = []
    for trial in range(TRIALS):
        out = tmp_path / f"run{trial}"
        # 2. kill a run at a random point of its duration
        delay = (trial + rng.random()) / TRIALS * duration  # stratified: every tenth of the run gets one kill
        pid = fork_quantize(src, out)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
        assert code in (0, -signal.SIGKILL), f"trial {trial}: exit {code}"
        outcomes.append(outcome(out, code))
        # 3. what it left: recorded layers are whole; open either refuses or serves the reference bytes
        for name in sorted(want):
            tier = out / name
            if not (tier / "manifest.json").exists():
                continue
            for rec in records(tier):
                assert (tier / rec["file"]).read_bytes() == want[name][rec["file"]], (trial, delay, name, rec["file"])
            precision = name.split("-")[0]
            try:
                opened = QuantTier.open(src, precision, root=out, reader=reader, verify=True)
            except CheckpointError as exc:
                assert "moetier quantize" in str(exc), (trial, str(exc))  # names the command that finishes it
                continue
            opened.close()
            assert tier_state(out)[name] == want[name], (trial, delay, name)
        # 4. a rerun resumes and completes to the same tiers, with no partial file left
        assert wait(fork_quantize(src, out)) == 0, f"trial {trial}: the rerun failed"
        assert tier_state(out) == want, (trial, delay)
        assert {name: records(out / name) for name in want} == want_records, (trial, delay)
        assert not list(out.rglob("*.tmp")), (trial, delay)
        for precision in PRECISIONS:
            QuantTier.open(src, precision, root=out, reader=reader, verify=True).close()
        shutil.rmtree(out)
    reader.close()
    assert outcomes.count("mid-write") >= 2, outcomes  # the delays did land inside the writing
