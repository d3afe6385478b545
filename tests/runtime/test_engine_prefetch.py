"""Engine-side prefetch and score-aware caching on tiny models: exactness with any policy and
tiny budgets, prediction statistics against an independent recomputation, failing prefetch
reads, MRS changing victims, Belady and bad combinations refused."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import moetier
from moetier.config import Budgets, CacheConfig, EngineConfig, PrefetchConfig, RuntimeConfig, SchedulerConfig
from moetier.errors import ConfigError
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.observers import CacheScores, Tap
from moetier.types import ExpertKey

FP32 = RuntimeConfig(device="cpu", dtype="fp32", lean=True)
IDS = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3_moe with 4 MoE layers, so depth 1..3 all have layers ahead."""
    return build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("deep") / "q4", seed=3, num_hidden_layers=4)


def engine(path: Path, slots: int, policy: str = "lru", depth: int = 0, max_experts: int = 4) -> moetier.Engine:
    probe = moetier.load(path, EngineConfig(runtime=FP32))
    budget = slots * probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    pf = PrefetchConfig(enabled=depth > 0, depth=max(depth, 1), max_experts=max_experts)
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), cache=CacheConfig(policy),
                                           prefetch=pf, runtime=FP32))  # fmt: skip


def reference(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(IDS).logits


@pytest.mark.parametrize(("policy", "depth", "slots"), [
    ("lru", 1, 2), ("lfu", 2, 3), ("mrs", 3, 2), ("mrs", 1, 5),
])  # fmt: skip
def test_logits_exact_with_prefetch(deep, policy, depth, slots):
    expected = reference(deep)
    e = engine(deep, slots, policy, depth)
    for _ in range(2):  # a second pass runs with a warm, prefetch-shaped cache
        got = e.logits(IDS)
        assert (got - expected).abs().max().item() <= 1e-5
    # decode too: one token at a time through the same blocks
    e.decoder.reset()
    steps = [e.step(IDS[:, i : i + 1])[-1] for i in range(IDS.shape[1])]
    assert (torch.stack(steps) - expected[0]).abs().max().item() <= 1e-5
    st = e.stats()
    assert st["prefetch"]["issued"] > 0 and st["prefetch"]["predicted"] > 0
    assert st["peak_host_expert_bytes"] <= slots * e.store.slot_bytes
    e.close()


def test_prediction_stats_match_an_independent_recomputation(deep):
    e = engine(deep, 3, "lru", depth=2)
    blocks = {b.layer: b for b in e.loaded.blocks}
    order = sorted(blocks)
    inputs: list[tuple[int, torch.Tensor]] = []
    actual: dict[int, list[set[int]]] = {layer: [] for layer in order}
    for layer, b in blocks.items():
        b.register_forward_pre_hook(lambda m, a, layer=layer: inputs.append((layer, a[0].reshape(-1, a[0].shape[-1]))))
    e.observers.add(Tap(lambda r: actual[r.layer].append(set(r.ids.reshape(-1).tolist()))))
    e.generate(IDS[0].tolist(), 4, stop_at_eos=False)
    # predictions: router of layer l+d on layer l's input, d = 1, 2; scored when l+d runs
    predicted = correct = 0
    by_d = {1: [0, 0], 2: [0, 0]}
    calls = {layer: 0 for layer in order}
    pending: dict[int, dict[int, set[int]]] = {}
    for layer, x in inputs:
        got = actual[layer][calls[layer]]
        calls[layer] += 1
        made = pending.pop(layer, {})
        if made:
            union = set().union(*made.values())
            predicted, correct = predicted + len(union), correct + len(union & got)
            for d, s in made.items():
                by_d[d][0] += len(s)
                by_d[d][1] += len(s & got)
        i = order.index(layer)
        for d, nxt in enumerate(order[i + 1 : i + 3], start=1):
            with torch.no_grad():
                _, _, ids = blocks[nxt].gate(x)
            pending.setdefault(nxt, {})[d] = set(ids.reshape(-1).tolist())
    pf = e.stats()["prefetch"]
    assert (pf["predicted"], pf["correct"]) == (predicted, correct) and predicted > 0
    assert pf["accuracy"] == pytest.approx(correct / predicted)
    for d in (1, 2):
        assert (pf["by_distance"][d]["predicted"], pf["by_distance"][d]["correct"]) == tuple(by_d[d])
    assert 0 < pf["used"] <= pf["issued"]
    e.close()


def test_failing_prefetch_read_keeps_the_engine_exact(deep):
    expected = reference(deep)
    e = engine(deep, 2, "mrs", depth=1)
    inner = e.store.source.read_into

    def flaky(key: ExpertKey, views: object) -> int:
        if threading.current_thread().name == "moetier-prefetch":
            raise OSError("injected prefetch read failure")
        return inner(key, views)

    e.store.source.read_into = flaky  # type: ignore[method-assign]
    got = e.logits(IDS)
    assert e.store.drain(30), "a failed prefetch read left the prefetch queue undrained"
    assert (got - expected).abs().max().item() <= 1e-5
    pf = e.stats()["prefetch"]
    assert pf["failed"] == pf["issued"] > 0 and pf["used"] == 0
    assert "injected prefetch read failure" in pf["errors"][-1]
    assert e.store.inflight() == set() and len(e.store.compute.free) + len(e.store.index) == e.store.capacity
    e.close()


def test_mrs_in_the_engine_gets_scores_and_changes_victims(deep):
    residency = {}
    for policy in ("lru", "mrs"):
        e = engine(deep, 4, policy)
        seen: list[frozenset[ExpertKey]] = []
        e.observers.add(Tap(lambda r, e=e, seen=seen: seen.append(frozenset(e.store.resident()))))
        e.generate(IDS[0].tolist(), 6, stop_at_eos=False)
        residency[policy] = seen
        if policy == "mrs":
            pol = e.store.compute.policy
            assert any(pol.score(k) > 0 for k in e.store.keys)  # router scores reached the policy
            assert any(isinstance(o, CacheScores) for o in e.observers)
        else:
            assert not any(isinstance(o, CacheScores) for o in e.observers)  # LRU: no score work at decode
        e.close()
    assert residency["lru"] != residency["mrs"]


def test_belady_and_bad_combinations_are_refused(deep):
    with pytest.raises(ConfigError, match="future"):
        moetier.load(deep, EngineConfig(cache=CacheConfig("belady"), runtime=FP32))
    with pytest.raises(ConfigError, match="unknown scheduler"):
        moetier.load(deep, EngineConfig(scheduler=SchedulerConfig(name="nope"),
                                        prefetch=PrefetchConfig(enabled=True), runtime=FP32))  # fmt: skip
    with pytest.raises(ConfigError, match="profile"):
        moetier.load(deep, EngineConfig(scheduler=SchedulerConfig(profile="/nonexistent/p.json"),
                                        prefetch=PrefetchConfig(enabled=True), runtime=FP32))  # fmt: skip
    for bad in (dict(depth=0), dict(depth=4), dict(max_experts=0)):
        with pytest.raises(ConfigError):
            PrefetchConfig(enabled=True, **bad)


def test_bf16_output_is_bit_identical_whatever_the_residency(tmp_path):
    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "b", seed=4, num_hidden_layers=4, dtype=torch.bfloat16)
    bf16 = RuntimeConfig(device="cpu", dtype="bf16")
    outs = []
    for budget_slots, policy, depth in ((None, "lru", 0), (2, "lru", 0), (3, "mrs", 2), (2, "lfu", 1)):
        if budget_slots is None:
            e = moetier.load(path, EngineConfig(runtime=bf16))
        else:
            probe = moetier.load(path, EngineConfig(runtime=bf16))
            budget = budget_slots * probe.store.slot_bytes + probe.store.staging_bytes
            probe.close()
            e = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), cache=CacheConfig(policy),
                                                prefetch=PrefetchConfig(enabled=depth > 0, depth=max(depth, 1)),
                                                runtime=bf16))  # fmt: skip
        prefill = e.logits(IDS)
        e.decoder.reset()
        decode = torch.stack([e.step(IDS[:, i : i + 1])[-1] for i in range(IDS.shape[1])])
        outs.append((prefill, decode))
        e.close()
    for prefill, decode in outs[1:]:
        assert torch.equal(prefill, outs[0][0]) and torch.equal(decode, outs[0][1])
