"""AdapMoE with its adaptive gating: a labelled variant of HybriMoE's AdapMoE baseline, not the default.

HybriMoE describes its AdapMoE baseline as "minimizing on-demand loading overhead through adaptive prefetching
and caching" (VI-A3; Table I: LRU cache, no CPU computation), which is `adapmoe` (policies/schedule_adapmoe.py).
AdapMoE's own paper (arXiv 2408.10284) adds "a sensitivity-based strategy to adjust the number of activated
experts dynamically", reporting "reducing the average number of activated experts by 25%". That gating drops
routed experts, so it changes the model's output (AdapMoE measures the accuracy cost; a trace replay cannot),
and HybriMoE's text does not describe it: this variant is reported beside the default, never instead of it.

It is `adapmoe` plus `gates = True`: the caller (sim/run.py) applies schedule_adapmoe.gated_counts to every
decode call with one threshold fitted by schedule_adapmoe.fit_gate_threshold on the warm-up window to drop
SimConfig.gate_drop (default 25%) of the routed experts; the per-layer DP cache is sized on the gated warm-up.
The engine refuses it (runtime/wire.py: a gating scheduler changes the model's output).

Invariants: those of AdapMoEScheduler; `gates` is True and nothing else differs.
"""

from __future__ import annotations

from moetier.policies.schedule_adapmoe import AdapMoEScheduler


class AdapMoEGatedScheduler(AdapMoEScheduler):
    name = "adapmoe-gated"
    gates = True  # the caller applies gated_counts to decode calls (AdapMoE's adaptive gating)


__all__ = ["AdapMoEGatedScheduler"]
