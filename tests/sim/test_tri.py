"""Tests of the three-domain machine (sim/ndp.py) and its decode simulation (sim/tri.py): hand-checked
prices on a tiny model, conservation, domains and actions per scheduler (from its declared capabilities),
ablation flags, bad input. The schedulers' own tests are tests/policies/test_schedule_tri.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.policies.costmodel import save_profile
from moetier.policies.hwprofile import load_profile
from moetier.policies.predictor import PathTimes
from moetier.policies.schedulers import TRI_SCHEDULERS, make_tri_scheduler
from moetier.sim.ndp import GPU_ONLY, NdpMachine, NdpParams, load_ndp, ndp_from_dict, price_call
from moetier.sim.tri import TriSimConfig, machine_profile, simulate_tri
from moetier.specs import ModelSpec
from moetier.traces import Call
from moetier.types import Domain, ExpertKey, Layout

H, I = 64, 32  # noqa: E741
W = 3 * H * I * 2  # bytes of one bf16 expert
SPEC = ModelSpec(name="tiny-tri", source="test", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2,
                 num_shared=1, hidden=H, moe_inter=I, shared_inter=I, dense_inter=0, num_heads=2,
                 num_kv_heads=2, head_dim=32, vocab=100)  # fmt: skip


def _calls(steps: int = 6, T: int = 16, seed: int = 0) -> list[Call]:
    """Skewed routing: expert 0 hot, 1-2 warm, the rest cold."""
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.2, 0.2, 0.05, 0.05, 0.04, 0.03, 0.03])
    out = []
    for s in range(steps):
        for layer in (0, 1):
            ids = np.stack([rng.choice(8, size=2, replace=False, p=p) for _ in range(T)])  # [T, 2]
            out.append(Call(s, layer, ids, np.ones_like(ids, dtype=np.float32), None))
    return out


def test_ndp_defaults_are_table_1() -> None:
    n = load_ndp("h100-8470")
    assert (n.n_dimms, n.ndp_flops, n.ndp_bw, n.link_bw, n.host_bw) == (16, 256e9, 153.6e9, 25e9, 307.2e9)
    assert ndp_from_dict({"n_dimms": 8, "notes": "x"}).n_dimms == 8
    with pytest.raises(ConfigError, match="unknown keys"):
        ndp_from_dict({"dimms": 8})
    with pytest.raises(ConfigError, match="n_dimms"):
        NdpParams(n_dimms=0)
    with pytest.raises(ConfigError, match="unknown hardware profile"):
        load_ndp("no-such-profile")


def test_prices_by_hand() -> None:
    m = NdpMachine(SPEC, load_profile("h100-8470"), NdpParams(), cpu_scale=0.5)
    # GPU: 6*H*I*n FLOPs at 819.6 TFLOPS x 10% (flat below 64 tokens) + 10 us overhead
    assert m.gpu_calc(np.array([3]))[0] == pytest.approx(6 * H * I * 3 / (819.6e12 * 0.1) + 1e-5)
    # CPU at half the AMX peak; 32 tokens -> 11% of peak, + 20 us
    assert m.cpu_calc(np.array([32]))[0] == pytest.approx(6 * H * I * 32 / (90.1e12 * 0.5 * 0.11) + 2e-5)
    # NDP: GEMV at 256 GFLOPS + activations in and out at one DIMM's share of 307.2 GB/s
    assert m.ndp_calc(np.array([2]))[0] == pytest.approx(6 * H * I * 2 / 256e9 + 2 * 2 * H * 2 / (307.2e9 / 16))
    assert m.internal_s() == pytest.approx(W / 153.6e9)
    assert m.dram_s(Layout.STRIPED) == pytest.approx(W / 307.2e9)
    assert m.dram_s(Layout.LOCALISED) == pytest.approx(W * 8 / 307.2e9)  # its channel's 38.4 GB/s (8 channels)
    assert NdpMachine(SPEC, ndp=NdpParams(channels=16)).dram_s(Layout.LOCALISED) == pytest.approx(W * 16 / 307.2e9)
    with pytest.raises(ConfigError, match="channels"):
        NdpParams(channels=0)
    assert m.pcie_s() == pytest.approx(1e-5 + W / 64e9)
    assert m.link_s() == pytest.approx(W / 25e9)  # one expert over one DIMM-Link
    assert m.gpu_calc(np.array([0]))[0] == 0.0


@pytest.mark.parametrize("contention", ["array", "channel"])
def test_path_times_follow_eq_1_to_4(contention: str) -> None:
    """Each load's PathTimes equal eq. 1-4 computed for that load alone (clamped to >= 1 token)."""
    m = NdpMachine(SPEC, load_profile("h100-8470"), NdpParams(contention=contention), cpu_scale=0.5)
    pred = np.array([0.0, 1e-9, 0.25, 0.999, 1.0, 1.5, 3.0, 31.75, 64.0, 255.5, 1e4, 3.7e6])  # [n]
    every = m.path_times(pred)
    assert len(every) == pred.shape[0]
    p, ds, dl = m.pcie_s(), m.dram_s(Layout.STRIPED), m.dram_s(Layout.LOCALISED)
    for i, t in enumerate(every):
        n = np.asarray([max(float(pred[i]), 1.0)])
        g, c, nd = float(m.gpu_calc(n)[0]), float(m.cpu_calc(n)[0]), float(m.ndp_calc(n)[0])
        assert t == PathTimes(g, max(g, p, ds), max(g, p, dl), max(c, ds), max(c, dl), max(nd, m.internal_s()))
    assert m.path_times(np.zeros(0)) == []


def test_price_call_parts() -> None:
    m = NdpMachine(SPEC)
    k0, k3 = ExpertKey(1, 0), ExpertKey(1, 3)
    out = price_call(m, 1, {3: 2, 0: 5, 4: 0}, {k0}, {k3: Layout.LOCALISED}, {k3: 7}, shared_tokens=7)
    assert [tuple(e.key) for e in out] == [(1, 0), (1, 3), (1, -1)]
    e0, e3, sh = out
    assert e0.resident and e0.layout == Layout.STRIPED and e0.dimm == -1 and e0.tokens == 5
    assert not e3.resident and e3.dimm == 7 and e3.dram_s == pytest.approx(m.dram_s(Layout.LOCALISED))
    assert sh.resident and sh.tokens == 7 and sh.cpu_calc_s == GPU_ONLY
    with pytest.raises(ConfigError, match="outside"):
        price_call(m, 1, {8: 1}, set(), {}, {})


@pytest.mark.parametrize("name", sorted(TRI_SCHEDULERS))
def test_conservation_and_domains(name: str) -> None:
    calls = _calls()
    sched = make_tri_scheduler(name)
    r = simulate_tri(SPEC, calls, TriSimConfig(scheduler=name, ndp_count=4, hbm_ratio=0.25, context=64))
    routed = sum(len(np.unique(c.ids)) for c in calls)
    assert r.routed == routed == sum(r.experts.values())  # every routed expert computed once per call
    allowed = {"gpu"} | ({"cpu"} if Domain.HOST in sched.domains else set()) | (
        {"ndp"} if Domain.NDP in sched.domains else set())  # fmt: skip
    assert all(r.experts[d] == 0 for d in set(r.experts) - allowed)
    assert r.steps == 6 and r.calls == 12 and r.moe_s > 0 and r.throughput_tok_s > 0
    assert r.moe_s <= r.greedy_moe_s * (1 + 1e-9)
    assert r.migration["pcie_s"] <= r.migration["window_s"] + 1e-12
    assert r.migration["dimm_link_s"] <= r.migration["window_s"] + 1e-12
    if not sched.relayouts:
        assert r.migration["relayout"] == 0
    if not sched.rebalances:
        assert r.migration["migrate"] == 0
    if not sched.refines:
        assert r.moves == 0
    assert 0 <= r.predictor["accuracy"] <= 1 and r.predictor["calls"] == 10
    # experts computed from a localised layout: a subset per domain; none where nothing is ever localised
    assert all(0 <= r.localised[d] <= r.experts[d] for d in r.experts)
    assert all(r.localised_read_s[d] >= 0 and (r.localised_read_s[d] > 0) == (r.localised[d] > 0) for d in r.experts)
    if Domain.NDP not in sched.domains:
        assert sum(r.localised.values()) == 0


def test_ablation_flags() -> None:
    calls = _calls(steps=4, T=64)
    base = TriSimConfig(ndp_count=4, hbm_ratio=0.125, context=64)
    full = simulate_tri(SPEC, calls, base)
    no_ref = simulate_tri(SPEC, calls, TriSimConfig(ndp_count=4, hbm_ratio=0.125, context=64, refinement=False))
    no_rel = simulate_tri(SPEC, calls, TriSimConfig(ndp_count=4, hbm_ratio=0.125, context=64, relayout=False))
    assert no_ref.moves == 0 and no_ref.moe_s == pytest.approx(no_ref.greedy_moe_s)
    assert no_rel.migration["relayout"] == no_rel.migration["migrate"] == 0
    assert full.experts["cpu"] > 0  # +CPU: the trimoe system uses the AMX CPU
    assert full.localised["ndp"] > 0  # cold experts localised offline and computed in place
    gn = simulate_tri(SPEC, calls, TriSimConfig(scheduler="gpu-ndp", ndp_count=4, hbm_ratio=0.125, context=64))
    assert gn.experts["cpu"] == 0 and gn.experts["ndp"] > 0
    # pure function of its inputs
    again = simulate_tri(SPEC, calls, base)
    assert again.moe_s == full.moe_s and again.migration == full.migration


def test_cpu_scale_and_dimms_change_prices() -> None:
    calls = _calls(steps=2, T=64)
    slow = simulate_tri(SPEC, calls, TriSimConfig(scheduler="trimoe", cpu_tflops_scale=0.125, context=64))
    fast = simulate_tri(SPEC, calls, TriSimConfig(scheduler="trimoe", cpu_tflops_scale=2.0, context=64))
    assert slow.moe_s > fast.moe_s


def test_a_measured_cpu_profile_replaces_the_cpu_compute_only(tmp_path: Path) -> None:
    """cpu_profile: the named profile's CPU compute prices every CPU expert (here a profile 1e4x slower than
    Table 1's AMX, written as a measured profile would be), the host-memory reads stay the machine's DIMMs,
    the GPU is untouched, and the result names where its CPU came from."""
    base = load_profile("h100-8470")
    slow_cpu = replace(base.cpu, peak_flops=base.cpu.peak_flops / 1e4, luts={}, small_luts={})
    path = tmp_path / "amx-box.json"
    save_profile(replace(base, name="amx-box", source="measured by `moetier profile` on a test CPU", cpu=slow_cpu,
                         gpu=None, pcie=None, gpu_mem_bytes=None), path)  # fmt: skip
    cfg = TriSimConfig(cpu_profile=str(path))
    prof = machine_profile(cfg)
    assert prof.cpu == load_profile(str(path)).cpu and prof.gpu == base.gpu and prof.pcie == base.pcie
    assert "amx-box: measured by `moetier profile` on a test CPU" in prof.source
    m = NdpMachine(SPEC, prof)
    ref = NdpMachine(SPEC, base)
    tokens = np.array([1.0, 16.0, 64.0])
    over = base.cpu.overhead_s  # the same per-expert overhead: the compute part is 1e4x
    assert np.allclose(m.cpu_calc(tokens) - over, 1e4 * (ref.cpu_calc(tokens) - over), rtol=1e-9)
    assert m.dram_s(Layout.STRIPED) == ref.dram_s(Layout.STRIPED)
    assert np.array_equal(m.gpu_calc(tokens), ref.gpu_calc(tokens))
    calls = _calls(steps=2, T=64)
    fast = simulate_tri(SPEC, calls, TriSimConfig(ndp_count=4, context=64))
    slow = simulate_tri(SPEC, calls, TriSimConfig(ndp_count=4, context=64, cpu_profile=str(path)))
    assert slow.experts["cpu"] < fast.experts["cpu"] and slow.moe_s > fast.moe_s  # a slow CPU gets fewer experts
    assert slow.extra["cpu_source"].startswith("amx-box: ") and fast.extra["cpu_source"].startswith("h100-8470: ")
    with pytest.raises(ConfigError, match="unknown hardware profile 'nope'"):
        machine_profile(TriSimConfig(cpu_profile="nope"))
    with pytest.raises(ConfigError, match="cpu_profile must be a profile name or path"):
        TriSimConfig(cpu_profile="")


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match=r"klotski.*trimoe"):
        TriSimConfig(scheduler="nope")
    with pytest.raises(ConfigError, match="hbm_ratio"):
        TriSimConfig(hbm_ratio=1.5)
    with pytest.raises(ConfigError, match="ndp_count must be an int >= 1"):
        TriSimConfig(ndp_count=0)
    with pytest.raises(ConfigError, match="cpu_tflops_scale must be a number > 0"):
        TriSimConfig(cpu_tflops_scale=0.0)
    for name, bad in (("refinement", 1), ("relayout", "yes"), ("context", -1), ("max_iters", 1.5), ("seed", None)):
        with pytest.raises(ConfigError, match=name):
            TriSimConfig(**{name: bad})
    with pytest.raises(ConfigError, match="no layer calls"):
        simulate_tri(SPEC, [], TriSimConfig())
    ids = np.array([[0, 9]])
    with pytest.raises(ConfigError, match="ids must be"):
        simulate_tri(SPEC, [Call(0, 0, ids, ids.astype(np.float32), None)], TriSimConfig())
    ids = np.array([[0, 1]])
    with pytest.raises(ConfigError, match="not an MoE layer"):
        simulate_tri(SPEC, [Call(0, 5, ids, ids.astype(np.float32), None)], TriSimConfig())
    with pytest.raises(ConfigError, match="cpu_scale"):
        NdpMachine(SPEC, cpu_scale=0.0)
