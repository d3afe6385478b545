"""The stationary paper regime of the TriMoE study (sweeps/trimoe_stationary.toml): TriSimConfig.step_noise
reaches the synthetic generator (studies.synthetic.SynthParams.step_noise) through `synthetic_calls`, keeps
the experts' long-run token shares (popularity does not move) and makes the calls noisier step to step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.sim.tri import TriSimConfig, simulate_tri
from moetier.specs import ModelSpec
from moetier.studies import synthetic
from moetier.studies.sweep_tri import synthetic_calls
from moetier.traces import Call, iter_calls

SPEC = ModelSpec(name="tiny-tri-32", source="test", num_layers=2, moe_layers=(0, 1), num_experts=32, top_k=4,
                 num_shared=1, hidden=64, moe_inter=32, shared_inter=32, dense_inter=0, num_heads=2,
                 num_kv_heads=2, head_dim=32, vocab=100)  # fmt: skip


def _loads(calls: list[Call], E: int) -> np.ndarray:
    """[steps, layers, E] tokens per expert of each call."""
    steps, layers = max(c.step for c in calls) + 1, max(c.layer for c in calls) + 1
    out = np.zeros((steps, layers, E))
    for c in calls:
        out[c.step, c.layer] = np.bincount(np.asarray(c.ids).ravel(), minlength=E)
    return out


def test_step_noise_is_checked() -> None:
    for bad in (-0.1, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ConfigError, match="step_noise must be a number >= 0"):
            TriSimConfig(step_noise=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step_noise"):
        synthetic.SynthParams(step_noise=-1.0)


def test_step_noise_reaches_the_generator_and_keeps_shares() -> None:
    cfg = TriSimConfig(batch_size=64, steps=60, drift=0.0)
    calm, noisy = synthetic_calls(SPEC, cfg), synthetic_calls(SPEC, replace(cfg, step_noise=0.9))
    # step_noise 0 is the preset's generator bit for bit
    p = replace(synthetic.preset(SPEC, batch_size=64), drift=0.0)
    direct = _loads(iter_calls(synthetic.generate(p, 60, with_scores=False)), 32)
    a, b = _loads(calm, 32), _loads(noisy, 32)
    assert np.array_equal(a, direct)
    assert not np.array_equal(a, b)  # the knob reached the generator
    # the same experts keep the same long-run shares (same popularity ranks: the structure stream is unchanged)
    share_a, share_b = a.sum(0) / a.sum((0, 2))[:, None], b.sum(0) / b.sum((0, 2))[:, None]  # [layers, E]
    order = np.argsort(-share_a, axis=1)
    n_cold = int(np.ceil(0.71 * 32))
    cold_a = np.take_along_axis(share_a, order, 1)[:, -n_cold:].sum(1)
    cold_b = np.take_along_axis(share_b, order, 1)[:, -n_cold:].sum(1)
    assert np.allclose(cold_a, 0.08, atol=0.02) and np.allclose(cold_b, cold_a, atol=0.02)
    # ... while each step's loads scatter more around them
    assert b.std(0).mean() > 1.5 * a.std(0).mean()


def test_step_noise_lowers_predictor_accuracy() -> None:
    cfg = TriSimConfig(batch_size=64, steps=8, drift=0.0, scheduler="trimoe")
    acc = [simulate_tri(SPEC, synthetic_calls(SPEC, replace(cfg, step_noise=s)), replace(cfg, step_noise=s))
           .predictor["accuracy"] for s in (0.0, 1.0)]  # fmt: skip
    assert acc[1] < acc[0] - 0.03
