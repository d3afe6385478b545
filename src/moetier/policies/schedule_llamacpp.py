"""llama.cpp-style static layer mapping (the paper's llama.cpp baseline, VI-A3).

HybriMoE VI-A3: llama.cpp "statically maps model layers to CPU or GPU"; VI-B1: it "allocates entire
layers of experts to the CPU". The fast tier holds whole layers (placement "layers",
policies/placement.by_layers): the LAST MoE layers that fit, as llama.cpp's `-ngl N` / `n_gpu_layers`
does (src/llama-model.cpp: `i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)`, layers il >= i_gpu_start
on the GPU; the +1 is the output layer, which the simulator prices as dense work). An expert computes
on the fast lane iff it is cached, otherwise on the slow lane; nothing crosses the link and the
placement never changes (`admits` False).

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
