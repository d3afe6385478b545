"""runtime/wire.py: the executor chosen from the config, refusals from declared capabilities (with the
messages the CLI shows), and the route observers' order."""

from __future__ import annotations

import torch

from moetier.config import EngineConfig, PrecisionConfig, PrefetchConfig, SchedulerConfig, SparsityConfig
from moetier.errors import ConfigError
from moetier.models.families import FAMILIES
from moetier.runtime.executors.base import PREFETCH, STATIC_PRECISION
from moetier.runtime.executors.registry import EXECUTORS
from moetier.runtime.observers import ObserverList, Route, Stage, router_probs
from moetier.runtime.precision import store_capabilities
from moetier.runtime.wire import choose_executor, refuse
from moetier.store.dynamic import DynamicStore
from moetier.store.store import ExpertStore

QWEN3 = next(f for f in FAMILIES if f.name == "qwen3_moe")
DYNAMIC = PrecisionConfig(mode="dynamic", hi="int8", lo="int4")
SPARSE = SparsityConfig(target=0.5, tipping=0)
HYBRID = SchedulerConfig(name="hybrimoe")


def refusal(cfg: EngineConfig, cuda: bool = False) -> str | None:
    try:
        refuse(cfg, choose_executor(cfg, cuda), store_capabilities(cfg), QWEN3, cuda)
    except ConfigError as exc:
        return str(exc)
    return None


def test_stores_declare_capabilities() -> None:
    assert {STATIC_PRECISION, PREFETCH} <= ExpertStore.capabilities
    assert STATIC_PRECISION not in DynamicStore.capabilities and PREFETCH not in DynamicStore.capabilities
    assert store_capabilities(EngineConfig(precision=DYNAMIC)) is DynamicStore.capabilities
    assert store_capabilities(EngineConfig()) is ExpertStore.capabilities


def test_executor_choice() -> None:
    assert choose_executor(EngineConfig(), cuda=False).name == "dense"
    assert choose_executor(EngineConfig(scheduler=HYBRID), cuda=False).name == "dense"  # hybrid is CUDA only
    assert choose_executor(EngineConfig(scheduler=HYBRID), cuda=True).name == "hybrid"
    assert choose_executor(EngineConfig(sparsity=SPARSE), cuda=False).name == "sparse"
    assert all(name == spec.name for name, spec in EXECUTORS.items())


def test_refusals_keep_their_messages_and_order() -> None:
    assert refusal(EngineConfig()) is None
    assert refusal(EngineConfig(scheduler=HYBRID, prefetch=PrefetchConfig(enabled=True)), cuda=True) is None
    sparse_dynamic = refusal(EngineConfig(sparsity=SPARSE, precision=DYNAMIC, prefetch=PrefetchConfig(enabled=True)))
    assert sparse_dynamic is not None and sparse_dynamic.startswith("--sparsity cannot be combined with --precision")
    prefetch = refusal(EngineConfig(precision=DYNAMIC, prefetch=PrefetchConfig(enabled=True), scheduler=HYBRID), True)
    assert prefetch == (
        "prefetch needs a static precision (full, int8, int4, int2); dynamic keeps every expert resident already"
    )
    hybrid = refusal(EngineConfig(precision=DYNAMIC, scheduler=HYBRID), cuda=True)
    assert hybrid == "hybrid CPU-GPU execution needs a static precision (full, int8, int4, int2)"
    assert refusal(EngineConfig(sparsity=SPARSE, scheduler=HYBRID), cuda=True) == (
        "hybrid CPU-GPU execution and --sparsity cannot be combined yet"
    )
    assert refusal(EngineConfig(sparsity=SPARSE, scheduler=HYBRID), cuda=False) is None  # no hybrid on CPU


class Probe:
    def __init__(self, stage: Stage, name: str, seen: list[str]) -> None:
        self.stage, self.name, self.seen = stage, name, seen

    def observe(self, route: Route) -> None:
        self.seen.append(self.name)


def test_observers_run_in_stage_order_and_share_probabilities() -> None:
    seen: list[str] = []
    obs = ObserverList()
    for stage, name in ((Stage.PREFETCH, "prefetch"), (Stage.SCORE, "scores"), (Stage.RECORD, "switching"),
                        (Stage.RECORD, "trace")):  # fmt: skip
        obs.add(Probe(stage, name, seen))
    logits = torch.randn(3, 5)
    route = Route(0, torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), logits, "softmax")
    for o in obs:
        o.observe(route)
    assert seen == ["switching", "trace", "scores", "prefetch"]
    assert route.probs is route.probs  # computed once per call
    torch.testing.assert_close(route.probs, torch.softmax(logits, -1))
    torch.testing.assert_close(router_probs(logits, "sigmoid"), torch.sigmoid(logits))
