"""The TriMoE ablation's first point (paper 5.4, Fig. 8), "gpu-ndp": TriMoE's pipeline restricted to the GPU and
the DIMM-NDP units. The two-phase schedule of schedule_trimoe over {GPU, NDP}, with refinement, hot prefetch,
relayout and cold rebalancing (each of which the simulator's settings may turn off).

Invariants: those of schedule_tri_base.TriScheduler; nothing runs on the CPU.
"""

from __future__ import annotations

from moetier.policies.schedule_trimoe import TriMoEScheduler
from moetier.types import Domain


class GpuNdpScheduler(TriMoEScheduler):
    name = "gpu-ndp"
    domains = frozenset((Domain.ACCEL, Domain.NDP))


__all__ = ["GpuNdpScheduler"]
