"""The scheduler registry: name -> class, one file per variant (see schedule_base.Scheduler).

- hybrimoe: HybriMoE's hybrid CPU-GPU schedule (paper IV-B), admits moved experts, MRS cache;
- ktransformers: static mapping, cached (incl. shared) on the GPU, misses on the CPU;
- llamacpp: static layer mapping, whole layers on the GPU (placement "layers");
- gpu-lru: GPU only, every miss moved on demand, LRU cache (mixtral-offloading, AdapMoE);
- fiddler: a miss computes on the CPU when that beats moving it, static placement.

Invariants: each entry's key is its class's `name`; `make_scheduler` returns a fresh instance, or
raises ConfigError naming the known schedulers.
"""

from __future__ import annotations

from collections.abc import Callable

from moetier.errors import ConfigError
from moetier.policies.schedule_base import Scheduler
from moetier.policies.schedule_fiddler import FiddlerScheduler
from moetier.policies.schedule_gpu_lru import GpuLruScheduler
from moetier.policies.schedule_hybrimoe import HybriMoEScheduler
from moetier.policies.schedule_ktransformers import KTransformersScheduler
from moetier.policies.schedule_llamacpp import LlamaCppScheduler

SCHEDULERS: dict[str, Callable[[], Scheduler]] = {
    "hybrimoe": HybriMoEScheduler,
    "ktransformers": KTransformersScheduler,
    "llamacpp": LlamaCppScheduler,
    "gpu-lru": GpuLruScheduler,
    "fiddler": FiddlerScheduler,
}


def make_scheduler(name: str) -> Scheduler:
    """A scheduler by name; ConfigError naming the known ones otherwise."""
    try:
        return SCHEDULERS[name]()
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}") from None
