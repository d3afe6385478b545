"""The discrete-event simulator: a machine model on simpy that replays routing traces through
the same policies/ code as the engine (cache, prefetch, schedule).

Invariants: no torch and no store/runtime imports; a run is a pure function of (spec, profile,
calls, SimConfig), its randomness seeded by SimConfig.seed.
"""

from moetier.sim.config import SimConfig, SimResult
from moetier.sim.machine import MachineShape, TimelineOp
from moetier.sim.run import simulate

__all__ = ["MachineShape", "SimConfig", "SimResult", "TimelineOp", "simulate"]
