"""No weight stays memory-mapped from the checkpoint (issue 18: a checkpoint truncated in place killed the
process with SIGBUS when the compute dtype was the checkpoint's own).

models/base.py reads every non-expert weight with pread into the process's own memory (formats/safetensors.py
read_tensor) at every dtype, and experts are read by pread into pool slots, so nothing of the checkpoint is
mapped: truncating it under a running engine can only fail the reads that still need it, cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moetier
from moetier import EngineConfig, RuntimeConfig


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize("dtype", ["auto", "bf16", "fp32"])
def test_no_checkpoint_file_is_mapped_after_load(ckpt_copy, dtype):
    path = ckpt_copy("qwen3_moe", "bf16")  # "auto" and "bf16": the checkpoint's own dtype
    engine = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype=dtype)))
    engine.store.preload()  # type: ignore[union-attr]
    engine.generate([5, 6, 7], 2)
    file = str((path / "model.safetensors").resolve())
    assert file not in mapped_files()
    engine.close()


SCRIPT = textwrap.dedent(
    """
    import struct, sys
    import moetier
    from moetier import Budgets, EngineConfig, RuntimeConfig
    from moetier.errors import ExpertReadError

    path, file = sys.argv[1], sys.argv[2]
    runtime = RuntimeConfig(device="cpu", dtype="auto")  # bf16: the checkpoint's own dtype
    resident = moetier.load(path, EngineConfig(runtime=runtime))
    resident.store.preload()  # every expert in memory
    probe = moetier.load(path, EngineConfig(runtime=runtime))
    slot = probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    offloaded = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=slot), runtime=runtime))
    prompt = [5, 17, 33, 41, 8]
    want = resident.generate(prompt, 6).token_ids
    assert offloaded.generate(prompt, 6).token_ids == want
    original = open(file, "rb").read()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    with open(file, "r+b") as f:  # truncated in place: every tensor's bytes gone
        f.truncate(header_end)
    assert resident.generate(prompt, 6).token_ids == want  # nothing read from the file after load
    print("RESIDENT-OK", flush=True)
    try:
        offloaded.generate(prompt, 6)
    except ExpertReadError as exc:
        assert exc.path == file and file in str(exc) and "end of file" in str(exc), exc
        print("READ-ERROR", exc, flush=True)
    with open(file, "r+b") as f:  # restored in place
        f.write(original)
    assert offloaded.generate(prompt, 6).token_ids == want
    print("RESTORED-OK", flush=True)
    """
)


@pytest.mark.slow
def test_truncated_checkpoint_at_own_dtype_never_sigbus(ckpt_copy, tmp_path):
    """In a subprocess (a SIGBUS would kill it with -7 / exit 135): generate at the checkpoint's own dtype,
    truncate the file to its header under the running engines, generate again."""
    path = ckpt_copy("qwen3_moe", "bf16")
    file = str(path / "model.safetensors")
    script = tmp_path / "truncate.py"
    script.write_text(SCRIPT)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(path), file], capture_output=True, text=True, timeout=300, env=env,
        cwd=Path(__file__).parent,
    )  # fmt: skip
    assert run.returncode not in (-7, 135), f"SIGBUS: {run.stderr[-2000:]}"
    assert run.returncode == 0, run.stderr[-2000:]
    assert "RESIDENT-OK" in run.stdout and "READ-ERROR" in run.stdout and "RESTORED-OK" in run.stdout
