"""The discrete-event simulator: a machine model on simpy that replays routing traces through
the same policies/ code as the engine (cache, prefetch, schedule). No torch, no store/runtime."""

from moetier.sim.config import SimConfig, SimResult
from moetier.sim.machine import MachineShape, TimelineOp
from moetier.sim.run import simulate

__all__ = ["MachineShape", "SimConfig", "SimResult", "TimelineOp", "simulate"]
