"""Eq. 6's two contention readings (sim/ndp.py `busy_s`, schedule_tri_base's TriExpert.busy_s) and the
synthetic trace's drift knob and the compute-time utilisation of sim/tri.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies.schedule_tri_base import TriExpert
from moetier.policies.schedule_trimoe import schedule_trimoe
from moetier.sim.ndp import NdpMachine, NdpParams, price_call
from moetier.sim.tri import TriSimConfig, simulate_tri
from moetier.specs import ModelSpec, load_spec
from moetier.studies.sweep_tri import synthetic_calls
from moetier.types import Domain, ExpertKey, Layout

H, I = 64, 32  # noqa: E741
W = 3 * H * I * 2
SPEC = ModelSpec(name="tiny-tri", source="test", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2,
                 num_shared=1, hidden=H, moe_inter=I, shared_inter=I, dense_inter=0, num_heads=2,
                 num_kv_heads=2, head_dim=32, vocab=100)  # fmt: skip


def test_busy_s_by_reading() -> None:
    arr = NdpMachine(SPEC, ndp=NdpParams(contention="array"))
    ch = NdpMachine(SPEC, ndp=NdpParams())  # the default reading (issue 30): per channel
    # array: the bytes read from a DIMM at its internal (DRAM array) bandwidth
    assert arr.busy_s(Layout.STRIPED) == pytest.approx(W / 16 / 153.6e9)
    assert arr.busy_s(Layout.LOCALISED) == pytest.approx(W / 153.6e9)
    # channel: the whole channel transfer, T_DRAM
    assert ch.busy_s(Layout.STRIPED) == pytest.approx(ch.dram_s(Layout.STRIPED)) == pytest.approx(W / 307.2e9)
    assert ch.busy_s(Layout.LOCALISED) == pytest.approx(W * 8 / 307.2e9)  # its channel (8 channels)
    k = ExpertKey(0, 3)
    priced = price_call(arr, 0, {3: 2, 1: 1}, set(), {k: Layout.LOCALISED}, {k: 5}, shared_tokens=3)
    assert [e.busy_s for e in priced] == pytest.approx([arr.busy_s(Layout.STRIPED), arr.busy_s(Layout.LOCALISED), 0.0])
    with pytest.raises(ConfigError, match="contention must be one of channel, array"):
        NdpParams(contention="bus")
    with pytest.raises(ConfigError, match="contention"):
        TriSimConfig(contention="bus")


def _localised(e: int, ndp: float, busy: float | None) -> TriExpert:
    # CPU: calc 4, T_DRAM (localised) 2 -> cost 4; NDP on DIMM 0: max(ndp, internal .1)
    return TriExpert(ExpertKey(0, e), 4, False, Layout.LOCALISED, 0, 9.0, 4.0, ndp, 9.0, 2.0, 0.1, busy)


def test_refinement_moves_off_a_dimm_only_when_the_host_read_is_cheaper_there() -> None:
    """Three compute-bound cold experts on DIMM 0 (NDP 3 each, CPU 4 each): greedy puts all on NDP (9). Moving
    one to the CPU leaves DIMM 0 with 6 + the host read's busy time: T_DRAM = 2 under the channel reading (8),
    0.5 under the array reading (6.5); a second move would load the CPU to 8, so both stop after one."""
    for busy, want in ((None, 2.0 + 6.0), (0.5, 0.5 + 6.0)):
        s = schedule_trimoe([_localised(e, 3.0, busy) for e in range(3)], 2)
        assert s.greedy.makespan == pytest.approx(9.0)
        assert s.moves == 1 and sum(d == Domain.HOST for d in s.plan.domains.values()) == 1
        assert s.totals.dimm_s[0] == pytest.approx(want) and s.makespan == pytest.approx(want)
    # cheap on NDP (0.1 each): the CPU (4) never pays, nothing moves
    tiny = [_localised(e, 0.1, 0.5) for e in range(3)]
    assert schedule_trimoe(tiny, 2).moves == 0 and schedule_trimoe(tiny, 2).makespan == pytest.approx(0.3)


def test_drift_knob_changes_the_trace_and_is_checked() -> None:
    spec = load_spec("glm-4.5-air")
    base = TriSimConfig(batch_size=16, steps=3, regime="calm")
    a = synthetic_calls(spec, base)
    b = synthetic_calls(spec, replace(base, drift=0.02))  # the preset's own drift: the same trace
    c = synthetic_calls(spec, replace(base, drift=40.0))
    assert all(np.array_equal(x.ids, y.ids) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x.ids, z.ids) for x, z in zip(a, c, strict=True))
    with pytest.raises(ConfigError, match="drift must be a number >= 0"):
        TriSimConfig(drift=-1.0)


def test_contention_reading_reaches_the_simulation() -> None:
    spec = load_spec("glm-4.5-air")
    cfg = TriSimConfig(batch_size=64, steps=2, relayout=False)
    calls = synthetic_calls(spec, cfg)
    arr = simulate_tri(spec, calls, replace(cfg, contention="array"))
    ch = simulate_tri(spec, calls, cfg)  # the default: per channel
    assert arr.busy["dimm"] - arr.busy["ndp"] < ch.busy["dimm"] - ch.busy["ndp"]  # less contention per DIMM
    assert arr.moe_s <= ch.moe_s


def test_compute_time_never_exceeds_busy_time() -> None:
    """`compute` counts f_calc only: klotski's GPU is busy the whole MoE time but computes a small part of it
    (it waits on PCIe); on every system a domain computes no longer than it is busy."""
    spec = load_spec("glm-4.5-air")
    cfg = TriSimConfig(batch_size=64, steps=2)
    calls = synthetic_calls(spec, cfg)
    k = simulate_tri(spec, calls, replace(cfg, scheduler="klotski"))
    assert k.busy["gpu"] == pytest.approx(1.0) and 0 < k.compute["gpu"] < 0.5
    for name in ("ktransformers-plus", "monde", "trimoe"):
        r = simulate_tri(spec, calls, replace(cfg, scheduler=name))
        assert r.compute["gpu"] <= r.busy["gpu"] + 1e-9 and r.compute["cpu"] <= r.busy["cpu"] + 1e-9
        assert r.compute["ndp"] <= r.busy["ndp"] + 1e-9
