"""Cost model: LUT interpolation and scaling, roofline with the efficiency curve, moves, dense layer time,
work() pricing, and profile files (shipped ones load; save/load round-trips; bad files are clear errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetier.errors import ConfigError
from moetier.policies.costmodel import (
    ComputeProfile,
    CostModel,
    HardwareProfile,
    LinkProfile,
    load_profile,
    profile_from_dict,
    profile_names,
    profile_to_dict,
    save_profile,
    token_counts,
)
from moetier.policies.hwprofile import SHIPPED_PROFILES
from moetier.specs import ModelSpec, load_spec
from moetier.types import ExpertKey

PAPER_PROFILES = ("a6000-5220r", "a6000", "rtx5090", "h100-8470")


def _spec(**kw: object) -> ModelSpec:
    base: dict[str, object] = dict(
        name="t", source="test", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, num_shared=0,
        hidden=256, moe_inter=128, shared_inter=0, dense_inter=0, num_heads=4, num_kv_heads=2, head_dim=64,
        vocab=100,
    )  # fmt: skip
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


def _profile(cpu: ComputeProfile, gpu: ComputeProfile | None = None) -> HardwareProfile:
    return HardwareProfile(
        name="p", source="test", cpu=cpu, gpu=gpu, pcie=LinkProfile(10e9, 1e-5) if gpu else None,
        disk=LinkProfile(1e9, 1e-4), cpu_threads=2, host_mem_bytes=1 << 30, gpu_mem_bytes=(1 << 30) if gpu else None,
    )  # fmt: skip


def test_lut_interpolates_extrapolates_and_scales_by_params() -> None:
    lut = ((1, 10e-6), (4, 16e-6), (16, 40e-6))
    cpu = ComputeProfile(peak_flops=1e12, mem_bw=1e10, overhead_s=0.0, luts={"full": lut}, lut_shape=(256, 128))
    cm = CostModel(_profile(cpu), _spec())
    assert cm.expert_s("cpu", 1) == pytest.approx(10e-6)
    assert cm.expert_s("cpu", 2) == pytest.approx(12e-6)  # between (1, 10) and (4, 16)
    assert cm.expert_s("cpu", 10) == pytest.approx(28e-6)  # between (4, 16) and (16, 40)
    assert cm.expert_s("cpu", 32) == pytest.approx(72e-6)  # last segment's slope 2us/token, extrapolated
    assert cm.expert_s("cpu", 0) == 0.0
    # a spec with 4x the expert params (H*I) costs 4x the LUT
    big = CostModel(_profile(cpu), _spec(hidden=512, moe_inter=256))
    assert big.expert_s("cpu", 4) == pytest.approx(4 * 16e-6)
    # no LUT for int4: roofline on int4 bytes instead
    q = CostModel(_profile(cpu), _spec(), precision="int4")
    assert q.expert_s("cpu", 1) == pytest.approx(_spec().expert_bytes("int4") / 1e10)


def test_two_shape_luts_are_linear_in_params() -> None:
    # measured: 1 token costs 20 us on a 128x128 expert and 100 us on 1024x256 (8 us fixed + streaming)
    cpu = ComputeProfile(peak_flops=1e12, mem_bw=1e10, overhead_s=0.0, luts={"full": ((1, 100e-6), (4, 200e-6))},
                         lut_shape=(1024, 256), small_luts={"full": ((1, 20e-6), (4, 30e-6))},
                         small_shape=(128, 128))  # fmt: skip
    ref, small = 1024 * 256, 128 * 128
    at = {p: CostModel(_profile(cpu), _spec(hidden=h, moe_inter=i)) for p, (h, i) in
          {ref: (1024, 256), small: (128, 128), 256 * 128: (256, 128), 4 * ref: (2048, 512)}.items()}  # fmt: skip
    assert at[ref].expert_s("cpu", 1) == pytest.approx(100e-6) and at[small].expert_s("cpu", 4) == pytest.approx(30e-6)
    # the bundled model's 256x128 expert: the fixed cost stays (plain scaling would say 100/8 = 12.5 us)
    assert at[256 * 128].expert_s("cpu", 1) == pytest.approx(20e-6 + 80e-6 * (256 * 128 - small) / (ref - small))
    assert at[4 * ref].expert_s("cpu", 2) > 4 * at[ref].expert_s("cpu", 2) - 3 * 20e-6  # linear beyond the ref
    with pytest.raises(ConfigError, match="fewer params"):
        ComputeProfile(peak_flops=1, mem_bw=1, overhead_s=0, luts={"full": ((1, 1.0),)}, lut_shape=(128, 128),
                       small_luts={"full": ((1, 1.0),)}, small_shape=(256, 128))  # fmt: skip


def test_roofline_memory_then_compute_bound_with_efficiency_curve() -> None:
    spec = _spec(hidden=4096, moe_inter=14336)  # 352 MB expert at bf16
    nbytes, fpt = spec.expert_bytes(), 2 * 3 * 4096 * 14336
    gpu = ComputeProfile(peak_flops=100e12, mem_bw=1e12, overhead_s=5e-6, efficiency=((64, 0.1), (256, 0.3)))
    cm = CostModel(_profile(ComputeProfile(peak_flops=1e12, mem_bw=1e11, overhead_s=0.0), gpu), spec)
    assert cm.expert_s("gpu", 1) == pytest.approx(nbytes / 1e12 + 5e-6)  # memory-bound at 1 token
    # 256 tokens: compute at 30% of peak (TriMoE's H100 observation), slower than streaming the weights
    assert cm.expert_s("gpu", 256) == pytest.approx(256 * fpt / 30e12 + 5e-6)
    assert cm.expert_s("gpu", 4096) == pytest.approx(4096 * fpt / 30e12 + 5e-6)  # flat beyond the last point
    times = [cm.expert_s("gpu", n) for n in (1, 2, 8, 32, 64, 128, 256, 512)]
    assert times == sorted(times)
    assert cm.expert_s("cpu", 64) == pytest.approx(64 * fpt / 1e12)  # no curve: full peak


def test_moves_dense_and_errors() -> None:
    spec = load_spec("qwen3moe-bench")
    cpu = ComputeProfile(peak_flops=1e11, mem_bw=2e10, overhead_s=0.0, dense_bw=1e10, layer_overhead_s=50e-6)
    cm = CostModel(_profile(cpu), spec)
    assert cm.move_s("disk", spec.expert_bytes()) == pytest.approx(1e-4 + spec.expert_bytes() / 1e9)
    assert cm.move_s("disk", 0) == 0.0
    # decode: attention + router weights and the KV cache read at dense_bw, plus the layer overhead
    ctx = 100
    want = (spec.layer_dense_params() * 2 + ctx * spec.kv_bytes_per_token()) / 1e10 + 50e-6
    assert cm.dense_s("cpu", 1, ctx) == pytest.approx(want)
    assert cm.dense_s("cpu", 1, 1000) > cm.dense_s("cpu", 1, 10)
    with pytest.raises(ConfigError, match="no dense"):
        cm.dense_s("cpu", 1, 10, moe=False)
    lite = CostModel(_profile(cpu), load_spec("deepseek-v2-lite"))
    assert lite.dense_s("cpu", 1, 10, moe=False) > 5 * lite.dense_s("cpu", 1, 10)  # its layer 0 MLP: 10944 wide
    with pytest.raises(ConfigError, match="no GPU"):
        cm.expert_s("gpu", 1)
    with pytest.raises(ConfigError, match="no PCIe"):
        cm.move_s("pcie", 10)
    with pytest.raises(ConfigError, match="unknown link"):
        cm.move_s("nvlink", 10)
    with pytest.raises(ConfigError, match="unknown precision"):
        CostModel(_profile(cpu), spec, precision="fp8")


def test_work_prices_routed_and_shared_experts() -> None:
    spec = load_spec("deepseek-v2-lite")
    cm = CostModel(load_profile("a6000-5220r"), spec)
    counts = token_counts([[3, 1], [3, 7], [3, 1]])
    assert counts == {3: 3, 1: 2, 7: 1}
    work = cm.work(5, counts, cached={ExpertKey(5, 3)}, shared_tokens=3)
    assert [w.key for w in work] == [ExpertKey(5, 1), ExpertKey(5, 3), ExpertKey(5, 7), ExpertKey(5, -1),
                                     ExpertKey(5, -2)]  # fmt: skip
    by = {w.key.expert: w for w in work}
    assert by[3].cached and not by[1].cached and by[-1].cached
    assert by[3].tokens == 3 and by[-2].tokens == 3
    assert by[1].fast_s == pytest.approx(cm.expert_s("gpu", 2))
    assert by[1].slow_s == pytest.approx(cm.expert_s("cpu", 2))
    assert by[1].move_s == pytest.approx(cm.move_s("pcie", spec.expert_bytes()))
    assert by[1].nbytes == spec.expert_bytes() and by[-1].nbytes == spec.shared_bytes()
    # CPU-only substrate: fast = cpu, no slow domain, disk link
    cpu_only = CostModel(load_profile("a6000-5220r"), spec).work(0, {2: 1}, (), fast="cpu", slow=None, link="disk")
    assert cpu_only[0].slow_s is None and cpu_only[0].move_s == pytest.approx(cm.move_s("disk", spec.expert_bytes()))
    with pytest.raises(ConfigError, match="outside the spec"):
        cm.work(0, {64: 1}, ())


@pytest.mark.parametrize("name", PAPER_PROFILES)
def test_paper_profiles_load_and_price_sensibly(name: str) -> None:
    prof = load_profile(name)
    assert prof.gpu is not None and prof.pcie is not None and name in profile_names()
    raw = json.loads((SHIPPED_PROFILES / f"{name}.json").read_text())
    assert raw["source"] and raw["notes"]  # every profile says where its numbers come from
    cm = CostModel(prof, load_spec("mixtral-8x7b"))
    # a cached expert on the GPU beats computing it on the CPU and beats fetching it over PCIe (whether the
    # CPU beats the move depends on the machine: a6000-5220r's CPU rate is calibrated to HybriMoE Table III,
    # where moving pays)
    assert cm.expert_s("gpu", 1) < min(cm.expert_s("cpu", 1), cm.move_s("pcie", cm.expert_nbytes))


def test_paper_numbers_match_sources() -> None:
    h100 = load_profile("h100-8470")
    assert h100.gpu is not None and h100.pcie is not None
    assert (h100.gpu.peak_flops, h100.gpu.mem_bw, h100.pcie.bandwidth) == (819.6e12, 2.04e12, 64e9)  # TriMoE Table 1
    assert (h100.cpu.peak_flops, h100.cpu.mem_bw) == (90.1e12, 307.2e9)
    # TriMoE 3.1: ~30% GPU utilisation at 256 tokens per expert
    assert h100.gpu.eff(256) == pytest.approx(0.30)
    hy = load_profile("a6000-5220r")
    assert hy.cpu_threads == 10 and hy.gpu is not None and hy.gpu.mem_bw == 768e9


def test_save_load_round_trip_and_bad_files(tmp_path: Path) -> None:
    cpu = ComputeProfile(peak_flops=1e11, mem_bw=2e10, overhead_s=1e-5, luts={"int4": ((1, 1e-5), (8, 3e-5))},
                         lut_shape=(1024, 256), dense_bw=1e10, layer_overhead_s=2e-5)  # fmt: skip
    prof = _profile(cpu, ComputeProfile(peak_flops=1e14, mem_bw=1e12, overhead_s=0.0, efficiency=((16, 0.5),)))
    path = save_profile(prof, tmp_path / "x.json", notes={"cpu": "made up"})
    assert load_profile(path) == prof
    assert json.loads(path.read_text())["notes"] == {"cpu": "made up"}
    with pytest.raises(ConfigError, match=r"unknown hardware profile 'nope'; known: .*a6000-5220r"):
        load_profile("nope")
    bad = json.loads(path.read_text())
    bad["cpu"]["mem_bw"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="mem_bw"):
        load_profile(tmp_path / "bad.json")
    bad["cpu"]["mem_bw"], bad["cpu"]["luts"] = 1e9, {"int4": [[8, 1e-5], [1, 2e-5]]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="increasing tokens"):
        load_profile(tmp_path / "bad.json")
    bad["cpu"]["luts"], bad["cpu"]["warp"] = {}, 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(tmp_path / "bad.json")


def test_head_and_engine_overheads_are_priced() -> None:
    """head_s: the LM head's weights at dense_bw plus token_overhead_s; dispatch_s rides on every routed
    expert call (not on shared experts or empty calls)."""
    cpu = ComputeProfile(peak_flops=1e15, mem_bw=10e9, overhead_s=0.0, dense_bw=20e9, token_overhead_s=1e-4,
                         dispatch_s=5e-6)  # fmt: skip
    spec = _spec()
    cm = CostModel(_profile(cpu), spec)
    assert cm.head_s("cpu", 1) == pytest.approx(spec.vocab * spec.hidden * spec.dtype_bytes / 20e9 + 1e-4)
    assert cm.head_s("cpu", 0) == 0.0
    bare = CostModel(_profile(ComputeProfile(peak_flops=1e15, mem_bw=10e9, overhead_s=0.0, dense_bw=20e9)), spec)
    assert cm.expert_s("cpu", 1) == pytest.approx(bare.expert_s("cpu", 1) + 5e-6)
    assert cm.expert_s("cpu", 0) == 0.0
    # the fields round-trip through the profile's JSON form
    back = profile_from_dict(json.loads(json.dumps(profile_to_dict(_profile(cpu)))))
    assert (back.cpu.token_overhead_s, back.cpu.dispatch_s) == (1e-4, 5e-6)
