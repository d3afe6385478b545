"""The scheduler registries: name -> class, one file per variant.

Two-domain (GPU + CPU, schedule_base.Scheduler; the engine and moetier.sim), `SCHEDULERS`:
- hybrimoe: HybriMoE's hybrid CPU-GPU schedule (paper IV-B), admits moved experts, MRS cache;
- ktransformers: static mapping, cached (incl. shared) on the GPU, misses on the CPU;
- llamacpp: static layer mapping, whole layers on the GPU (placement "layers");
- gpu-lru: GPU only, every miss moved on demand, LRU cache (mixtral-offloading style);
- adapmoe: AdapMoE as HybriMoE describes it ("adaptive prefetching and caching"): gpu-lru's schedule, its per-layer
  DP cache sizes and, with prefetch, its distance-1 prefetch; no gating (every routed expert computes);
- adapmoe-gated: the labelled variant: adapmoe plus AdapMoE's adaptive gating at decode (declared `gates`);
- fiddler: a miss computes on the CPU when that beats moving it, static placement.

Three-domain (GPU + AMX CPU + DIMM-NDP, schedule_tri_base.TriScheduler; moetier.sim.tri), `TRI_SCHEDULERS`:
- klotski: GPU only, misses streamed over PCIe under compute;
- ktransformers-plus: GPU + CPU, hot misses loaded on demand, the rest on the CPU;
- ktransformers-plus-split: the same with the best GPU/CPU split per call (a labelled upper bound);
- monde: GPU + NDP, every expert localised, hot ones to the GPU, the rest computed on NDP;
- gpu-ndp: TriMoE's pipeline restricted to GPU + NDP (the ablation's first point);
- trimoe: all three domains, refinement, relayout and rebalancing.

Invariants: each entry's key is its class's `name`; `check_scheduler` / `check_tri_scheduler` are the one check
of a name (ConfigError naming the known schedulers of that kind), `make_*` return a fresh instance.
"""

from __future__ import annotations

from collections.abc import Callable

from moetier.errors import ConfigError
from moetier.policies.schedule_adapmoe import AdapMoEScheduler
from moetier.policies.schedule_adapmoe_gated import AdapMoEGatedScheduler
from moetier.policies.schedule_base import Scheduler
from moetier.policies.schedule_fiddler import FiddlerScheduler
from moetier.policies.schedule_gpu_lru import GpuLruScheduler
from moetier.policies.schedule_gpu_ndp import GpuNdpScheduler
from moetier.policies.schedule_hybrimoe import HybriMoEScheduler
from moetier.policies.schedule_klotski import KlotskiScheduler
from moetier.policies.schedule_ktransformers import KTransformersScheduler
from moetier.policies.schedule_ktransformers_plus import KTransformersPlusScheduler
from moetier.policies.schedule_ktransformers_split import KTransformersSplitScheduler
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
    "adapmoe": AdapMoEScheduler,
    "adapmoe-gated": AdapMoEGatedScheduler,
}
# The prefetch each two-domain system runs as its paper describes it, in MoE layers ahead (absent: none): HybriMoE
# IV-C predicts "expert activations for the next three layers"; AdapMoE prefetches the next layer's experts
# ("adaptive prefetching and caching", HybriMoE VI-A3). `moetier simulate` turns it on when neither --prefetch nor
# --no-prefetch is given, so that naming a system (or none: hybrimoe) runs it as its paper does.
SYSTEM_PREFETCH_DEPTH: dict[str, int] = {"hybrimoe": 3, "adapmoe": 1, "adapmoe-gated": 1}
TRI_SCHEDULERS: dict[str, Callable[[], TriScheduler]] = {
    "klotski": KlotskiScheduler,
    "ktransformers-plus": KTransformersPlusScheduler,
    "ktransformers-plus-split": KTransformersSplitScheduler,
    "monde": MondeScheduler,
    "gpu-ndp": GpuNdpScheduler,
    "trimoe": TriMoEScheduler,
}


def check_scheduler(name: str) -> None:
    """ConfigError unless `name` is a two-domain scheduler: a three-domain one is named as such (it runs in
    `moetier simulate-tri`), any other name gets the known ones."""
    if name in TRI_SCHEDULERS:
        raise ConfigError(
            f"{name!r} is a three-domain (GPU + AMX CPU + DIMM-NDP) scheduler: run "
            f"`moetier simulate-tri --scheduler {name}`; two-domain: {', '.join(SCHEDULERS)}"
        )
    if name not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")


def check_tri_scheduler(name: str) -> None:
    """ConfigError naming the known three-domain schedulers unless `name` is one."""
    if name not in TRI_SCHEDULERS:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(TRI_SCHEDULERS)}")


def make_scheduler(name: str) -> Scheduler:
    """A fresh two-domain scheduler by name (check_scheduler's ConfigError otherwise)."""
    check_scheduler(name)
    return SCHEDULERS[name]()


def make_tri_scheduler(name: str) -> TriScheduler:
    """A fresh three-domain scheduler by name (check_tri_scheduler's ConfigError otherwise)."""
    check_tri_scheduler(name)
    return TRI_SCHEDULERS[name]()


__all__ = [
    "SCHEDULERS", "SYSTEM_PREFETCH_DEPTH", "TRI_SCHEDULERS",
    "check_scheduler", "check_tri_scheduler", "make_scheduler", "make_tri_scheduler",
]
