"""Pricing a MoE layer call on this machine: the cost model, the scheduler, the domains and the link.

One `Pricing` per engine, built by runtime/wire.py when prefetch or hybrid execution is on, and
shared by the prefetcher (runtime/prefetch.py, which prices candidate prefetches) and the hybrid
scheduler (runtime/executors/hybrid.py, which schedules each call over two domains).

Invariants: the hardware profile is data (a profile file, yours or shipped, or the conservative
built-in CPU profile when this machine was never measured); a GPU engine refuses a profile without
a GPU; the model is priced at the engine's compute dtype.
"""

from __future__ import annotations

import dataclasses

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.policies.costmodel import ComputeProfile, CostModel, HardwareProfile, LinkProfile
from moetier.policies.costmodel import load_profile as _load_profile
from moetier.policies.hwprofile import find_profile
from moetier.policies.schedule_base import Scheduler
from moetier.policies.schedulers import make_scheduler
from moetier.runtime.loader import LoadedModel
from moetier.specs import ModelSpec, load_spec
from moetier.types import priced_as

DEFAULT_PROFILE = "this-machine"  # yours (`moetier profile`) first, else the shipped one
PRICING_SCHEDULER = "hybrimoe"  # prices prefetch choices when no --scheduler is given

# Conservative CPU-only machine: ~2 effective cores of bf16 matmul, one DDR channel, a SATA-class SSD.
BUILTIN_CPU = HardwareProfile(
    name="builtin-cpu", source="moetier built-in conservative CPU profile (no measurement)",
    cpu=ComputeProfile(peak_flops=50e9, mem_bw=8e9, overhead_s=30e-6, layer_overhead_s=100e-6),
    gpu=None, pcie=None, disk=LinkProfile(bandwidth=500e6, latency_s=100e-6),
    cpu_threads=2, host_mem_bytes=8 << 30, gpu_mem_bytes=None,
)  # fmt: skip


def load_profile(name: str | None) -> HardwareProfile:
    """--profile NAME|PATH; None: the profile named this-machine (your profile folder first, then the
    shipped ones; policies/hwprofile.find_profile) when there is one, else BUILTIN_CPU."""
    if name:
        return _load_profile(name)
    found = find_profile(DEFAULT_PROFILE)
    return _load_profile(found) if found is not None else BUILTIN_CPU


def engine_spec(loaded: LoadedModel) -> ModelSpec:
    """The loaded checkpoint as a ModelSpec, at the engine's compute dtype."""
    info, cfg = loaded.info, loaded.config
    try:
        spec = load_spec(info.path)
    except ConfigError:  # a family specs.py cannot read: routed experts and attention are what we price
        heads = int(cfg.num_attention_heads)
        spec = ModelSpec(
            name=str(info.path), source=str(info.path), num_layers=info.num_layers, moe_layers=info.moe_layers,
            num_experts=info.num_experts, top_k=info.top_k, num_shared=0, hidden=info.hidden_size,
            moe_inter=info.expert_intermediate, shared_inter=0,
            dense_inter=int(getattr(cfg, "intermediate_size", 0) or info.expert_intermediate),
            num_heads=heads, num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or info.hidden_size // heads), vocab=int(cfg.vocab_size),
        )  # fmt: skip
    return dataclasses.replace(spec, dtype_bytes=loaded.dtype.itemsize)


@dataclasses.dataclass(frozen=True)
class Pricing:
    """How the engine prices one layer call's expert work on this machine."""

    cost: CostModel
    scheduler: Scheduler
    fast: str  # "gpu" | "cpu"
    slow: str | None  # "cpu" on a GPU machine, None on a CPU-only one
    link: str  # "pcie" | "disk"


def make_pricing(loaded: LoadedModel, config: EngineConfig, precision: str, hybrid: bool) -> Pricing:
    profile = load_profile(config.scheduler.profile)
    gpu = loaded.device.type == "cuda"
    if gpu and profile.gpu is None:
        raise ConfigError(f"hardware profile {profile.name!r} has no GPU; pass a GPU machine's --profile")
    cost = CostModel(profile, engine_spec(loaded), priced_as(precision))  # a ggml block type: its integer class
    scheduler = make_scheduler(config.scheduler.name or PRICING_SCHEDULER)
    return Pricing(cost, scheduler, "gpu" if gpu else "cpu", "cpu" if gpu and hybrid else None,
                   "pcie" if gpu else "disk")  # fmt: skip
