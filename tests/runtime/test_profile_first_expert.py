"""The first-expert step of `moetier profile` (runtime/profile_first_expert.py): the decision rule on synthetic
timings (no clock), and the measurement's shape on tiny experts."""

from __future__ import annotations

import math

import pytest
import torch

from moetier.errors import ConfigError
from moetier.runtime.profile import synthetic_experts
from moetier.runtime.profile_first_expert import first_expert_estimate, position_times

US = 1e-6


def test_first_beyond_the_spread_is_recorded() -> None:
    # position 0 at 130 us; later positions' medians 100, 101, 99, 102 us -> later 100.5 us, spread 1.5 us
    times = [[130 * US, 131 * US, 129 * US], [100 * US] * 3, [101 * US] * 3, [99 * US] * 3, [102 * US] * 3]
    est = first_expert_estimate(times)
    assert est.medians_s == pytest.approx((130 * US, 100 * US, 101 * US, 99 * US, 102 * US))
    assert est.later_s == pytest.approx(100.5 * US) and est.noise_s == pytest.approx(1.5 * US)
    assert est.recorded and est.first_expert_s == pytest.approx(29.5 * US) == est.diff_s
    assert est.reason.startswith("recorded: the first expert's extra +29.5 us is beyond")


def test_first_within_the_spread_is_zero() -> None:
    # later positions scatter 90..120 us around 100 us: a first position 10 us slower is within that spread
    times = [[110 * US], [90 * US], [100 * US], [120 * US]]
    est = first_expert_estimate(times)
    assert est.diff_s == pytest.approx(10 * US) and est.noise_s == pytest.approx(20 * US)
    assert not est.recorded and est.first_expert_s == 0.0
    assert est.reason.startswith("0: the first expert's extra +10.0 us is within the later positions' spread")


def test_first_not_slower_is_zero() -> None:
    times = [[80 * US, 82 * US], [100 * US, 100 * US], [100 * US, 101 * US]]
    est = first_expert_estimate(times)
    assert est.diff_s < 0 and est.first_expert_s == 0.0 and est.reason.startswith("0: the first expert is not slower")
    # equal to the later positions (no spread at all): not slower either
    flat = first_expert_estimate([[5 * US]] * 4)
    assert flat.diff_s == 0.0 and flat.noise_s == 0.0 and flat.first_expert_s == 0.0


def test_the_rule_uses_medians_so_one_outlier_round_does_not_decide() -> None:
    # one round where another process stole the core (10 ms) in position 0: the median ignores it
    times = [[100 * US, 10_000 * US, 101 * US], [100 * US] * 3, [100.5 * US] * 3, [99.5 * US] * 3]
    est = first_expert_estimate(times)
    assert est.medians_s[0] == pytest.approx(101 * US) and est.noise_s == pytest.approx(0.5 * US)
    assert est.first_expert_s == pytest.approx(1 * US)  # 1 us beyond a 0.5 us spread: recorded, not 3.3 ms


def test_bad_timings_are_named() -> None:
    with pytest.raises(ConfigError, match=">= 3 positions"):
        first_expert_estimate([[1e-4], [1e-4]])
    with pytest.raises(ConfigError, match="position 1 has no timings"):
        first_expert_estimate([[1e-4], [], [1e-4]])
    with pytest.raises(ConfigError, match="position 2 has a time"):
        first_expert_estimate([[1e-4], [1e-4], [math.nan]])


def test_position_times_shape_and_arguments() -> None:
    torch.set_num_threads(1)
    experts = synthetic_experts("full", 256, 128, torch.device("cpu"), n_max=3)
    times = position_times(experts, 256, (1, 2), rounds=2, flush_bytes=1 << 16, warmup=1)
    assert set(times) == {1, 2}
    for per_pos in times.values():
        assert len(per_pos) == 3 and all(len(ts) == 2 and all(0 < t < 1.0 for t in ts) for ts in per_pos)
    assert first_expert_estimate(times[1]).first_expert_s >= 0
    with pytest.raises(ConfigError, match=">= 3 experts"):
        position_times(experts[:2], 256, (1,), rounds=1, flush_bytes=0)
    with pytest.raises(ConfigError, match="rounds >= 1"):
        position_times(experts, 256, (1,), rounds=0, flush_bytes=0)
