"""Hybrid CPU-GPU executor (runtime/executors/hybrid.py) on CPU, the accelerator domain stubbed by a second
CPU executor: same output as one domain, both domains running at once, errors propagating with
every pin released, and the whole wiring inside a tiny engine matching the reference."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch

import moetier
from moetier.config import EngineConfig, RuntimeConfig
from moetier.policies.costmodel import ComputeProfile, CostModel, HardwareProfile, LinkProfile
from moetier.policies.schedule_base import ExpertWork
from moetier.runtime.executors.base import group_tokens
from moetier.runtime.executors.hybrid import DomainExec, HybridExecutor, HybridState, PricedScheduler, Task
from moetier.runtime.moe_block import Pipeline
from moetier.runtime.pricing import Pricing, engine_spec
from moetier.types import Domain, ExpertKey, ExpertTask, Plan

CPU = torch.device("cpu")
H, INTER, E = 16, 8, 6


def weights() -> dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        ExpertKey(0, e): (torch.randn(2 * INTER, H, generator=g), torch.randn(H, INTER, generator=g)) for e in range(E)
    }


def expert(x: torch.Tensor, v: Any) -> torch.Tensor:
    w13, w2 = v
    gate, up = (x @ w13.T).chunk(2, dim=-1)  # [N, INTER] each
    return (torch.nn.functional.silu(gate) * up) @ w2.T  # [N, H]


class Domains:
    """Two CPU 'domains' over the same weights; counts pins, records threads, optional barrier/failure."""

    def __init__(self, barrier: threading.Barrier | None = None, fail: ExpertKey | None = None) -> None:
        self.w, self.barrier, self.fail = weights(), barrier, fail
        self.pins: Counter[ExpertKey] = Counter()
        self.threads: dict[Domain, set[str]] = {Domain.ACCEL: set(), Domain.HOST: set()}
        self.lock = threading.Lock()

    def make(self, domain: Domain) -> DomainExec:
        first = [True]

        def fn(x: torch.Tensor, v: Any) -> torch.Tensor:
            self.threads[domain].add(threading.current_thread().name)
            if self.barrier is not None and first[0]:
                first[0] = False
                self.barrier.wait()  # both domains must be inside a task at the same time
            return expert(x, v)

        def acquire(k: ExpertKey) -> Any:
            if k == self.fail:
                raise RuntimeError(f"injected failure on {k}")
            with self.lock:
                self.pins[k] += 1
            return self.w[k]

        def release(k: ExpertKey) -> None:
            with self.lock:
                self.pins[k] -= 1

        return DomainExec(domain, CPU, acquire, release, fn)


def tasks_for(T: int = 9, k: int = 2) -> tuple[torch.Tensor, list[Task]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    w = torch.rand(T, k, generator=g)
    _, groups = group_tokens(ids, w, E)
    return x, [Task(ExpertKey(0, e), *groups[e]) for e in sorted(groups)]


def reference(x: torch.Tensor, tasks: list[Task]) -> torch.Tensor:
    w = weights()
    out = torch.zeros_like(x)
    for t in tasks:
        out.index_add_(0, t.tok, expert(x[t.tok], w[t.key]) * t.w[:, None])
    return out


def test_mixed_domains_equal_one_domain_and_overlap():
    x, tasks = tasks_for()
    doms = Domains(barrier=threading.Barrier(2, timeout=10))
    ex = HybridExecutor(doms.make(Domain.ACCEL), doms.make(Domain.HOST))
    mixed = [Domain.ACCEL if i % 2 else Domain.HOST for i in range(len(tasks))]
    out = ex.run(x, tasks, mixed)
    assert torch.equal(out, reference(x, tasks))  # same per-task math, same combine order
    assert doms.threads[Domain.ACCEL] == {threading.current_thread().name}
    assert len(doms.threads[Domain.HOST]) == 1 and doms.threads[Domain.HOST].isdisjoint(doms.threads[Domain.ACCEL])
    st = ex.stats()
    assert (st["accel_tasks"], st["host_tasks"]) == (mixed.count(Domain.ACCEL), mixed.count(Domain.HOST))
    assert st["overlap_s"] > 0
    assert not +doms.pins  # every pin released
    single = HybridExecutor(Domains().make(Domain.ACCEL), Domains().make(Domain.HOST))
    assert torch.equal(single.run(x, tasks, [Domain.HOST] * len(tasks)), out)
    assert torch.equal(single.run(x, tasks, [Domain.ACCEL] * len(tasks)), out)
    ex.close()
    single.close()


@pytest.mark.parametrize("failing_domain", [Domain.HOST, Domain.ACCEL])
def test_errors_propagate_and_release_pins(failing_domain):
    x, tasks = tasks_for()
    bad = tasks[2].key
    doms = Domains(fail=bad)
    ex = HybridExecutor(doms.make(Domain.ACCEL), doms.make(Domain.HOST))
    domains = [Domain.HOST if i % 2 == 0 else Domain.ACCEL for i in range(len(tasks))]
    domains[2] = failing_domain
    with pytest.raises(RuntimeError, match="injected failure"):
        ex.run(x, tasks, domains)
    assert not +doms.pins
    ok = Domains()
    ex2 = HybridExecutor(ok.make(Domain.ACCEL), ok.make(Domain.HOST))
    assert torch.equal(ex2.run(x, tasks, domains), reference(x, tasks))  # a fresh call works
    ex.close()
    ex2.close()


class Alternate:
    """A scheduler stub: alternate experts between the two domains (by position in the work)."""

    name, admits = "alternate", False

    def schedule(self, work: list[ExpertWork], ready: Any = None) -> Plan:
        doms = {w.key: (Domain.ACCEL if i % 2 else Domain.HOST) for i, w in enumerate(work)}
        return Plan(tuple(ExpertTask(w.key, w.tokens) for w in work), doms)


def test_hybrid_experts_in_a_tiny_engine_match_the_reference(tiny_ckpt, hf_model):
    path = tiny_ckpt("qwen3_moe")
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model("qwen3_moe")(ids).logits
    e = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32")))
    store, fn = e.store, e.loaded.blocks[0].expert_fn
    gpu = ComputeProfile(peak_flops=1e12, mem_bw=1e11, overhead_s=1e-5)
    prof = HardwareProfile("stub", "test", cpu=gpu, gpu=gpu, pcie=LinkProfile(1e10), disk=LinkProfile(1e9),
                           cpu_threads=2, host_mem_bytes=1 << 30, gpu_mem_bytes=1 << 30)  # fmt: skip
    pricing = Pricing(CostModel(prof, engine_spec(e.loaded)), Alternate(), "gpu", "cpu", "pcie")
    # accelerator domain stubbed by a second CPU executor on the same (host) tier
    accel = DomainExec(Domain.ACCEL, CPU, store.acquire, store.release, fn)
    host = DomainExec(Domain.HOST, CPU, store.acquire, store.release, fn)
    hybrid = HybridState(PricedScheduler(pricing, store.cached_keys), HybridExecutor(accel, host, e.info.num_experts))
    for b in e.loaded.blocks:
        assert b.pipeline is not None
        b.attach(Pipeline(hybrid.scheduler, hybrid.executor, b.pipeline.observers))
    got = e.logits(ids)
    assert (got - expected).abs().max().item() <= 1e-5
    st = hybrid.stats()
    assert st["accel_tasks"] > 0 and st["host_tasks"] > 0
    assert not +store.compute.pins
    hybrid.executor.close()
    e.close()
