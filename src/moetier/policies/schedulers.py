"""The scheduler registries: name -> class, one file per variant.

Two-domain (GPU + CPU, schedule_base.Scheduler; the engine and moetier.sim), `SCHEDULERS`:
- hybrimoe: HybriMoE's hybrid CPU-GPU schedule (paper IV-B), admits moved experts, MRS cache;
- ktransformers: static mapping, cached (incl. shared) on the GPU, misses on the CPU;
- llamacpp: static layer mapping, whole layers on the GPU (placement "layers");
- gpu-lru: GPU only, every miss moved on demand, LRU cache (mixtral-offloading, AdapMoE);
- fiddler: a miss computes on the CPU when that beats moving it, static placement.

Three-domain (GPU + AMX CPU + DIMM-NDP, schedule_tri_base.TriScheduler; moetier.sim.tri), `TRI_SCHEDULERS`:
- klotski: GPU only, misses streamed over PCIe under compute;
- ktransformers-plus: GPU + CPU, hot misses loaded on demand, the rest on the CPU;
- monde: GPU + NDP, the greedy start of TriMoE's schedule;
- gpu-ndp: TriMoE's pipeline restricted to GPU + NDP (the ablation's first point);
- trimoe: all three domains, refinement, relayout and rebalancing.

Invariants: each entry's key is its class's `name`; `make_scheduler` / `make_tri_scheduler` return a fresh
instance, or raise ConfigError naming the known schedulers of that kind.
"""

from __future__ import annotations

from collections.abc import Callable

from moetier.errors import ConfigError
from moetier.policies.schedule_base import Scheduler
from moetier.policies.schedule_fiddler import FiddlerScheduler
from moetier.policies.schedule_gpu_lru import GpuLruScheduler
from moetier.policies.schedule_gpu_ndp import GpuNdpScheduler
from moetier.policies.schedule_hybrimoe import HybriMoEScheduler
from moetier.policies.schedule_klotski import KlotskiScheduler
from moetier.policies.schedule_ktransformers import KTransformersScheduler
from moetier.policies.schedule_ktransformers_plus import KTransformersPlusScheduler
from moetier.policies.schedule_llamacpp import LlamaCppScheduler
from moetier.policies.schedule_monde import MondeScheduler
from moetier.policies.schedule_tri_base import TriScheduler
from moetier.policies.schedule_trimoe import TriMoEScheduler

SCHEDULERS: dict[str, Callable[[], Scheduler]] = {
    "hybrimoe": HybriMoEScheduler,
    "ktransformers": KTransformersScheduler,
    "llamacpp": LlamaCppScheduler,
    "gpu-lru": GpuLruScheduler,
    "fiddler": FiddlerScheduler,
}
TRI_SCHEDULERS: dict[str, Callable[[], TriScheduler]] = {
    "klotski": KlotskiScheduler,
    "ktransformers-plus": KTransformersPlusScheduler,
    "monde": MondeScheduler,
    "gpu-ndp": GpuNdpScheduler,
    "trimoe": TriMoEScheduler,
}


def make_scheduler(name: str) -> Scheduler:
    """A scheduler by name; ConfigError naming the known ones otherwise."""
    try:
        return SCHEDULERS[name]()
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}") from None


def make_tri_scheduler(name: str) -> TriScheduler:
    """A three-domain scheduler by name; ConfigError naming the known ones otherwise."""
    try:
        return TRI_SCHEDULERS[name]()
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(TRI_SCHEDULERS)}") from None


__all__ = ["SCHEDULERS", "TRI_SCHEDULERS", "make_scheduler", "make_tri_scheduler"]
