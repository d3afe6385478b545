"""Cross-layer expert prefetch and router-score feeding in the engine (HybriMoE IV-C, IV-D).

Wiring (`wire`, called once by the Engine):
- score-aware caching: when the store's policy uses router scores (MRS), every TieredMoE
  call hands its router probabilities (softmax or sigmoid per family.scoring, summed over
  the call's tokens, a list of E floats) to `store.on_route` before its expert accesses;
- prefetch (PrefetchConfig.enabled): after MoE layer l routes, `Prefetcher.__call__`
  1. scores the predictions made earlier for layer l against its actual routing;
  2. applies the routers of the next `depth` MoE layers to layer l's MoE input x (the
     hidden states of consecutive layers are similar through the residual) and takes
     top-k per token -> predicted tokens per expert per future layer;
  3. prices them with the cost model (fast = the compute domain; link = disk on a CPU
     machine, PCIe on a GPU one; cached = resident or in flight) and lets
     policies.prefetch.choose_prefetch pick by simulated makespan impact, within the link
     time the next layers give (minus the loads still queued);
  4. hands the choice to `store.prefetch`, protecting this call's experts and every
     predicted expert already resident; the store loads them in the background.

Invariants: prediction never changes the forward's results (routers are pure functions of
x; their outputs are discarded); the forward never waits for a prefetch it does not use;
statistics: predicted/correct per (layer call, expert) pair, overall (union over distances)
and per distance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moetier.config import EngineConfig, PrefetchConfig
from moetier.errors import ConfigError
from moetier.policies.costmodel import (
    PROFILES_DIR,
    ComputeProfile,
    CostModel,
    HardwareProfile,
    LinkProfile,
    token_counts,
)
from moetier.policies.costmodel import load_profile as _load_profile
from moetier.policies.prefetch import PrefetchStats, choose_prefetch
from moetier.policies.schedule_base import Scheduler
from moetier.policies.schedulers import make_scheduler
from moetier.specs import ModelSpec, load_spec
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey

if TYPE_CHECKING:
    from moetier.runtime.loader import LoadedModel
    from moetier.runtime.moe_block import TieredMoE

DEFAULT_PROFILE = PROFILES_DIR / "this-machine.json"
PRICING_SCHEDULER = "hybrimoe"  # prices prefetch choices when no --scheduler is given

# Conservative CPU-only machine: ~2 effective cores of bf16 matmul, one DDR channel, a SATA-class SSD.
BUILTIN_CPU = HardwareProfile(
    name="builtin-cpu", source="moetier built-in conservative CPU profile (no measurement)",
    cpu=ComputeProfile(peak_flops=50e9, mem_bw=8e9, overhead_s=30e-6, layer_overhead_s=100e-6),
    gpu=None, pcie=None, disk=LinkProfile(bandwidth=500e6, latency_s=100e-6),
    cpu_threads=2, host_mem_bytes=8 << 30, gpu_mem_bytes=None,
)  # fmt: skip


def load_profile(name: str | None) -> HardwareProfile:
    """--profile NAME|PATH; None: profiles/this-machine.json when present, else BUILTIN_CPU."""
    if name:
        return _load_profile(name)
    return _load_profile(DEFAULT_PROFILE) if DEFAULT_PROFILE.is_file() else BUILTIN_CPU


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
    cost = CostModel(profile, engine_spec(loaded), precision)
    scheduler = make_scheduler(config.scheduler.name or PRICING_SCHEDULER)
    return Pricing(cost, scheduler, "gpu" if gpu else "cpu", "cpu" if gpu and hybrid else None,
                   "pcie" if gpu else "disk")  # fmt: skip


def router_probs(logits: torch.Tensor, scoring: str) -> np.ndarray:
    """logits [T, E] -> router probabilities summed over tokens, float64 [E] (what the policies compute in)."""
    x = logits.float()
    probs = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)  # [T, E]
    return probs.sum(0).cpu().double().numpy()


class Prefetcher:
    def __init__(self, blocks: Sequence[TieredMoE], store: ExpertStore, pricing: Pricing, cfg: PrefetchConfig) -> None:
        self.blocks, self.store, self.pricing, self.cfg = list(blocks), store, pricing, cfg
        self.position = {b.layer: i for i, b in enumerate(self.blocks)}
        self.stats = PrefetchStats()
        self.by_distance = {d: PrefetchStats() for d in range(1, cfg.depth + 1)}
        self._pending: dict[int, dict[int, set[ExpertKey]]] = {}  # target layer -> distance -> predicted keys
        self.budget_s = 0.0  # link seconds offered to choose_prefetch, summed
        self.chosen = 0

    def __call__(self, block: TieredMoE, x: torch.Tensor, ids: torch.Tensor) -> None:
        """After `block` routed x [T, H] to ids [T, k]: score, predict, price, choose, issue."""
        layer = block.layer
        here_counts = token_counts(ids.tolist())  # expert -> tokens of this call
        actual = {ExpertKey(layer, e) for e in here_counts}
        # 1. score earlier predictions for this layer
        made = self._pending.pop(layer, None)
        if made:
            self.stats.record_prediction(set().union(*made.values()), actual)
            for d, keys in made.items():
                self.by_distance[d].record_prediction(keys, actual)
        # 2. predict the next `depth` MoE layers from this layer's input
        i = self.position[layer]
        ahead = self.blocks[i + 1 : i + 1 + self.cfg.depth]
        if not ahead:
            return
        counts: dict[int, dict[int, int]] = {}
        with torch.inference_mode():
            for d, nxt in enumerate(ahead, start=1):
                _, _, pred = getattr(nxt, nxt.router_name)(x)  # [T, k] top-k of layer l+d's router
                c = counts[nxt.layer] = token_counts(pred.tolist())
                self._pending.setdefault(nxt.layer, {})[d] = {ExpertKey(nxt.layer, e) for e in c}
        # 3. price with the current residency (in-flight counts as cached) and choose
        p = self.pricing
        cached = self.store.cached_keys()
        here = p.cost.work(layer, here_counts, cached, p.fast, p.slow, p.link)
        tokens = int(x.shape[0])
        layer_s = p.scheduler.schedule(here).makespan + p.cost.dense_s(p.fast, tokens, 0)
        backlog = len(self.store.inflight()) * p.cost.move_s(p.link, p.cost.expert_nbytes)
        budget = max(0.0, len(ahead) * layer_s - backlog)
        self.budget_s += budget
        if budget <= 0:
            return
        future = {lay: p.cost.work(lay, c, cached, p.fast, p.slow, p.link) for lay, c in counts.items()}
        chosen = choose_prefetch(future, p.scheduler, budget, self.cfg.max_experts)
        if not chosen:
            return
        # 4. issue; never evict what this call or the predicted window still needs
        protect = actual | {k for lay, c in counts.items() for k in (ExpertKey(lay, e) for e in c) if k in cached}
        issued = self.store.prefetch(chosen, protect)
        self.chosen += len(chosen)
        self.stats.issued += len(issued)

    def summary(self) -> dict[str, Any]:
        """PrefetchStats (accuracy, issued, used) plus the store's outcome counters and per-distance accuracy."""
        st = self.store.prefetch_stats()
        self.stats.used = st["used"]
        out: dict[str, Any] = dict(self.stats.as_dict())
        out.update({k: st[k] for k in ("wasted", "failed", "inflight", "waits", "wait_s", "errors")})
        out["depth"] = self.cfg.depth
        out["link_budget_s"] = self.budget_s
        out["by_distance"] = {d: s.as_dict() for d, s in self.by_distance.items()}
        return out


def wire(loaded: LoadedModel, config: EngineConfig) -> Prefetcher | None:
    """Attach score feeding and (if enabled) the prefetcher to the model's TieredMoE blocks."""
    store = loaded.store
    if config.prefetch.enabled and not isinstance(store, ExpertStore):
        raise ConfigError("prefetch needs a static precision (full, int8, int4, int2); dynamic keeps every expert "
                          "resident already")  # fmt: skip
    if isinstance(store, ExpertStore) and store.wants_scores:
        scoring = loaded.family.scoring

        def feed(layer: int, logits: torch.Tensor) -> None:
            store.on_route(layer, router_probs(logits, scoring))

        for block in loaded.blocks:
            block.on_logits = feed
    if not config.prefetch.enabled:
        return None
    assert isinstance(store, ExpertStore)
    pricing = make_pricing(loaded, config, store.precision.value, hybrid=config.scheduler.name is not None)
    prefetcher = Prefetcher(loaded.blocks, store, pricing, config.prefetch)
    for block in loaded.blocks:
        block.after_route = prefetcher
    return prefetcher
