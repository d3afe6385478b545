"""Total activation sparsity (the paper's target, shared experts counted) and the GPU tipping point priced
on a hardware profile's roofline, over plain numbers.

- `routed_target` against the paper's own Table 2 (Qwen3.5-35B-A3B: 8 routed experts of 512 neurons and
  a shared expert of 512): each total target there maps to its reported routed sparsity;
- `roofline_profile` on fake compute profiles: the formulas at one token, the memory-bound tipping point
  1 / (1 - s) tokens, no tipping point when gathers run at full efficiency, a finite one when the
  efficiency curve rewards tiles, and a higher one for higher sparsity.
"""

from __future__ import annotations

import math

import pytest

from moetier.errors import ConfigError
from moetier.policies.hwprofile import ComputeProfile
from moetier.policies.sparsity import TARGETS, roofline_profile, routed_target, tipping_point, total_sparsity

# Qwen3.5-35B-A3B (paper Table 1): 8 active routed experts of FFN dim 512, a shared expert of 512
K, INTER, S = 8, 512, 512
# paper Table 2: (target total sparsity, achieved total, routed expert sparsity), in percent
PAPER_TABLE2 = ((60, 57, 64), (70, 72, 81), (80, 79, 89), (85, 84, 94), (87, 87, 98))


def test_routed_target_reproduces_the_papers_table2() -> None:
    """The paper reports the routed sparsity its thresholds reached and the total that gives; our
    conversion maps each achieved total to that routed sparsity, within the table's rounding to 1%."""
    for _, total, routed in PAPER_TABLE2:
        assert routed_target(total / 100, "total", K * INTER, S) == pytest.approx(routed / 100, abs=0.011)
    # and back: total = routed * kI / (kI + S)
    for _, total, routed in PAPER_TABLE2:
        skipped = round(routed / 100 * K * INTER)
        assert total_sparsity(skipped, K * INTER, S) == pytest.approx(total / 100, abs=0.006)


def test_routed_target_scopes_and_no_shared_experts() -> None:
    assert routed_target(0.7, "routed", K * INTER, S) == 0.7
    assert routed_target(0.7, "total", K * INTER, 0) == 0.7  # no shared experts: the same thing
    assert routed_target(0.0, "total", K * INTER, S) == 0.0
    assert routed_target(0.5, "total", 32, 16) == pytest.approx(0.75)


def test_routed_target_refuses_what_the_table_cannot_reach() -> None:
    top = TARGETS[-1] * K * INTER / (K * INTER + S)  # 0.88 for the paper's model
    assert routed_target(top, "total", K * INTER, S) == pytest.approx(TARGETS[-1])
    with pytest.raises(ConfigError, match=rf"largest total target for this model is {top:.3f}"):
        routed_target(0.9, "total", K * INTER, S)
    with pytest.raises(ConfigError, match=r"largest total target for this model is 0\.808"):
        routed_target(0.85, "total", K * INTER, S, max_routed=0.909)
    with pytest.raises(ConfigError, match="scope"):
        routed_target(0.5, "shared", K * INTER, S)
    with pytest.raises(ConfigError, match="routed neurons per token"):
        routed_target(0.5, "total", 0, S)


def test_total_sparsity_counts_shared_pairs_as_active() -> None:
    assert total_sparsity(0, 0, 0) == 0.0
    assert total_sparsity(50, 100, 0) == 0.5
    assert total_sparsity(50, 100, 100) == 0.25


H, W_BYTES = 2048, 2  # the paper's Qwen3.5-35B-A3B hidden size, bf16 weights


def test_roofline_formulas_at_one_token() -> None:
    """Memory-bound (a huge peak): dense reads gate, up and down; sparse reads the gate and each token's
    active up and down rows."""
    gpu = ComputeProfile(peak_flops=1e30, mem_bw=1e12, overhead_s=1e-5)
    s = 0.9
    dense, sparse = roofline_profile(gpu, H, INTER, W_BYTES, s, counts=(1,))[1]
    unit = H * INTER * W_BYTES / 1e12
    assert dense == pytest.approx(3 * unit)
    assert sparse == pytest.approx(unit * (1 + 2 * (1 - s)))


@pytest.mark.parametrize("s", [0.6, 0.7, 0.85, 0.94])  # 1 / (1 - s) not an integer: no float tie
def test_memory_bound_tipping_point_is_one_over_the_active_fraction(s: float) -> None:
    """sparse(n) = (1 + 2n(1 - s)) weight reads against dense's 3: dense wins from n = 1 / (1 - s) on."""
    gpu = ComputeProfile(peak_flops=1e30, mem_bw=1e12, overhead_s=0.0)
    counts = tuple(range(1, 41))
    tip = tipping_point(roofline_profile(gpu, H, INTER, W_BYTES, s, counts=counts))
    assert tip == math.ceil(1 / (1 - s))


def test_gathers_at_full_efficiency_never_tip() -> None:
    """Without an efficiency curve (every call at peak) skipping neurons never costs more than the
    dense GEMM: sparse wins at every count, so the tipping point is past the largest one."""
    gpu = ComputeProfile(peak_flops=1e12, mem_bw=1e15, overhead_s=0.0)  # compute-bound throughout
    profile = roofline_profile(gpu, H, INTER, W_BYTES, 0.9)
    assert all(sp < d for d, sp in profile.values())
    assert tipping_point(profile) == max(profile) + 1


def test_efficiency_curve_gives_a_finite_tipping_point_rising_with_sparsity() -> None:
    """An H100-like profile (TriMoE's curve: 10% of peak up to 64 tokens, 30% at 256): the gathered rows run
    at the one-token efficiency, the dense GEMM climbs the curve, so dense wins from some count on, and
    later for higher sparsity."""
    gpu = ComputeProfile(peak_flops=8.196e14, mem_bw=2.04e12, overhead_s=1e-5,
                         efficiency=((64, 0.1), (256, 0.3), (1024, 0.55), (4096, 0.75)))  # fmt: skip
    tips = [tipping_point(roofline_profile(gpu, H, INTER, W_BYTES, s)) for s in (0.5, 0.7, 0.85, 0.94, 0.98)]
    assert all(1 <= t <= 256 for t in tips), tips
    assert tips == sorted(tips) and tips[0] < tips[-1], tips


def test_roofline_refuses_bad_sparsity() -> None:
    gpu = ComputeProfile(peak_flops=1e14, mem_bw=1e12, overhead_s=0.0)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="routed sparsity"):
            roofline_profile(gpu, H, INTER, W_BYTES, bad)
