"""The hybrid CPU-GPU executor of a MoE layer call (HybriMoE IV-B; issue 5 item 8), and its scheduler.

`PricedScheduler.plan` prices one call's experts with the cost model (cached = resident in the
accelerator tier) and asks the policy scheduler (policies/schedulers) for the domain of each; its
Plan runs the accelerator's tasks first, each domain's by decreasing token count.
`HybridExecutor.execute` runs the plan: ACCEL tasks compute on the GPU from the accelerator tier,
HOST tasks on the CPU from the host tier (views of host slots, never copied to the GPU). The HOST
group runs in one worker thread (torch's CPU ops release the GIL and use the intra-op thread pool)
while the ACCEL group runs in the calling thread; then the weighted outputs are summed into the
call's output in ascending expert order with index_add (token order), as the dense executor
does, so the result depends neither on the domains nor on which finished first. `SPEC.build`
gives every block the one scheduler and the one executor when the engine runs on CUDA with
SchedulerConfig.name set (runtime/wire.py chooses).

UNVERIFIED ON A GPU: this project's machine has none. The executor is tested on CPU with the
accelerator domain stubbed by a second CPU executor (tests/runtime/test_hybrid_exec.py):
identical output to the single-domain path, both domains running at once, worker errors
propagating. The CUDA specifics (host tasks' tokens copied to the CPU once per call, their
outputs copied back before the combine, accelerator-tier acquires that copy host -> GPU on a
miss in the calling thread) are written for, not run on, a GPU. An ACCEL task whose expert is
not in the accelerator tier is loaded there on demand (so it is admitted into the cache even
for a scheduler with admits=False; a static mapping that wants no admission would need a
non-caching copy, not written).

Invariants: every acquired expert is released, also when a task fails; a failure in either
group is raised in the calling thread after both groups have stopped; the output equals the
single-domain path's (same per-task math, same combine order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.kernels.experts import ExpertFn
from moetier.models.families import Family
from moetier.runtime.executors.base import DOMAINS, STATIC_PRECISION, Grouped, group_tokens
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.runtime.pricing import Pricing
from moetier.store.store import ExpertStore
from moetier.types import Domain, ExpertKey, ExpertTask, Plan, Tier

NEEDS = {
    STATIC_PRECISION: "hybrid CPU-GPU execution needs a static precision (full, int8, int4, int2)",
    DOMAINS: "hybrid CPU-GPU execution needs a static precision (full, int8, int4, int2)",
}
SPARSITY_REFUSAL = "hybrid CPU-GPU execution and --sparsity cannot be combined yet"


@dataclass(frozen=True)
class DomainExec:
    """One compute domain: its device and how it pins / unpins an expert's weights there."""

    domain: Domain
    device: torch.device
    acquire: Callable[[ExpertKey], Any]
    release: Callable[[ExpertKey], None]
    fn: ExpertFn


@dataclass(frozen=True)
class Task:
    key: ExpertKey
    tok: torch.Tensor  # [c] token indices into the call's x
    w: torch.Tensor  # [c] gate weights of those tokens


class HybridExecutor:
    """The executor of every MoE layer of a hybrid engine (one worker thread for all of them)."""

    def __init__(self, accel: DomainExec, host: DomainExec, num_experts: int = 0) -> None:
        self.accel, self.host, self.num_experts = accel, host, num_experts
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetier-host")
        self.tasks = {Domain.ACCEL: 0, Domain.HOST: 0}
        self.busy_s = {Domain.ACCEL: 0.0, Domain.HOST: 0.0}
        self.overlap_s = 0.0  # seconds both groups were running at once

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        """ids/weights [T, k] -> tokens per expert (group_tokens)."""
        active, groups = group_tokens(ids, weights, self.num_experts)
        return Grouped(active, groups)

    def execute(self, x: torch.Tensor, plan: Plan, grouped: Grouped) -> torch.Tensor:
        """x [T, H] -> [T, H]: the plan's tasks on their domains (`run`)."""
        groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = grouped.data
        tasks = [Task(t.key, *groups[t.key.expert]) for t in plan.tasks]
        return self.run(x, tasks, [plan.domains[t.key] for t in plan.tasks])

    def run(self, x: torch.Tensor, tasks: Sequence[Task], domains: Sequence[Domain]) -> torch.Tensor:
        """x [T, H] -> sum over tasks of w * expert(x[tok]) as [T, H] on x's device."""
        # 1. split by domain, remembering each task's place in the plan
        accel = [i for i, d in enumerate(domains) if d is Domain.ACCEL]
        host = [i for i, d in enumerate(domains) if d is not Domain.ACCEL]
        results: list[torch.Tensor | None] = [None] * len(tasks)
        # 2. the HOST group in the worker thread, the ACCEL group here
        future = self._worker.submit(self._group, self.host, x, tasks, host, results) if host else None
        error: BaseException | None = None
        span_a: tuple[float, float] | None = None
        try:
            span_a = self._group(self.accel, x, tasks, accel, results)
        except BaseException as exc:  # let the worker finish (its pins) before raising
            error = exc
        span_h = None
        if future is not None:
            try:
                span_h = future.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        if span_a is not None and span_h is not None:
            self.overlap_s += max(0.0, min(span_a[1], span_h[1]) - max(span_a[0], span_h[0]))
        # 3. combine in expert order (as the single-domain path and the reference), token order per task
        out = torch.zeros_like(x)  # [T, H]
        for i in sorted(range(len(tasks)), key=lambda j: tasks[j].key):
            y = results[i]
            assert y is not None
            out.index_add_(0, tasks[i].tok, y.to(out.device, out.dtype))
        return out

    def _group(
        self, dom: DomainExec, x: torch.Tensor, tasks: Sequence[Task], which: list[int],
        results: list[torch.Tensor | None],
    ) -> tuple[float, float]:  # fmt: skip
        """Run the tasks `which` on one domain; returns its (start, end) wall-clock span."""
        t0 = time.perf_counter()
        if not which:
            return t0, t0
        xd = x if x.device == dom.device else x.to(dom.device)  # [T, H] once per call and domain
        for i in which:
            task = tasks[i]
            tok = task.tok if task.tok.device == dom.device else task.tok.to(dom.device)  # [c]
            w = task.w if task.w.device == dom.device else task.w.to(dom.device)  # [c]
            views = dom.acquire(task.key)
            try:
                y = dom.fn(xd[tok], views)  # [c, H]
                results[i] = y * w[:, None]  # [c, H]
            finally:
                dom.release(task.key)
        t1 = time.perf_counter()
        with _STATS_LOCK:
            self.tasks[dom.domain] += len(which)
            self.busy_s[dom.domain] += t1 - t0
        return t0, t1

    def stats(self) -> dict[str, Any]:
        return {
            "accel_tasks": self.tasks[Domain.ACCEL], "host_tasks": self.tasks[Domain.HOST],
            "accel_busy_s": self.busy_s[Domain.ACCEL], "host_busy_s": self.busy_s[Domain.HOST],
            "overlap_s": self.overlap_s,
        }  # fmt: skip

    def close(self) -> None:
        self._worker.shutdown(wait=True)


_STATS_LOCK = threading.Lock()


class PricedScheduler:
    """Step 2 of a hybrid call: price the call's experts, schedule them over the two domains."""

    def __init__(self, pricing: Pricing, cached: Callable[[], set[ExpertKey]]) -> None:
        self.pricing, self.cached = pricing, cached
        self.moved = 0

    def plan(self, layer: int, counts: Mapping[int, int]) -> Plan:
        """counts: expert -> tokens -> the Plan, ACCEL tasks first, each domain's by decreasing tokens."""
        # 1. price with the accelerator tier's residency, 2. schedule
        p = self.pricing
        work = p.cost.work(layer, dict(counts), self.cached(), p.fast, p.slow, p.link)
        plan = p.scheduler.schedule(work)
        self.moved += len(plan.moved)
        # 3. run order: the accelerator's tasks first (the host's run meanwhile in the worker)
        order = sorted(work, key=lambda w: (plan.domains.get(w.key, Domain.ACCEL) is not Domain.ACCEL, -w.tokens))
        tasks = tuple(ExpertTask(w.key, w.tokens) for w in order)
        domains = {w.key: plan.domains.get(w.key, Domain.ACCEL) for w in order}
        return Plan(tasks, domains, plan.moved, plan.makespan, plan.ops)


@dataclass
class HybridState:
    """The hybrid engine's one scheduler and one executor, for stats and close."""

    scheduler: PricedScheduler
    executor: HybridExecutor
    stats_key: str = "hybrid_stats"

    def stats(self) -> dict[str, Any]:
        return self.executor.stats() | {"moved": self.scheduler.moved}

    def close(self) -> None:
        self.executor.close()


def store_domains(store: ExpertStore, fn: ExpertFn, accel_device: torch.device) -> tuple[DomainExec, DomainExec]:
    """The accelerator domain on the store's accelerator tier, the host domain on its host tier."""
    if store.accel is None:
        raise ConfigError("hybrid CPU-GPU execution needs a CUDA device (the store has no accelerator tier)")
    accel = DomainExec(Domain.ACCEL, accel_device, lambda k: store.acquire(k, Tier.ACCEL),
                       lambda k: store.release(k, Tier.ACCEL), fn)  # fmt: skip
    host = DomainExec(Domain.HOST, torch.device("cpu"), lambda k: store.acquire(k, Tier.HOST),
                      lambda k: store.release(k, Tier.HOST), fn)  # fmt: skip
    return accel, host


def check(config: EngineConfig, family: Family) -> None:
    """Refuse what the hybrid path does not run yet."""
    if config.sparsity.enabled:
        raise ConfigError(SPARSITY_REFUSAL)


def build(ctx: BuildContext) -> Built:
    """One PricedScheduler and one HybridExecutor shared by every block. UNVERIFIED on a GPU."""
    loaded = ctx.loaded
    assert ctx.pricing is not None  # wire.py prices a hybrid engine (needs_pricing)
    store = cast(ExpertStore, loaded.store)  # the "domains" capability: acquire / release per tier
    accel, host = store_domains(store, loaded.blocks[0].expert_fn, loaded.device)
    executor = HybridExecutor(accel, host, loaded.info.num_experts)
    scheduler = PricedScheduler(ctx.pricing, store.cached_keys)
    return Built({b.layer: (scheduler, executor) for b in loaded.blocks}, HybridState(scheduler, executor))


SPEC = ExecutorSpec(name="hybrid", build=build, needs=NEEDS, check=check, needs_pricing=True)
