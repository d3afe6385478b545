"""`moetier profile`'s measurements in quick mode: a valid profile whose numbers are measured, not made up.

The quick run on this machine is checked for structure only (finite, >= 0, not absurd): its figures are single
timings on a possibly busy machine. The engine-overhead arithmetic (runtime/profile_engine.py) is checked exactly
on synthetic timings instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import moetier.runtime.profile as profile_mod
import moetier.runtime.profile_engine as profile_engine
from moetier.cli.profile import lut_table
from moetier.errors import ConfigError
from moetier.policies.costmodel import (
    ComputeProfile,
    CostModel,
    HardwareProfile,
    LinkProfile,
    load_profile,
    save_profile,
)
from moetier.runtime.profile import ProfileOptions, disk_bandwidth, measure, n_steps, synthetic_experts
from moetier.runtime.profile_engine import EngineOverheads, engine_overheads
from moetier.specs import ModelSpec, load_spec

# Beyond this, a time of the quick run (one expert call, one decoded token of a 256-wide model, one overhead) is
# a unit or arithmetic error, not a busy machine: typical figures are 1e-5 .. 1e-2 s.
ABSURD_S = 5.0


def test_quick_profile_measures_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    seen: list[EngineOverheads] = []  # what measure() got from the engine runs, raw timings included
    real_overheads = profile_mod.engine_overheads

    def spy(*args: Any, **kwargs: Any) -> EngineOverheads:
        seen.append(real_overheads(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(profile_mod, "engine_overheads", spy)
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
        assert [n for n, _ in pts] == [1, 4, 16] and all(0 < t < ABSURD_S for _, t in pts)
    # rates of single timings: a stalled run makes them small, never 0, negative or infinite
    for rate in (cpu.mem_bw, cpu.peak_flops, prof.disk.bandwidth):
        assert math.isfinite(rate) and rate > 0
    assert "disk_cold" in notes and notes["quick"] is True
    # the engine's own overheads (runtime/profile_engine.py; arithmetic: test_engine_overheads_invert_*):
    # differences of single timings clamped at 0, so 0 is a valid figure; what is checked is that they come
    # from real decode runs (times > 0, misses counted) through that arithmetic, into the profile
    assert len(seen) == 1
    eng = seen[0]
    assert (cpu.layer_overhead_s, cpu.token_overhead_s, cpu.dispatch_s) == (
        eng.layer_overhead_s, eng.token_overhead_s, eng.dispatch_s,
    )  # fmt: skip
    assert prof.disk.latency_s >= eng.miss_latency_s
    overheads = (eng.layer_overhead_s, eng.token_overhead_s, eng.dispatch_s, eng.miss_latency_s)
    assert all(math.isfinite(x) and 0 <= x < ABSURD_S for x in overheads), overheads
    raw = eng.raw
    decode = {k: v for k, v in raw.items() if k.startswith("decode_s_")}  # seconds per token of each run
    assert len(decode) == 4 and all(math.isfinite(v) and 0 < v < ABSURD_S for v in decode.values()), decode
    assert raw["misses_per_token"] > 0.5  # a quarter of the experts resident: most expert calls miss
    assert raw["layer_s"] == pytest.approx((raw["decode_s_6_layers_top4"] - raw["decode_s_2_layers_top4"]) / 4)
    assert cpu.layer_overhead_s == pytest.approx(max(0.0, raw["layer_s"] - raw["priced_layer_s"]))
    assert str(raw) in notes["cpu.layer_overhead_s"]
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


# The engine-overhead arithmetic on synthetic timings ----------------------------------------------------------
# A fixed spec (the l2k4 checkpoint profile_engine builds: SHAPE at depth 2, top-4) and a fixed profile whose
# priced parts (dense layer, expert call, LM head, a miss's bytes) are of the same order as the overheads, so
# forgetting to subtract any of them shows.
SPEC = ModelSpec(
    name="l2k4", source="synthetic", num_layers=2, moe_layers=(0, 1), num_experts=16, top_k=4, num_shared=0,
    hidden=256, moe_inter=128, shared_inter=0, dense_inter=0, num_heads=4, num_kv_heads=2, head_dim=64, vocab=2048,
)  # fmt: skip
CLEAN = HardwareProfile(
    name="fixed", source="synthetic",
    cpu=ComputeProfile(peak_flops=1e12, mem_bw=2e10, overhead_s=1e-6, luts={"full": ((1, 2e-5), (4, 3e-5))},
                       lut_shape=(256, 128), dense_bw=1e10),
    gpu=None, pcie=None, disk=LinkProfile(bandwidth=2e9), cpu_threads=1, host_mem_bytes=1 << 30, gpu_mem_bytes=None,
)  # fmt: skip


@pytest.mark.parametrize(
    "dispatch, layer_oh, token_oh, miss_lat, misses, want",
    [
        # every overhead recovered exactly
        (3e-6, 4e-5, 2.5e-4, 9e-5, 2.5, (4e-5, 2.5e-4, 3e-6, 9e-5)),
        # an engine faster than priced: clamped at 0 (layer: 4 * -1e-6 - 5e-6 < 0); too few misses to price one
        (-1e-6, -5e-6, -1e-5, 9e-5, 0.25, (0.0, 0.0, 0.0, 0.0)),
    ],
)
def test_engine_overheads_invert_a_linear_decode_time(
    monkeypatch: pytest.MonkeyPatch,
    dispatch: float,
    layer_oh: float,
    token_oh: float,
    miss_lat: float,
    misses: float,
    want: tuple[float, float, float, float],
) -> None:
    """Decode time t(L, k) = c + L * (l + k * e) (+ misses * (bytes / bandwidth + latency) under the quarter
    budget), built from the priced parts plus known overheads; engine_overheads must give those overheads back."""
    tokens = 8
    cm = CostModel(CLEAN, SPEC)  # no overheads in CLEAN: these are the priced parts alone
    e = cm.expert_s("cpu", 1) + dispatch  # one expert call
    l_ = cm.dense_s("cpu", 1, 16 + tokens // 2) + layer_oh  # one layer beside its experts, at the mean KV length
    c = cm.head_s("cpu", 1) + token_oh  # the rest of a token
    per_miss = cm.expert_nbytes / CLEAN.disk.bandwidth + miss_lat
    built: dict[Path, tuple[int, int]] = {}
    calls: list[tuple[tuple[int, int], float | None]] = []

    def fake_checkpoint(folder: Path, layers: int, top_k: int) -> Path:  # a name only: nothing is built
        path = folder / f"synthetic-{layers}-{top_k}"
        built[path] = (layers, top_k)
        return path

    def fake_load_spec(name: str) -> ModelSpec:
        assert built[Path(name)] == (2, 4)  # priced on the shallow top-4 checkpoint's spec
        return SPEC

    def fake_decode_s(path: Path, n: int, rounds: int, budget_frac: float | None = None) -> tuple[float, float]:
        layers, k = built[path]
        calls.append(((layers, k), budget_frac))
        assert (n, rounds) == (tokens, 2)
        t = c + layers * (l_ + k * e)
        return (t + misses * per_miss, misses) if budget_frac is not None else (t, 0.0)

    monkeypatch.setattr(profile_engine, "_checkpoint", fake_checkpoint)
    monkeypatch.setattr(profile_engine, "load_spec", fake_load_spec)
    monkeypatch.setattr(profile_engine, "_decode_s", fake_decode_s)
    # the profile's own overheads are ignored: pricing with them would shift every figure
    given = replace(CLEAN, cpu=replace(CLEAN.cpu, layer_overhead_s=1e-3, token_overhead_s=1e-3, dispatch_s=1e-3))
    got = engine_overheads(given, tokens=tokens, rounds=2)
    assert sorted(calls, key=repr) == sorted(
        [((2, 4), None), ((6, 4), None), ((6, 8), None), ((6, 4), 0.25)], key=repr
    )  # fmt: skip
    assert (got.layer_overhead_s, got.token_overhead_s, got.dispatch_s, got.miss_latency_s) == pytest.approx(want)
    # the unclamped figures behind them, in raw
    assert got.raw["per_expert_s"] == pytest.approx(e)
    assert got.raw["layer_s"] == pytest.approx(l_ + 4 * e)
    assert got.raw["decode_s_2_layers_top4"] == pytest.approx(c + 2 * (l_ + 4 * e))
    assert got.raw["per_miss_s"] == pytest.approx(per_miss if misses > 0.5 else 0.0)


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
