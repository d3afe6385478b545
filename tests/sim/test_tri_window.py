"""The three-domain simulation's profiling window (sim/tri.py, TriSimConfig.warmup_steps): the window's steps are
never replayed or timed, the offline layout and every system's HBM set come from the window's mean loads (a
hand-checked case), the predictor starts from them, warmup_steps 0 is the first-call placement, and bad values are
clear errors. The CLI flag is tested in tests/cli/test_cli_simulate_tri.py."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.errors import ConfigError
from moetier.sim.tri import TriSimConfig, offline_layout, profile_loads, simulate_tri
from moetier.specs import ModelSpec, load_spec
from moetier.studies.sweep_tri import synthetic_calls
from moetier.traces import Call
from moetier.types import ExpertKey

H, I = 64, 32  # noqa: E741
SPEC = ModelSpec(name="tiny-tri", source="test", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2,
                 num_shared=1, hidden=H, moe_inter=I, shared_inter=I, dense_inter=0, num_heads=2,
                 num_kv_heads=2, head_dim=32, vocab=100)  # fmt: skip
KW = {"ndp_count": 2, "hbm_ratio": 0.125, "context": 64}  # HBM holds 1 of 8 experts per layer


def _call(step: int, layer: int, rows: list[tuple[tuple[int, int], int]]) -> Call:
    """A call whose tokens route to the (expert, expert) pairs, each pair repeated its count."""
    ids = np.asarray([pair for pair, n in rows for _ in range(n)], dtype=np.int64)  # [T, 2]
    return Call(step, layer, ids, np.ones_like(ids, dtype=np.float32), None)


def _random(steps: int, T: int = 16, seed: int = 0, first: int = 0) -> list[Call]:
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.2, 0.2, 0.05, 0.05, 0.04, 0.03, 0.03])
    return [Call(s, layer, ids, np.ones_like(ids, dtype=np.float32), None)
            for s in range(first, first + steps) for layer in (0, 1)
            for ids in [np.stack([rng.choice(8, size=2, replace=False, p=p) for _ in range(T)])]]  # fmt: skip


# Layer 0: step 0 loads experts 0 and 1 (4 tokens each) and 2, 3 (1 each); step 1 loads 4, 5 (6 each) and 0, 6.
# Mean over both: 4 and 5 -> 3, 0 -> 2.5, 1 -> 2, 2, 3, 6 -> 0.5, 7 -> 0. Layer 1 the same as layer 0.
WINDOW = [_call(s, layer, rows) for s, rows in ((0, [((0, 1), 4), ((2, 3), 1)]), (1, [((4, 5), 6), ((0, 6), 1)]))
          for layer in (0, 1)]  # fmt: skip
MEAN = np.array([2.5, 2.0, 0.5, 0.5, 3.0, 3.0, 0.5, 0.0])


def test_layout_comes_from_the_window_mean_loads() -> None:
    calls = [*WINDOW, *_random(2, first=2)]
    prof, replayed = profile_loads(calls, 2, 8)
    assert set(prof) == {0, 1} and np.array_equal(prof[0], MEAN) and np.array_equal(prof[1], MEAN)
    assert {c.step for c in replayed} == {2, 3}
    lay = offline_layout(SPEC, calls, TriSimConfig(scheduler="trimoe", warmup_steps=2, **KW))
    # HBM: the most loaded expert of the mean (4; ties to the lower id). Classes (FractionRule, 8 experts): the
    # top 2 (4, 5) warm, the rest cold; cold and not resident -> localised, LPT onto 2 DIMMs in load order
    # (0, 1, 2, 3, 6, 7), each expert's NDP time proportional to its mean load (GEMV), ties to DIMM 0:
    # 0 (2.5) -> 0; 1 (2) -> 1; 2 (0.5) -> 1 (2 < 2.5); 3 -> 0 (2.5 = 2.5); 6 -> 1 (2.5 < 3); 7 (0) -> 0 (3 = 3)
    assert lay.hbm == {0: frozenset({4}), 1: frozenset({4})}
    assert {k: d for k, d in lay.localised.items() if k.layer == 0} == {
        ExpertKey(0, 0): 0, ExpertKey(0, 1): 1, ExpertKey(0, 2): 1, ExpertKey(0, 3): 0, ExpertKey(0, 6): 1,
        ExpertKey(0, 7): 0}  # fmt: skip
    # W = 0: the first call (step 0) alone: 0 and 1 load 4 -> HBM {0}, warm {0, 1}, 2-7 localised
    first = offline_layout(SPEC, calls, TriSimConfig(scheduler="trimoe", warmup_steps=0, **KW))
    assert first.hbm[0] == frozenset({0}) and np.array_equal(first.profile[0], [4, 4, 1, 1, 0, 0, 0, 0])
    assert {k.expert for k in first.localised if k.layer == 0} == {2, 3, 4, 5, 6, 7}


@pytest.mark.parametrize("system", ["klotski", "ktransformers-plus", "monde", "gpu-ndp"])
def test_every_system_gets_the_same_hbm_from_the_window(system: str) -> None:
    calls = [*WINDOW, *_random(2, first=2)]
    lay = offline_layout(SPEC, calls, TriSimConfig(scheduler=system, warmup_steps=2, **KW))
    assert lay.hbm == {0: frozenset({4}), 1: frozenset({4})}
    assert bool(lay.localised) == (system in ("monde", "gpu-ndp"))  # only systems with NDP localise


def test_window_is_never_timed() -> None:
    w, n = 3, 4
    calls = _random(w + n, seed=1)
    replayed = [c for c in calls if c.step >= w]
    r = simulate_tri(SPEC, calls, TriSimConfig(warmup_steps=w, **KW))
    bare = simulate_tri(SPEC, replayed, TriSimConfig(**KW))
    assert (r.steps, r.calls, r.batch) == (n, 2 * n, 16.0)
    assert r.dense_s == pytest.approx(bare.dense_s)  # n steps of attention/dense work, not w + n
    assert r.routed == sum(len(np.unique(np.asarray(c.ids))) for c in replayed)
    assert r.predictor["calls"] == 2 * n  # every replayed call scored (the EMA starts from the window)
    assert bare.predictor["calls"] == 2 * (n - 1)  # without a window the first call of a layer is not
    # the window acts only through its mean loads: a window of the same call repeated three times, or of wider
    # calls (more tokens), gives the run a window of that call once gives
    one = [c for c in calls if c.step == 0]
    thrice = [Call(s, c.layer, c.ids, c.weights, None) for s in range(3) for c in one]
    a = simulate_tri(SPEC, [*one, *replayed], TriSimConfig(warmup_steps=1, **KW))
    b = simulate_tri(SPEC, [*thrice, *replayed], TriSimConfig(warmup_steps=3, **KW))
    assert a == b
    wide = [Call(0, c.layer, np.concatenate([c.ids, c.ids]), np.concatenate([c.weights, c.weights]), None)
            for c in one]  # fmt: skip
    c2 = simulate_tri(SPEC, [*wide, *replayed], TriSimConfig(warmup_steps=1, **KW))
    assert c2.batch == 16.0 and c2.steps == n


def test_window_changes_the_start_and_zero_is_the_first_call() -> None:
    calls = [*WINDOW, *_random(3, first=2, seed=2)]
    with_w = simulate_tri(SPEC, calls, TriSimConfig(warmup_steps=2, **KW))
    first = simulate_tri(SPEC, [c for c in calls if c.step >= 2], TriSimConfig(warmup_steps=0, **KW))
    assert with_w.steps == first.steps == 3 and with_w.moe_s != first.moe_s
    # W = 0 replays every call, the first one included
    assert simulate_tri(SPEC, calls, TriSimConfig(**KW)).steps == 5


def test_window_errors() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="warmup_steps must be an int >= 0"):
            TriSimConfig(warmup_steps=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="warmup_steps 4 leaves no step to replay"):
        simulate_tri(SPEC, _random(4), TriSimConfig(warmup_steps=4, **KW))


def test_synthetic_calls_add_the_window_steps() -> None:
    spec = load_spec("deepseek-v2-lite")
    cfg = TriSimConfig(batch_size=8, steps=2, warmup_steps=3)
    calls = synthetic_calls(spec, cfg)
    assert len({c.step for c in calls}) == 5
    r = simulate_tri(spec, calls, cfg)
    assert r.steps == 2 and r.calls == 2 * len(spec.moe_layers)
    # the replayed steps are the generator's steps 3-4: the same calls a window-less run of 5 steps ends with
    late = [c for c in synthetic_calls(spec, TriSimConfig(batch_size=8, steps=5)) if c.step >= 3]
    assert all(np.array_equal(x.ids, y.ids) for x, y in zip([c for c in calls if c.step >= 3], late, strict=True))
