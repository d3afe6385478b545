"""Synthetic routing traces: schema, knobs that move their statistic, the fit, presets, bad input."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from moetier import traces
from moetier.errors import ConfigError, TraceError
from moetier.studies.synthetic import (
    HYBRIMOE_LRU25,
    SynthParams,
    generate,
    load_params,
    params_dict,
    params_from_dict,
    preset,
    routing,
    save,
    save_params,
    shares,
    with_skew,
)
from moetier.studies.synthetic_fit import fit_params
from moetier.studies.synthetic_stats import class_shares, sorted_profile, stats_of, trace_stats

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "data" / "traces" / "macbeth-ross.parquet"
SMALL = SynthParams(num_layers=3, num_experts=16, top_k=2, hot_frac=1 / 16, warm_frac=4 / 16, batch_size=2)


@dataclass(frozen=True)
class StandInSpec:  # the attributes of moetier.specs.ModelSpec that preset() reads
    name: str
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int = 2048
    moe_inter: int = 1408


def test_schema_and_row_layout(tmp_path):
    t = generate(SMALL, steps=5, prompt_len=3)
    L, B, k, E = 3, 2, 2, 16
    assert len(t) == L * B * 3 + 5 * L * B
    back = traces.load(save(t, tmp_path / "s.parquet"))
    assert back.table.equals(t.table)
    assert back.metadata["num_experts"] == E and back.metadata["moe_layers"] == [0, 1, 2]
    calls = traces.iter_calls(back)
    assert [(c.step, c.layer) for c in calls] == [(s, la) for s in range(6) for la in range(L)]
    assert all(len(c.ids) == (B * 3 if c.step == 0 else B) for c in calls)
    tokens = back.table.column("token").to_numpy()
    assert tokens[: B * 3].tolist() == list(range(6))  # prefill: token = b * P + p
    for c in calls:
        assert np.allclose(c.scores.sum(1), 1.0, atol=1e-5)
        top = np.argsort(-c.scores, axis=1, kind="stable")[:, :k]
        assert (top == c.ids).all()  # experts are the top-k of the scores, in descending order
        picked = np.take_along_axis(c.scores, c.ids, 1)
        assert np.allclose(c.weights, picked / picked.sum(1, keepdims=True), atol=1e-5)


def test_no_prompt_starts_with_decode_and_moe_layer_ids():
    p = replace(SMALL, moe_layers=(1, 2, 5))
    t = generate(p, steps=4, with_scores=False)
    calls = traces.iter_calls(t)
    assert {c.layer for c in calls} == {1, 2, 5} and calls[0].step == 0 and len(calls[0].ids) == 2
    assert calls[0].scores is None


def test_deterministic_per_seed():
    a, b = generate(SMALL, 6, 2), generate(SMALL, 6, 2)
    assert a.table.equals(b.table)
    assert not generate(replace(SMALL, seed=1), 6, 2).table.equals(a.table)


def test_class_shares_match_the_knobs():
    p = SynthParams(num_layers=4, num_experts=64, top_k=6, hot_frac=3 / 64, warm_frac=15 / 64, spread=0.15)
    r = routing(replace(p, batch_size=64), steps=60)
    got = class_shares(sorted_profile(r), p.class_counts)
    assert got == pytest.approx((0.22, 0.70, 0.08), abs=0.015)
    assert shares(p).sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("knob", "low", "high", "stat", "direction"),
    [
        ("temporal", 0.0, 0.9, "reuse", 1),
        ("layer_corr", 0.0, 0.9, "layer_pred", 1),
        ("drift", 0.0, 0.5, "drift_corr", -1),
        ("sharpness", 1.0, 4.0, "topk_mass", 1),
    ],
)
def test_each_knob_moves_its_statistic(knob, low, high, stat, direction):
    base = replace(SMALL, batch_size=4)
    lo = stats_of(routing(replace(base, **{knob: low}), 200))[stat]
    hi = stats_of(routing(replace(base, **{knob: high}), 200))[stat]
    assert direction * (hi - lo) > 0.1


def test_independent_steps_reuse_matches_chance():
    st = stats_of(routing(replace(SMALL, temporal=0.0, batch_size=8), 300))
    assert st["reuse"] == pytest.approx(st["reuse_indep"], abs=0.02)


def test_speed_batch1_1000_steps():
    p = SynthParams(num_layers=26, num_experts=64, top_k=6, hot_frac=3 / 64, warm_frac=15 / 64)
    generate(p, 2)  # calibration is cached per popularity profile
    # CPU time of this process (all its threads), not wall time: other processes on the cores do not count.
    # generate() is numpy + pyarrow on the calling thread.
    t0 = time.process_time()
    t = generate(p, 1000)
    assert len(t) == 26 * 1000
    assert time.process_time() - t0 < 3.0


def test_fit_reproduces_a_recorded_trace():
    rec = traces.load(RECORDED)
    obs = trace_stats(rec)
    p = fit_params(rec)
    assert (p.num_layers, p.num_experts, p.top_k, p.batch_size) == (4, 32, 4, 1)
    prompt = obs["prefill_tokens"]
    sims = [trace_stats(generate(replace(p, seed=s), obs["decode_steps"], prompt)) for s in (1, 2, 3)]
    for key in ("top10_share", "bottom70_share", "reuse", "layer_pred", "topk_mass"):
        assert np.mean([s[key] for s in sims]) == pytest.approx(obs[key], abs=0.04), key


def test_fit_recovers_known_knobs():
    truth = replace(SMALL, temporal=0.6, layer_corr=0.5, sharpness=2.5, batch_size=8, seed=7)
    p = fit_params(generate(truth, 150, 4))
    assert p.temporal == pytest.approx(0.6, abs=0.1)
    assert p.layer_corr == pytest.approx(0.5, abs=0.1)
    assert p.sharpness == pytest.approx(2.5, rel=0.15)
    assert p.drift < 0.05
    assert shares(p)[:5].sum() == pytest.approx(shares(truth)[:5].sum(), abs=0.03)  # the profile, not the labels
    assert p.moe_layers == (0, 1, 2) and p.batch_size == 8


def test_fit_without_scores_keeps_default_sharpness():
    p = fit_params(generate(replace(SMALL, sharpness=5.0), 30, with_scores=False))
    assert p.sharpness == SynthParams().sharpness


def test_fit_of_a_few_expert_trace_without_scores_round_trips(tmp_path):
    # 8 experts, top-2, batch 1, no prefill, no scores (the shape of a Mixtral decode trace): the default
    # classes (5% hot) do not fit 8 experts, the fit must still start; knobs survive a JSON round trip
    truth = SynthParams(num_layers=4, num_experts=8, top_k=2, hot_frac=0.0, warm_frac=0.5, hot_share=0.0,
                        warm_share=0.7, spread=0.2, temporal=0.5, layer_corr=0.6, seed=5)  # fmt: skip
    rec = generate(truth, 400, with_scores=False)
    p = fit_params(rec)
    assert (p.num_experts, p.top_k, p.batch_size, p.sharpness) == (8, 2, 1, SynthParams().sharpness)
    assert p.temporal == pytest.approx(0.5, abs=0.12)
    obs, syn = trace_stats(rec), trace_stats(generate(replace(p, seed=9), 400))
    for key in ("top10_share", "bottom70_share", "reuse", "layer_pred"):
        assert syn[key] == pytest.approx(obs[key], abs=0.05), key
    path = save_params(p, tmp_path / "fits" / "knobs.json")
    assert load_params(path) == p and params_from_dict(params_dict(p)) == p


def test_params_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing.json: cannot read"):
        load_params(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json: not a JSON file"):
        load_params(bad)
    with pytest.raises(ConfigError, match=r"unknown synthetic parameter.*colour"):
        params_from_dict({**params_dict(SMALL), "colour": 1})
    with pytest.raises(ConfigError, match="temporal must be in"):
        params_from_dict({**params_dict(SMALL), "temporal": 3.0})
    with pytest.raises(ConfigError, match="JSON object"):
        params_from_dict([1, 2])


def test_fit_refuses_short_or_ragged_traces():
    with pytest.raises(TraceError, match="decode steps"):
        fit_params(generate(SMALL, 2))
    t = generate(SMALL, 5)
    ragged = traces.Trace(
        t.table.filter(~((t.table["step"].to_numpy() == 2) & (t.table["layer"].to_numpy() == 1))), t.metadata
    )
    with pytest.raises(TraceError, match="step 2 has layers"):
        fit_params(ragged)


def test_preset_reproduces_trimoe_classes():
    spec = StandInSpec("stand-in-64", tuple(range(1, 27)), 64, 6)
    p = preset(spec)
    h, w, c = p.class_counts
    assert c / 64 > 0.70 and 0.20 <= w / 64 <= 0.40 and h >= 1
    assert p.layer_ids == spec.moe_layers and p.model == "stand-in-64" and p.hidden_size == 2048
    got = class_shares(sorted_profile(routing(replace(p, batch_size=64), 40)), p.class_counts)
    assert got == pytest.approx((0.22, 0.70, 0.08), abs=0.015)


def test_preset_few_experts_and_by_name():
    p = preset(StandInSpec("mixtral-like", tuple(range(32)), 8, 2))
    assert p.class_counts == (0, 4, 4)
    assert len(generate(p, 3)) == 32 * 3
    named = preset("deepseek-v2-lite")  # moetier.specs data
    assert (named.num_experts, named.top_k) == (64, 6)


def test_with_skew_interpolates_towards_uniform() -> None:
    p = preset("qwen2-57b-a14b")
    assert with_skew(p, 1.0).hot_share == pytest.approx(p.hot_share)
    flat = with_skew(p, 0.0)
    assert (flat.hot_share, flat.warm_share) == pytest.approx((p.hot_frac, p.warm_frac))
    assert shares(flat) == pytest.approx(np.full(64, 1 / 64))
    with pytest.raises(ConfigError, match="skew fraction"):
        with_skew(p, 1.5)


def test_hybrimoe_preset_is_less_skewed_and_hits_like_the_paper() -> None:
    from moetier.sim.cache_replay import replay_trace

    tri, hyb = preset("qwen2-57b-a14b"), preset("qwen2-57b-a14b", stats="hybrimoe")
    assert hyb.class_counts == tri.class_counts and hyb.hot_share < tri.hot_share and hyb.warm_share < tri.warm_share
    assert (hyb.temporal, hyb.layer_corr, hyb.drift) == (tri.temporal, tri.layer_corr, tri.drift)
    lru = replay_trace(generate(hyb, 160), "lru", 0.25).hit_rate
    assert lru == pytest.approx(HYBRIMOE_LRU25["qwen2-57b-a14b"], abs=0.03)  # paper Fig. 9: 45.0%
    assert replay_trace(generate(tri, 160), "lru", 0.25).hit_rate > lru + 0.15
    with pytest.raises(ConfigError, match="fitted only for"):
        preset("qwen3-30b-a3b", stats="hybrimoe")
    with pytest.raises(ConfigError, match="unknown preset statistics"):
        preset("qwen2-57b-a14b", stats="nope")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"top_k": 16}, "top_k"),
        ({"temporal": 1.0}, "below 1"),
        ({"layer_corr": -0.1}, "layer_corr"),
        ({"hot_share": 0.5, "warm_share": 0.6}, "exceeds 1"),
        ({"hot_frac": 0.01}, "hot class has 0"),
        ({"sharpness": float("nan")}, "sharpness"),
        ({"moe_layers": (0, 1)}, "moe_layers"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_knobs_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        replace(SMALL, **change)


def test_bad_shape_is_refused():
    with pytest.raises(ConfigError, match="steps"):
        generate(SMALL, 0)
    with pytest.raises(ConfigError, match="prompt_len"):
        generate(SMALL, 3, prompt_len=-1)
