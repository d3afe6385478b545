"""The engine's prefetch with the simulator's history predictor (PrefetchConfig.predictor = "history",
runtime/prefetch.py HistoryPredictor): output identical to no prefetch, accuracy counters filled, the
predictor fed exactly the router's ids (a trace recorded in the same run, replayed into a fresh
RouteHistoryPredictor, gives the same statistics), bad predictor names refused. Through transformers' experts
seam (a seam-only family, and a row family run with RuntimeConfig(seam=True)): history prefetch runs, moves
experts and never changes the output; the gate predictor, which needs the routers, is refused there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import moetier
from moetier.config import (
    PREFETCH_PREDICTORS,
    Budgets,
    CacheConfig,
    EngineConfig,
    PrefetchConfig,
    RuntimeConfig,
    SamplingConfig,
)
from moetier.errors import ConfigError
from moetier.models.tiny import build_tiny_checkpoint, tiny_config
from moetier.policies.route_history import RouteHistoryPredictor
from moetier.runtime.prefetch import PREDICTORS
from moetier.traces import iter_calls, load
from moetier.types import ExpertKey

BF16 = RuntimeConfig(device="cpu", dtype="bf16")
IDS = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
SAMPLING = SamplingConfig(temperature=0.8, seed=0)


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 qwen3_moe with 4 MoE layers, so depth 1..3 all have layers ahead."""
    folder = tmp_path_factory.mktemp("deep") / "q4"
    return build_tiny_checkpoint("qwen3_moe", folder, seed=3, num_hidden_layers=4, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def seam_only(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """fp32 phimoe (no family row: transformers' own MoE blocks, models/seam.py) with 4 MoE layers, and
    transformers' own prefill logits of IDS."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("phimoe", num_hidden_layers=4), dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("seam") / "phimoe"
    model.save_pretrained(folder)
    with torch.no_grad():
        return folder, model(IDS).logits


def engine(path: Path, prefetch: PrefetchConfig, slots: int = 3, runtime: RuntimeConfig = BF16) -> moetier.Engine:
    probe = moetier.load(path, EngineConfig(runtime=runtime))
    budget = slots * probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), cache=CacheConfig("mrs"),
                                           prefetch=prefetch, runtime=runtime))  # fmt: skip


def outputs(e: moetier.Engine) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Prefill logits, decode logits one token at a time, and a sampled generation."""
    prefill = e.logits(IDS)
    e.decoder.reset()
    decode = torch.stack([e.step(IDS[:, i : i + 1])[-1] for i in range(IDS.shape[1])])
    e.decoder.reset()
    tokens = e.generate(IDS[0].tolist(), 16, SAMPLING, stop_at_eos=False).token_ids
    return prefill, decode, tokens


def test_history_prefetch_never_changes_the_output(deep):
    e = engine(deep, PrefetchConfig())
    expected = outputs(e)
    e.close()
    for depth in (1, 3):
        e = engine(deep, PrefetchConfig(enabled=True, depth=depth, predictor="history"))
        got = outputs(e)
        pf = e.stats()["prefetch"]
        e.close()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]
        assert pf["predictor"] == "history" and pf["issued"] > 0  # prefetch did run


def test_history_accuracy_counters_are_filled_and_bounded(deep):
    e = engine(deep, PrefetchConfig(enabled=True, depth=3, predictor="history"))
    e.generate(IDS[0].tolist(), 12, SAMPLING, stop_at_eos=False)
    pf = e.stats()["prefetch"]
    e.close()
    assert pf["predicted"] > 0 and 0 <= pf["accuracy"] <= 1
    assert set(pf["by_distance"]) == {1, 2, 3} and set(pf["history"]) == {1, 2, 3}
    assert set(pf["accuracy_by_distance"]) == {"1", "2", "3"}
    for d in (1, 2, 3):
        row, own = pf["by_distance"][d], pf["history"][d]
        assert row["predicted"] > 0 and 0 <= row["accuracy"] <= 1 and 0 <= row["correct"] <= row["predicted"]
        assert pf["accuracy_by_distance"][str(d)] == row["accuracy"]  # the simulator's key, same figure
        assert own["predicted"] > 0 and 0 <= own["accuracy"] <= 1 and 0 <= own["correct"] <= own["predicted"]
    # 4 MoE layers: distance d is predicted from layers 0..3-d, one prediction per call
    assert pf["by_distance"][1]["predicted"] > pf["by_distance"][2]["predicted"] > pf["by_distance"][3]["predicted"]


def test_the_predictor_sees_exactly_the_routers_ids(deep, tmp_path):
    depth = 3
    e = engine(deep, PrefetchConfig(enabled=True, depth=depth, predictor="history"))
    e.record_trace(tmp_path / "t.parquet")
    e.generate(IDS[0].tolist(), 10, SAMPLING, stop_at_eos=False)
    e.logits(IDS[:, :5])  # a second, shorter prefill: a new step of another row count
    pf = e.stats()["prefetch"]
    e.close()  # writes the trace
    trace = load(tmp_path / "t.parquet")
    layers = [int(x) for x in trace.metadata["moe_layers"]]
    fresh = RouteHistoryPredictor(layers, int(trace.metadata["num_experts"]), int(trace.metadata["top_k"]), depth)
    # replay: feed each call, predict the layers ahead, score per (layer call, expert) as the engine does
    by_d = {d: [0, 0] for d in range(1, depth + 1)}
    pending: dict[int, dict[int, set[ExpertKey]]] = {}
    calls = iter_calls(trace)
    for c in calls:
        actual = {ExpertKey(c.layer, int(x)) for x in np.unique(c.ids)}
        for d, keys in pending.pop(c.layer, {}).items():
            by_d[d][0] += len(keys)
            by_d[d][1] += len(keys & actual)
        fresh.feed(c.layer, c.ids)
        p = layers.index(c.layer)
        for d in range(1, min(depth, len(layers) - 1 - p) + 1):
            target = layers[p + d]
            pending.setdefault(target, {})[d] = {ExpertKey(target, x) for x in fresh.predict_counts(c.layer, d)}
    assert len(calls) > 4 * len(layers)
    assert pf["history"] == fresh.stats() and fresh.stats()[1]["predicted"] > 0
    for d in range(1, depth + 1):
        assert [pf["by_distance"][d]["predicted"], pf["by_distance"][d]["correct"]] == by_d[d]


def test_gate_stays_the_default_and_names_itself(deep):
    assert PrefetchConfig().predictor == "gate"
    e = engine(deep, PrefetchConfig(enabled=True, depth=2))
    e.generate(IDS[0].tolist(), 4, SAMPLING, stop_at_eos=False)
    pf = e.stats()["prefetch"]
    e.close()
    assert pf["predictor"] == "gate" and "history" not in pf
    assert pf["accuracy_by_distance"] == {str(d): pf["by_distance"][d]["accuracy"] for d in (1, 2)}


def test_predictor_names():
    assert set(PREDICTORS) == set(PREFETCH_PREDICTORS)
    for bad in ("oracle", "History", ""):
        with pytest.raises(ConfigError, match="prefetch predictor must be one of gate, history"):
            PrefetchConfig(enabled=True, predictor=bad)


FP32_SEAM = RuntimeConfig(device="cpu", dtype="fp32", seam=True)


def seam_runs(path: Path, runtime: RuntimeConfig) -> tuple[tuple[torch.Tensor, torch.Tensor, list[int]], dict]:
    """`outputs` without prefetch, then with history prefetch at depth 1 and 3, each through the seam: the outputs
    must be identical; returns them and the depth-3 run's prefetch stats."""
    e = engine(path, PrefetchConfig(), slots=2, runtime=runtime)
    assert e.loaded.family.seam  # transformers' own MoE blocks, our experts module
    expected = outputs(e)
    e.close()
    pf: dict = {}
    for depth in (1, 3):
        e = engine(path, PrefetchConfig(enabled=True, depth=depth, predictor="history"), slots=2, runtime=runtime)
        got = outputs(e)
        pf = e.stats()["prefetch"]
        e.close()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]
        assert pf["predictor"] == "history" and pf["depth"] == depth
        assert pf["issued"] > 0 and pf["predicted"] > 0 and 0 <= pf["accuracy"] <= 1  # prefetch did move experts
    return expected, pf


def check_depth3(pf: dict) -> None:
    assert set(pf["accuracy_by_distance"]) == {"1", "2", "3"} and set(pf["history"]) == {1, 2, 3}
    for d in (1, 2, 3):
        row = pf["by_distance"][d]
        assert row["predicted"] > 0 and 0 <= row["correct"] <= row["predicted"]
        assert pf["accuracy_by_distance"][str(d)] == row["accuracy"] and 0 <= row["accuracy"] <= 1
        assert 0 <= pf["history"][d]["accuracy"] <= 1


def test_history_prefetch_on_a_seam_only_family(seam_only):
    path, want = seam_only
    expected, pf = seam_runs(path, RuntimeConfig(device="cpu", dtype="fp32"))  # phimoe has no row: the seam anyway
    assert (expected[0] - want).abs().max().item() <= 1e-4  # and the seam is still transformers' model
    check_depth3(pf)


def test_history_prefetch_on_a_row_family_through_the_seam(deep):
    _, pf = seam_runs(deep, RuntimeConfig(device="cpu", dtype="bf16", seam=True))
    check_depth3(pf)


def test_the_seam_feeds_the_predictor_the_row_blocks_ids(deep):
    """The same checkpoint with its row's TieredMoE and through the seam (both on transformers' decoder): the
    history predictor sees the same routing, so its statistics are the same."""
    stats = []
    for seam in (False, True):
        rt = RuntimeConfig(device="cpu", dtype="bf16", seam=seam, lean=False)
        e = engine(deep, PrefetchConfig(enabled=True, depth=3, predictor="history"), runtime=rt)
        assert e.loaded.family.seam is seam
        e.logits(IDS)
        pf = e.stats()["prefetch"]
        e.close()
        stats.append((pf["history"], pf["by_distance"]))
    assert stats[0] == stats[1] and stats[0][0][1]["predicted"] > 0


def test_gate_is_refused_on_the_seam_naming_history(seam_only, deep):
    assert PREDICTORS["gate"].needs_router and not PREDICTORS["history"].needs_router
    for path in (seam_only[0], deep):  # a family without a row; a row family run with RuntimeConfig(seam=True)
        for pf in (PrefetchConfig(enabled=True), PrefetchConfig(enabled=True, depth=2, predictor="gate")):
            with pytest.raises(ConfigError, match=r"prefetch predictor 'gate' .*routers.*--prefetch-predictor history"):
                moetier.load(path, EngineConfig(prefetch=pf, runtime=FP32_SEAM))
