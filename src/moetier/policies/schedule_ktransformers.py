"""kTransformers-style static mapping (the paper's main baseline, VI-A3).

HybriMoE describes it as "mapping high-activation-frequency experts (e.g., shared experts) to the GPU"
(VI-A3) and, in its Table I, as using CPU computation at **decode** only ("KTrans | Expert | Decode |
x | LFU"). kTransformers' own injection tutorial (doc/en/injection_tutorial.md) gives its experts a
`prefill_device: "cuda"` / `prefill_op: "KExpertsTorch"` beside `generate_device: "cpu"` /
`generate_op: "KExpertsCPU"`, used "when layer-wise prefilling is enabled".

Decode: the fast tier holds a fixed placement of high-frequency experts (shared experts are always
there: they are `cached`). Each layer call computes the cached experts on the fast lane (high
load first) and every uncached expert on the slow lane (low load first); nothing crosses the
link and the placement never changes (`admits` False).
Prefill (`prefill_on_gpu`, applied by the caller, sim/run.py): every expert computes on the GPU; the
routed uncached ones are streamed over the link for that call only (heaviest first, never admitted:
schedule_base.moved_timeline).
Simplifications: kTransformers' layer-wise prefill loads a layer's whole expert set; we move only the
routed uncached experts (at 512 tokens nearly every expert is routed; at 32 tokens this flatters the
baseline). kTransformers' shipped Qwen2-57B rule closes layer-wise prefill
(`per_layer_prefill_intput_threshold: 0`), which would put prefill misses on the CPU; we follow the
HybriMoE paper's own description of its baseline (Table I) and note that its Table III prefill figure
(1.47 s for 512 tokens of Qwen2-57B-A14B) needs more than 3 TFLOP/s of CPU otherwise (docs/hybrid.md).
Without a slow domain (a CPU-only machine) a miss has nowhere else to go: it is moved for this call
only (schedule_base.moved_timeline).

Invariants: those of schedule_base.Scheduler (tests/policies/test_schedulers.py); the schedule is a
pure function of (work, ready); with a slow domain nothing crosses the link.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetier.policies.schedule_base import ExpertWork, LayerScheduler, Plan, by_load, timeline


def split_timeline(work: Sequence[ExpertWork], ready: tuple[float, float, float]) -> Plan:
    """Cached experts on the fast lane (high load first), uncached on the slow lane (low load first)."""
    hits = by_load(work, [i for i, w in enumerate(work) if w.cached], descending=True)
    misses = by_load(work, [i for i, w in enumerate(work) if not w.cached], descending=False)
    return timeline(work, ready, hits, (), misses)


class KTransformersScheduler(LayerScheduler):
    name = "ktransformers"
    admits = False
    placement = "frequency"
    cache_policy = "lfu"  # Table I; never consulted while admits is False
    prefill_on_gpu = True  # Table I: CPU computation at decode only

    plan = staticmethod(split_timeline)
