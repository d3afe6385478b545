"""llama.cpp-style static layer mapping (the paper's llama.cpp baseline, VI-A3).

The fast tier holds whole layers (placement "layers": the first MoE layers that fit, see
policies/placement.py); an expert computes on the fast lane iff it is cached, otherwise on the
slow lane; nothing crosses the link and the placement never changes (`admits` False).

Shared experts (negative ids, always `cached`) belong to their layer: they compute on the fast
lane only when every routed expert of the call is cached (a GPU layer), else on the slow lane
with the rest of the layer. Without a slow domain every miss is moved for this call only.

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready); with a slow domain nothing crosses the link.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_base import ExpertWork, LayerScheduler, Plan, by_load, timeline


class LlamaCppScheduler(LayerScheduler):
    name = "llamacpp"
    admits = False
    placement = "layers"
    cache_policy = "lfu"  # Table I; never consulted while admits is False

    def plan(self, work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
        gpu_layer = all(w.cached for w in work if w.key.expert >= 0)
        on_gpu = [i for i, w in enumerate(work) if w.cached and (w.key.expert >= 0 or gpu_layer)]
        gset = set(on_gpu)
        on_cpu = [i for i in range(len(work)) if i not in gset]
        return timeline(work, ready, by_load(work, on_gpu, True), (), by_load(work, on_cpu, False))
