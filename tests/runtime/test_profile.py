"""`moetier profile`'s measurements in quick mode: a valid profile whose numbers are measured, not made up."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moetier.cli.profile import lut_table
from moetier.errors import ConfigError
from moetier.policies.costmodel import CostModel, load_profile, save_profile
from moetier.runtime.profile import ProfileOptions, disk_bandwidth, measure, n_steps, synthetic_experts
from moetier.specs import load_spec


def test_quick_profile_measures_this_machine(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    steps: list[str] = []
    opts = ProfileOptions(name="quick", quick=True, tmp_dir=tmp_path)
    prof, notes = measure(opts, steps.append)
    assert len(steps) == n_steps(opts.resolved()) and steps[0] == "cpu expert full"
    assert not any(tmp_path.iterdir())  # the disk test's temp file is gone
    cpu = prof.cpu
    assert set(cpu.luts) == {"full", "int8", "int4"} and cpu.lut_shape == (256, 128)
    assert set(cpu.small_luts) == set(cpu.luts) and cpu.small_shape == (128, 128)
    assert cpu.overhead_s == cpu.small_luts["full"][0][1]
    for pts in cpu.luts.values():
        assert [n for n, _ in pts] == [1, 4, 16] and all(0 < t < 0.5 for _, t in pts)
    assert cpu.mem_bw > 1e8 and cpu.peak_flops > 1e8
    # the engine's own overheads (runtime/profile_engine.py): measured, clamped at 0, never absurd
    assert all(0 <= x < 0.5 for x in (cpu.layer_overhead_s, cpu.token_overhead_s, cpu.dispatch_s))
    assert cpu.layer_overhead_s + cpu.token_overhead_s > 0
    assert prof.disk.bandwidth > 1e7 and "disk_cold" in notes and notes["quick"] is True
    # HybriMoE Fig. 3e: measured at decode load, recorded or 0 with the reason in the note
    assert "cpu first expert of a layer call" in steps
    assert cpu.first_expert_s >= 0
    note = notes["cpu.first_expert_s"]
    assert note.startswith("recorded: " if cpu.first_expert_s > 0 else "0: ")
    assert "4 full experts of H=256, I=128 at 1 token each, 3 calls" in note
    assert prof.cpu_threads == 1 and prof.host_mem_bytes > 1 << 28
    # the machine it came from, with the matrix ISAs (the simulators' --cpu-profile names it)
    assert re.search(r"AMX: (yes|no), AVX-512: (yes|no)\)", prof.source) or not Path("/proc/cpuinfo").exists()
    if not torch.cuda.is_available():
        assert prof.gpu is None and prof.pcie is None and prof.gpu_mem_bytes is None
    # it round-trips and prices the bundled model (256x128, the quick LUT's shape) with its LUT as measured
    again = load_profile(save_profile(prof, tmp_path / "q.json", notes))
    assert again == prof
    slow_first = replace(prof, cpu=replace(cpu, first_expert_s=2.5e-5))  # a recorded figure is written, too
    assert load_profile(save_profile(slow_first, tmp_path / "f.json")).cpu.first_expert_s == 2.5e-5
    cm = CostModel(again, load_spec("tiny-shakespeare-moe"), precision="int4")
    assert cm.expert_s("cpu", 4) == pytest.approx(dict(cpu.luts["int4"])[4] + cpu.dispatch_s)  # LUT + engine dispatch
    rows = lut_table(dict(cpu.luts))
    assert rows[0]["tokens"] == 1 and rows[0]["full_us"] == round(cpu.luts["full"][0][1] * 1e6, 1)


def test_synthetic_experts_are_the_engine_layouts() -> None:
    full = synthetic_experts("full", 256, 128, torch.device("cpu"), n_max=3)
    assert len(full) == 3 and full[0].w13.shape == (256, 256) and full[0].w13.dtype == torch.bfloat16
    q = synthetic_experts("int4", 256, 128, torch.device("cpu"), n_max=2)
    assert len(q) == 2 and torch.equal(q[0].row, q[1].row) and q[0].w13.bits == 4


def test_disk_bandwidth_reports_both_paths(tmp_path: Path) -> None:
    d = disk_bandwidth(ProfileOptions(disk_mb=4, tmp_dir=tmp_path, rounds=1))
    assert d["file_bytes"] == 4 << 20 and d["cold_method"] in ("O_DIRECT", "posix_fadvise(DONTNEED)")
    assert d["cold_bw"] > 0 and d["cached_bw"] > 0 and d["cached_latency_s"] > 0


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown precision"):
        ProfileOptions(precisions=("int3",)).resolved()
    with pytest.raises(ConfigError, match="multiples of 128"):
        ProfileOptions(hidden=100).resolved()
    with pytest.raises(ConfigError, match="first-expert step needs >= 3 experts"):
        ProfileOptions(first_experts=2).resolved()
