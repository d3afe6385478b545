"""The simulator (moetier.sim): hand-checked timings on a tiny machine, conservation of accesses
and bytes, prefetches occupying the link, machines without a GPU, and clear errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetier.errors import ConfigError, TraceError
from moetier.policies.costmodel import ComputeProfile, HardwareProfile, LinkProfile
from moetier.policies.schedule_base import ExpertWork
from moetier.policies.schedulers import make_scheduler
from moetier.sim import SimConfig, simulate
from moetier.sim.machine import Machine, MachineShape, PrefetchItem
from moetier.specs import ModelSpec, load_spec
from moetier.studies.synthetic import generate, preset
from moetier.traces import Call, iter_calls
from moetier.types import ExpertKey

HUGE = 1e30
EXPERT_BYTES = 3 * 64 * 32 * 2  # 12288: hidden 64, moe_inter 32, bf16


def tiny_spec() -> ModelSpec:
    return ModelSpec(name="tiny2", source="test", num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=1,
                     num_shared=0, hidden=64, moe_inter=32, shared_inter=0, dense_inter=0, num_heads=1,
                     num_kv_heads=1, head_dim=64, vocab=10)  # fmt: skip


def hand_profile(gpu: bool = True) -> HardwareProfile:
    """Costs by hand: GPU expert 1 ms, CPU expert 2 ms, PCIe move 4 ms, disk move 8 ms, dense 1 ms per layer."""

    def comp(expert_s: float) -> ComputeProfile:
        return ComputeProfile(peak_flops=HUGE, mem_bw=EXPERT_BYTES / expert_s, overhead_s=0.0, dense_bw=HUGE,
                              layer_overhead_s=1e-3)  # fmt: skip

    return HardwareProfile(
        name="hand", source="test", cpu=comp(2e-3), gpu=comp(1e-3) if gpu else None,
        pcie=LinkProfile(EXPERT_BYTES / 4e-3) if gpu else None, disk=LinkProfile(EXPERT_BYTES / 8e-3),
        cpu_threads=1, host_mem_bytes=2**30, gpu_mem_bytes=2**30 if gpu else None,
    )  # fmt: skip


def hand_calls() -> list[Call]:
    """Two decode steps (no prompt): step 0 routes (0,0) and (1,1); step 1 routes (0,0) and (1,2)."""
    w = np.ones((1, 1), np.float32)
    ids = {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 2}
    return [Call(s, layer, np.array([[ids[s, layer]]]), w, None) for s in (0, 1) for layer in (0, 1)]


# 1. Hand-checked timings --------------------------------------------------------------------------------------------
def test_gpu_lru_matches_hand_timeline() -> None:
    # 2 slots warmed by frequency: (0,0) and (1,1). Step 0: dense+hit twice = 4 ms. Step 1: layer 0 hit
    # (2 ms); layer 1 misses (1,2): dense 1 + move 4 + compute 1 = 6 ms -> 8 ms. TBT = (4 + 8) / 2 = 6 ms.
    r = simulate(tiny_spec(), hand_profile(), hand_calls(), SimConfig(scheduler="gpu-lru", cache_ratio=0.25))
    assert r.config.prompt_len == 0 and r.ttft_s == 0.0
    assert r.tbt_s == pytest.approx(6e-3, rel=1e-9)
    assert r.moe_layer_s == pytest.approx((1 + 1 + 1 + 5) / 4 * 1e-3, rel=1e-9)
    assert (r.accesses, r.hits, r.cache_slots, r.evictions) == (4, 3, 2, 1)
    assert r.link_bytes == {"pcie": EXPERT_BYTES}
    assert r.moves["demand"] == 1
    assert r.total_s == pytest.approx(12e-3, rel=1e-9)
    assert r.utilization["pcie"] == pytest.approx(4 / 12, rel=1e-9)
    assert r.utilization["gpu"] == pytest.approx((4 + 4) / 12, rel=1e-9)  # 4 dense + 4 expert ms
    assert r.throughput_tok_s == pytest.approx(1 / 6e-3)


def test_ktransformers_computes_the_miss_on_the_cpu() -> None:
    # Step 1 layer 1: the miss runs on the CPU (2 ms) instead of move + GPU: step 1 = 2 + 1 + 2 = 5 ms.
    r = simulate(tiny_spec(), hand_profile(), hand_calls(), SimConfig(scheduler="ktransformers", cache_ratio=0.25))
    assert r.tbt_s == pytest.approx((4e-3 + 5e-3) / 2, rel=1e-9)
    assert r.link_bytes == {"pcie": 0} and r.evictions == 0
    assert r.utilization["cpu"] == pytest.approx(2 / 9, rel=1e-9)


def test_cpu_only_machine_reads_misses_from_disk() -> None:
    # No GPU: fast = cpu (expert 2 ms), link = disk (8 ms). Step 1 layer 1: 1 + 8 + 2 = 11 ms; step 0: 2 x 3 ms.
    r = simulate(tiny_spec(), hand_profile(gpu=False), hand_calls(), SimConfig(scheduler="hybrimoe", cache_ratio=0.25))
    assert r.machine == {"fast": "cpu", "slow": None, "link": "disk"}
    assert set(r.utilization) == {"cpu", "disk"}
    assert r.tbt_s == pytest.approx((6e-3 + 14e-3) / 2, rel=1e-9)
    assert r.link_bytes == {"disk": EXPERT_BYTES}


def test_prefill_is_step_zero() -> None:
    w = np.ones((3, 1), np.float32)
    calls = [Call(0, layer, np.array([[0], [0], [3]]), w, None) for layer in (0, 1)] + hand_calls()[:0]
    calls += [Call(1, layer, np.array([[0]]), w[:1], None) for layer in (0, 1)]
    r = simulate(tiny_spec(), hand_profile(), calls, SimConfig(scheduler="gpu-lru", cache_ratio=0.25, batch_size=1))
    assert r.config.prompt_len == 3 and r.config.steps == 1
    assert r.ttft_s > r.tbt_s > 0


def _steps(routes: list[int], first: int = 0) -> list[Call]:
    """One decode step per entry, both layers routing that expert."""
    w = np.ones((1, 1), np.float32)
    return [Call(first + s, layer, np.array([[e]]), w, None) for s, e in enumerate(routes) for layer in (0, 1)]


def test_warmup_steps_build_the_placement_and_are_not_replayed() -> None:
    # warm-up routes expert 3, the replayed steps expert 0: the static placement holds (0,3), (1,3)
    calls = _steps([3, 3, 0, 0, 0])
    r = simulate(tiny_spec(), hand_profile(), calls, SimConfig(scheduler="ktransformers", cache_ratio=0.25,
                                                                warmup_steps=2))  # fmt: skip
    assert r.config.steps == 3 and (r.accesses, r.hits) == (6, 0)
    oracle = simulate(tiny_spec(), hand_profile(), calls, SimConfig(scheduler="ktransformers", cache_ratio=0.25))
    assert (oracle.accesses, oracle.hits) == (10, 6)  # built from the replayed calls themselves
    with pytest.raises(TraceError, match="warm-up alone takes 5"):
        simulate(tiny_spec(), hand_profile(), calls, SimConfig(warmup_steps=5))
    with pytest.raises(ConfigError, match="warmup_steps"):
        SimConfig(warmup_steps=-1)


@pytest.mark.parametrize("scheduler", ["gpu-lru", "hybrimoe"])
def test_prefill_moves_are_staged_unless_admitted(scheduler: str) -> None:
    # prefill of 3 tokens routes experts 1, 2, 3 in both layers; warm-up and decode route expert 0
    w = np.ones((3, 1), np.float32)
    prefill = [Call(0, layer, np.array([[1], [2], [3]]), w, None) for layer in (0, 1)]
    calls = prefill + _steps([0, 0, 0, 0], first=1)
    cfg = SimConfig(scheduler=scheduler, cache_ratio=0.25, warmup_steps=2, prefetch=scheduler == "hybrimoe")
    staged = simulate(tiny_spec(), hand_profile(), calls, cfg)
    assert staged.moves["demand"] > 0 and staged.evictions == 0 and staged.decode_hit_rate == 1.0
    admitted = simulate(tiny_spec(), hand_profile(), calls, replace(cfg, prefill_admit=True))
    assert admitted.evictions > 0 and admitted.decode_hit_rate < 1.0


# 2. Prefetches occupy the link -------------------------------------------------------------------------------------
def test_a_prefetch_on_the_link_delays_a_demand_move() -> None:
    m = Machine(MachineShape("gpu", "cpu", "pcie"))
    arrived: list[float] = []
    m.prefetch([PrefetchItem(ExpertKey(1, 1), 5.0, 100, call=9)], lambda i: True, lambda i: arrived.append(m.now))
    out: list[tuple[float, float]] = []
    work = [ExpertWork(ExpertKey(0, 2), 1, cached=False, fast_s=1.0, slow_s=None, move_s=3.0, nbytes=50)]

    def forward():  # type: ignore[no-untyped-def]
        yield m.env.timeout(1.0)
        ready = m.link_ready()
        sched = make_scheduler("gpu-lru").schedule(work, {"link": ready})
        took = yield from m.replay(sched, {ExpertKey(0, 2): 50})
        out.append((ready, took))

    m.env.run(until=m.env.process(forward()))
    assert arrived == [5.0]
    assert out == [(4.0, 8.0)]  # link free at 5, move 5..8, compute 8..9: 8 s after t=1
    assert m.link_bytes == 150 and m.moves["demand"] == 1 and m.moves["prefetch"] == 1
    assert m.busy["pcie"] == 8.0


# 3. Conservation on a synthetic trace -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth() -> tuple[ModelSpec, list[Call]]:
    spec = load_spec("deepseek-v2-lite")
    return spec, iter_calls(generate(preset(spec), 12, prompt_len=16))


@pytest.mark.parametrize("kw", [
    {"scheduler": "hybrimoe", "prefetch": True},
    {"scheduler": "gpu-lru", "prefetch": True},
    {"scheduler": "ktransformers", "fill": True, "cache_policy": "mrs"},
    {"scheduler": "llamacpp"},
    {"scheduler": "fiddler", "cache_ratio": 0.0},
])  # fmt: skip
def test_conservation(synth: tuple[ModelSpec, list[Call]], kw: dict) -> None:
    spec, calls = synth
    from moetier.policies.costmodel import load_profile

    cfg = SimConfig(**{"cache_ratio": 0.25, **kw})
    r = simulate(spec, load_profile("a6000-5220r"), calls, cfg)
    accesses = sum(len(np.unique(c.ids)) for c in calls)
    assert r.accesses == accesses and 0 <= r.hits <= accesses
    moved = r.moves["demand"] + r.moves["prefetch"] + r.moves["fill"]
    assert r.link_bytes["pcie"] == moved * spec.expert_bytes()
    assert r.busy_s["pcie"] >= moved * spec.expert_bytes() / load_profile("a6000-5220r").pcie.bandwidth - 1e-12
    assert all(0.0 <= u <= 1.0 + 1e-9 for u in r.utilization.values())
    assert r.ttft_s > 0 and r.tbt_s > 0 and r.config.steps == 12
    pf = r.prefetch
    assert pf.used <= pf.issued == r.moves["prefetch"]
    if cfg.prefetch:  # the history predictor, learning from 12 steps only: better than chance (6 of 64)
        assert pf.predicted > 0 and spec.top_k / spec.num_experts < pf.correct / pf.predicted <= 1.0
        assert set(r.as_dict()["prefetch"]["accuracy_by_distance"]) == {"1", "2", "3"}
    d = r.as_dict()
    for key in ("ttft_s", "tbt_s", "throughput_tok_s", "moe_layer_s", "hit_rate", "utilization", "link_bytes"):
        assert key in d
    assert simulate(spec, load_profile("a6000-5220r"), calls, cfg).as_dict() == d  # deterministic


def test_prefetch_accuracy_one_predicts_exactly(synth: tuple[ModelSpec, list[Call]]) -> None:
    spec, calls = synth
    from moetier.policies.costmodel import load_profile

    cfg = SimConfig(scheduler="hybrimoe", cache_ratio=0.25, prefetch=True, predictor="oracle",
                    prefetch_accuracy=(1.0, 1.0, 1.0))  # fmt: skip
    pf = simulate(spec, load_profile("a6000-5220r"), calls, cfg).prefetch
    assert pf.predicted > 0 and pf.correct == pf.predicted
    assert all(n > 0 and c == n for n, c in pf.by_distance.values()) and set(pf.by_distance) == {1, 2, 3}


def _chain_calls(steps: int, first_random: bool) -> tuple[ModelSpec, list[Call]]:
    """4 MoE layers, 8 experts, top-1: layer 0 routes a random expert, layer l routes (that expert + l) % 8
    (a deterministic cross-layer pattern), or every layer a random expert."""
    spec = ModelSpec(name="chain", source="test", num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=8, top_k=1,
                     num_shared=0, hidden=64, moe_inter=32, shared_inter=0, dense_inter=0, num_heads=1,
                     num_kv_heads=1, head_dim=64, vocab=10)  # fmt: skip
    rng = np.random.default_rng(1)
    w = np.ones((1, 1), np.float32)
    calls = []
    for s in range(steps):
        e0 = int(rng.integers(8))
        for layer in range(4):
            e = (e0 + layer) % 8 if first_random else int(rng.integers(8))
            calls.append(Call(s, layer, np.array([[e]]), w, None))
    return spec, calls


def test_history_predictor_drives_the_prefetch_and_reports_accuracy_per_distance() -> None:
    # after a warm-up of 64 steps the deterministic pattern is learned: every prediction at d = 1, 2, 3 is right
    spec, calls = _chain_calls(96, first_random=True)
    cfg = SimConfig(scheduler="gpu-lru", cache_ratio=0.25, prefetch=True, warmup_steps=64)
    r = simulate(spec, hand_profile(), calls, cfg)
    acc = r.as_dict()["prefetch"]["accuracy_by_distance"]
    assert acc == {"1": 1.0, "2": 1.0, "3": 1.0} and r.prefetch.issued > 0
    # on random routing the same predictor is near chance (1/8)
    spec, calls = _chain_calls(400, first_random=False)
    r = simulate(spec, hand_profile(), calls, replace(cfg, warmup_steps=100))
    for v in r.as_dict()["prefetch"]["accuracy_by_distance"].values():
        assert 0.05 < v < 0.22


def test_ktransformers_prefill_runs_on_the_gpu_and_decode_on_the_cpu() -> None:
    # HybriMoE Table I: kTransformers computes on the CPU at decode only; at prefill its misses are streamed
    w = np.ones((3, 1), np.float32)
    calls = [Call(0, layer, np.array([[1], [2], [3]]), w, None) for layer in (0, 1)] + _steps([1, 2], first=1)
    cfg = SimConfig(scheduler="ktransformers", cache_ratio=0.25, timeline_steps=(0, 3), batch_size=1)
    r = simulate(tiny_spec(), hand_profile(), calls, cfg)
    prefill_ops = [op for op in r.timeline if op.step == 0]
    decode_ops = [op for op in r.timeline if op.step > 0]
    assert r.moves["demand"] > 0 and r.evictions == 0  # prefill moves are never admitted (static mapping)
    assert prefill_ops and not any(op.lane == "cpu" for op in prefill_ops)
    assert any(op.lane == "pcie" for op in prefill_ops)
    assert any(op.lane == "cpu" for op in decode_ops)  # decode misses computed on the CPU


def test_first_cpu_expert_penalty_delays_the_cpu_lane() -> None:
    # HybriMoE Fig. 3e as a profile parameter: the first CPU expert of a call pays first_expert_s once
    base = SimConfig(scheduler="ktransformers", cache_ratio=0.25)
    prof = hand_profile()
    slow = replace(prof, cpu=replace(prof.cpu, first_expert_s=1e-3))
    a = simulate(tiny_spec(), prof, hand_calls(), base)
    b = simulate(tiny_spec(), slow, hand_calls(), base)
    assert b.tbt_s == pytest.approx(a.tbt_s + 1e-3 / 2, rel=1e-9)  # one CPU miss in two steps


def test_adapmoe_computes_every_routed_expert_and_only_the_gated_variant_drops_some() -> None:
    # HybriMoE VI-A3's AdapMoE: "adaptive prefetching and caching" (Table I: LRU), no gating: every routed expert
    # of every call is looked up and computed, as gpu-lru does; adapmoe-gated (the labelled variant) drops ~25%
    spec = load_spec("mixtral-8x7b")
    calls = iter_calls(generate(preset(spec, stats="hybrimoe"), 48, prompt_len=8))
    from moetier.policies.costmodel import load_profile

    prof = load_profile("a6000-5220r")
    cfg = SimConfig(scheduler="adapmoe", cache_ratio=0.25, prefetch=True, prefetch_depth=1, warmup_steps=16,
                    precision="int4")  # fmt: skip
    plain = simulate(spec, prof, calls, replace(cfg, scheduler="gpu-lru"))
    routed = sum(len(set(np.asarray(c.ids).ravel().tolist())) for c in calls if c.step == 0 or c.step > 16)
    assert plain.accesses == routed  # the prefill and the 32 replayed decode steps, distinct experts per call
    r = simulate(spec, prof, calls, cfg)
    assert r.gating == {} and r.accesses == routed and r.config.cache_alloc == "dp"
    assert r.moves["prefetch"] > 0 and r.busy_s["cpu"] == 0.0
    gated = simulate(spec, prof, calls, replace(cfg, scheduler="adapmoe-gated"))
    g = gated.gating
    assert 0.2 < g["dropped_frac"] < 0.3 and g["routed"] == 32 * 32 * 2  # 32 decode steps x 32 layers x top-2
    assert gated.accesses < r.accesses and gated.tbt_s < r.tbt_s  # fewer experts, less to move and compute
    assert gated.moves["prefetch"] > 0 and gated.busy_s["cpu"] == 0.0
    assert simulate(spec, prof, calls, replace(cfg, scheduler="adapmoe-gated", gate_drop=0.0)).gating["dropped"] == 0


def test_the_a6000_profile_reproduces_both_table_iii_baseline_numbers() -> None:
    # the two-parameter fit (cpu.mem_bw <- decode 0.21 s/token, pcie.bandwidth <- prefill 1.47 s at 512 tokens),
    # in the setting benchmarks/hybrid_sim.py --calibrate fits it (Qwen2 at 25%, int4, stats hybrimoe, warm-up 128)
    from moetier.policies.costmodel import load_profile

    spec, prof = load_spec("qwen2-57b-a14b"), load_profile("a6000-5220r")
    p = preset(spec, stats="hybrimoe")
    cfg = SimConfig(scheduler="ktransformers", cache_ratio=0.25, precision="int4", warmup_steps=128)
    dec = simulate(spec, prof, iter_calls(generate(p, 128 + 128, prompt_len=32)), replace(cfg, steps=128))
    pre = simulate(spec, prof, iter_calls(generate(p, 128 + 1, prompt_len=512)), replace(cfg, steps=1))
    assert dec.tbt_s == pytest.approx(0.21, rel=0.02)
    assert pre.ttft_s == pytest.approx(1.47, rel=0.02)


# 4. Errors ----------------------------------------------------------------------------------------------------------
def test_errors() -> None:
    spec, prof = tiny_spec(), hand_profile()
    with pytest.raises(TraceError, match="2 decode step"):
        simulate(spec, prof, hand_calls(), SimConfig(steps=5))
    with pytest.raises(TraceError, match="not an MoE layer"):
        simulate(spec, prof, [Call(0, 7, np.array([[0]]), np.ones((1, 1)), None)], SimConfig())
    with pytest.raises(TraceError, match="lacks MoE layer"):
        simulate(spec, prof, hand_calls()[:1], SimConfig())
    with pytest.raises(ConfigError, match="belady"):
        simulate(spec, prof, hand_calls(), SimConfig(cache_policy="belady"))
    with pytest.raises(ConfigError, match="unknown scheduler"):
        simulate(spec, prof, hand_calls(), SimConfig(scheduler="nope"))
    with pytest.raises(ConfigError, match="cache_ratio"):
        SimConfig(cache_ratio=1.5)
    with pytest.raises(ConfigError, match="depth"):
        SimConfig(prefetch=True, prefetch_depth=4)
    with pytest.raises(ConfigError, match="predictor"):
        SimConfig(predictor="crystal-ball")
    with pytest.raises(ConfigError, match="gate_drop"):
        SimConfig(gate_drop=1.0)
    small = HardwareProfile(name="small", source="t", cpu=prof.cpu, gpu=prof.gpu, pcie=prof.pcie, disk=prof.disk,
                            cpu_threads=1, host_mem_bytes=1000, gpu_mem_bytes=2**30)  # fmt: skip
    with pytest.raises(ConfigError, match="host memory"):
        simulate(spec, small, hand_calls(), SimConfig())
