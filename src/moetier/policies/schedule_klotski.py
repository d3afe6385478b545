"""Klotski-style GPU-only baseline (TriMoE paper 5.1), "klotski": every routed expert computes on the GPU.
Resident (HBM) experts are hits; every other routed expert streams over PCIe while the GPU computes,
pipelined across experts, so the GPU's time is max(sum of compute, sum over misses of max(T_PCIe, T_DRAM))
instead of eq. 5's sum of eq. 2 costs; the CPU and DIMM totals keep eq. 5-7 (contention of the host reads).
Hot experts are prefetched into HBM in the background.

Invariants: those of schedule_tri_base.TriScheduler; every expert on the GPU; greedy = totals, no moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from moetier.policies.schedule_tri_base import TriExpert, TriOutcome, domain_totals, tri_plan
from moetier.types import Domain


class KlotskiScheduler:
    name = "klotski"
    domains = frozenset((Domain.ACCEL,))
    prefetches = True
    relayouts = False
    rebalances = False
    refines = False

    def schedule(self, experts: Sequence[TriExpert], n_dimms: int, hot: frozenset[int], max_iters: int) -> TriOutcome:
        doms = [Domain.ACCEL] * len(experts)
        t = domain_totals(experts, doms, n_dimms)
        calc = sum(e.gpu_calc_s for e in experts)
        stream = sum(max(e.pcie_s, e.dram_s) for e in experts if not e.resident)
        gpu = max(calc, stream)
        t = replace(t, gpu_s=gpu, makespan=max(gpu, t.cpu_s, max(t.dimm_s, default=0.0)))
        return TriOutcome(tri_plan(experts, doms, t.makespan), t, t, 0)


__all__ = ["KlotskiScheduler"]
