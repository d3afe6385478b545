"""benchmarks/hybrid_sim.py's study helpers: the CPU-rate sensitivity of HybriMoE's lead over kTransformers (issue 30,
item 8) and the per-baseline speedups."""

from __future__ import annotations

import pytest
from benchmarks.hybrid_sim import cpu_sensitivity, over_baselines

from moetier.policies.costmodel import load_profile


def test_the_decode_lead_over_ktransformers_shrinks_as_the_cpu_gets_faster() -> None:
    # kTransformers computes every decode miss on the CPU; HybriMoE balances CPU work against PCIe moves. A slow CPU
    # (the rate fitted to Table III) leaves a large lead; once a CPU expert costs less than its move there is little
    # to balance. Prefill goes the other way: HybriMoE uses the CPU at prefill, kTransformers does not.
    rows = cpu_sensitivity(load_profile("a6000-5220r"), [6.42e9, 25e9, 70e9], ["deepseek-v2-lite"], [0.25], steps=8,
                           stats="hybrimoe", prompts=(128,), warmup=32)  # fmt: skip
    assert [r["cpu_mem_bw"] for r in rows] == [6.42e9, 25e9, 70e9]
    dec = [r["decode"] for r in rows]
    assert dec[0] > dec[1] > dec[2] and dec[0] > 1.3 and dec[2] < 1.2
    assert rows[0]["prefill"] < rows[2]["prefill"]
    assert all(r["decode_min"] <= r["decode"] <= r["decode_max"] for r in rows)


def test_over_baselines_is_the_mean_of_per_case_ratios() -> None:
    tbt = {"m": {"0.25": {"hybrimoe": 1.0, "kt": 2.0}, "0.5": {"hybrimoe": 2.0, "kt": 2.0}}}
    ttft = {"m": {"0.25": {"hybrimoe": {32: 1.0}, "kt": {32: 3.0}}, "0.5": {"hybrimoe": {32: 1.0}, "kt": {32: 1.0}}}}
    o = over_baselines(tbt, ttft, ["kt"])["kt"]
    assert o["decode"] == pytest.approx(1.5) and (o["decode_min"], o["decode_max"]) == (1.0, 2.0)
    assert o["prefill"] == pytest.approx(2.0) and (o["prefill_min"], o["prefill_max"]) == (1.0, 3.0)
