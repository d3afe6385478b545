"""What one simulation run is asked (`SimConfig`) and what it reports (`SimResult`).

Invariants: SimConfig is frozen and validated on construction (bad values raise ConfigError
naming the field; the field names are the sweep's "simulate" point parameters); SimResult.as_dict() is
JSON-serialisable and holds at least ttft_s, tbt_s, throughput_tok_s, moe_layer_s, hit_rate, utilization
(per domain / link), link_bytes and prefetch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError
from moetier.policies.cache_alloc import CACHE_ALLOCS
from moetier.policies.schedulers import check_scheduler
from moetier.sim.machine import TimelineOp
from moetier.sim.predict import DEFAULT_ACCURACY, PREDICTORS, check_accuracy


@dataclass(frozen=True)
class SimConfig:
    scheduler: str = "hybrimoe"
    cache_policy: str | None = None  # None: the scheduler's default (policies.schedulers)
    cache_ratio: float = 0.25  # fraction of all routed experts (all MoE layers) the fast tier holds
    prefetch: bool = False
    prefetch_depth: int = 3  # MoE layers ahead (<= 3, HybriMoE IV-C)
    predictor: str = "history"  # what predicts the next layers' experts (sim/predict.py): "history" (a predictor
    # learning online from the routing replayed so far, policies/route_history.py) or "oracle" (the trace's true
    # future degraded to prefetch_accuracy)
    prefetch_accuracy: tuple[float, ...] = DEFAULT_ACCURACY  # "oracle" only: kept per distance 1..depth
    cache_alloc: str | None = None  # how the fast tier's slots are split (policies/cache_alloc.py): "dp" (one cache
    # per MoE layer, sized by AdapMoE's DP on the calibration window: the warm-up) or "global" (one cache for all
    # layers); None: the scheduler's own (`cache_alloc`: "dp" for adapmoe, "global" for the others)
    gate_drop: float = 0.25  # schedulers that gate (adapmoe-gated): fraction of routed experts adaptive gating drops at
    # decode, by a weight threshold fitted on the warm-up window (AdapMoE reports 25% fewer activated experts)
    prefetch_max: int | None = None  # experts chosen per decision; None: top_k per predicted layer
    fill: bool = False  # decode misses not moved by the schedule are fetched in the background (link, prefetch
    # priority) and admitted by the cache policy: a dynamic cache for schedulers that never move
    batch_size: int | None = None  # None: from the trace (rows of a decode call)
    prompt_len: int | None = None  # None: from the trace (rows of the step-0 call / batch); 0: no prefill
    steps: int | None = None  # decode steps to simulate; None: all in the trace (after the warm-up)
    warmup_steps: int = 0  # the trace's first decode steps that are a warm-up window, not replayed: the static
    # placements and every initial cache are built from their counts; 0: from the replayed calls (an oracle)
    prefill_admit: bool = False  # False: experts moved during the prefill go through a staging buffer (used for
    # that call only, never admitted); True: admitted into the cache like decode moves (see sim/run.py)
    seed: int = 0  # prediction noise
    precision: str = "full"
    timeline_steps: tuple[int, int] = (1, 2)  # [first, last) trace steps drawn in the timeline
    timeline_layers: tuple[int, int] = (0, 4)  # [first, last) decoder layers drawn

    def __post_init__(self) -> None:
        check_scheduler(self.scheduler)
        if not (_number(self.cache_ratio) and math.isfinite(self.cache_ratio) and 0.0 <= self.cache_ratio <= 1.0):
            raise ConfigError(f"cache_ratio must be in [0, 1], got {self.cache_ratio!r}")
        for name in ("prefetch", "fill", "prefill_admit"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _int(self.prefetch_depth) or self.prefetch_depth < 1:
            raise ConfigError(f"prefetch_depth must be an integer >= 1, got {self.prefetch_depth!r}")
        if self.predictor not in PREDICTORS:
            raise ConfigError(f"predictor must be one of {', '.join(PREDICTORS)}, got {self.predictor!r}")
        check_accuracy(tuple(self.prefetch_accuracy), self.prefetch_depth if self.prefetch else 0)
        if self.cache_alloc is not None and self.cache_alloc not in CACHE_ALLOCS:
            raise ConfigError(f"cache_alloc must be one of {', '.join(CACHE_ALLOCS)}, got {self.cache_alloc!r}")
        if not (_number(self.gate_drop) and 0.0 <= self.gate_drop < 1.0):
            raise ConfigError(f"gate_drop must be in [0, 1), got {self.gate_drop!r}")
        object.__setattr__(self, "prefetch_accuracy", tuple(float(a) for a in self.prefetch_accuracy))
        for name in ("batch_size", "steps", "prefetch_max"):
            v = getattr(self, name)
            if v is not None and (not _int(v) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not _int(self.warmup_steps) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.prompt_len is not None and (not _int(self.prompt_len) or self.prompt_len < 0):
            raise ConfigError(f"prompt_len must be an integer >= 0, got {self.prompt_len!r}")
        if not _int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        for name in ("timeline_steps", "timeline_layers"):
            a, b = getattr(self, name)
            if not 0 <= a <= b:
                raise ConfigError(f"{name} must be a range [first, last) with 0 <= first <= last, got {(a, b)}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler, "cache_policy": self.cache_policy, "cache_ratio": self.cache_ratio,
            "prefetch": self.prefetch, "prefetch_depth": self.prefetch_depth,
            "predictor": self.predictor, "prefetch_accuracy": list(self.prefetch_accuracy),
            "prefetch_max": self.prefetch_max, "cache_alloc": self.cache_alloc, "gate_drop": self.gate_drop,
            "fill": self.fill, "batch_size": self.batch_size, "prompt_len": self.prompt_len, "steps": self.steps,
            "warmup_steps": self.warmup_steps, "prefill_admit": self.prefill_admit, "seed": self.seed,
            "precision": self.precision,
        }  # fmt: skip


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class SimResult:
    spec: str
    profile: str
    config: SimConfig  # as run: cache_policy, batch_size, prompt_len, steps resolved
    ttft_s: float  # prefill (step 0) wall time; 0 without a prefill
    tbt_s: float  # mean decode step time
    throughput_tok_s: float  # batch / tbt
    moe_layer_s: float  # mean decode time of one MoE layer's expert work (schedule replay, no dense part)
    prefill_moe_layer_s: float
    hit_rate: float  # fast-tier hits / routed expert accesses, all calls
    decode_hit_rate: float
    accesses: int
    hits: int
    total_s: float
    utilization: dict[str, float]  # lane (gpu / cpu / pcie / disk) -> busy / total_s
    busy_s: dict[str, float]
    link_bytes: dict[str, int]  # link -> bytes moved (demand + prefetch)
    moves: dict[str, int]  # "demand" / "prefetch" -> experts moved
    prefetch: Any  # policies.prefetch.PrefetchStats
    cache_slots: int
    evictions: int
    machine: dict[str, str | None]  # fast / slow / link
    gating: dict[str, float] = field(default_factory=dict)  # adaptive gating: threshold, routed, dropped(_frac)
    layer_slots: dict[int, int] = field(default_factory=dict)  # cache_alloc "dp": MoE layer -> its cache's slots
    timeline: tuple[TimelineOp, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec, "profile": self.profile, **self.config.as_dict(),
            "ttft_s": self.ttft_s, "tbt_s": self.tbt_s, "throughput_tok_s": self.throughput_tok_s,
            "moe_layer_s": self.moe_layer_s, "prefill_moe_layer_s": self.prefill_moe_layer_s,
            "hit_rate": self.hit_rate, "decode_hit_rate": self.decode_hit_rate, "accesses": self.accesses,
            "hits": self.hits, "total_s": self.total_s, "utilization": dict(self.utilization),
            "busy_s": dict(self.busy_s), "link_bytes": dict(self.link_bytes), "moves": dict(self.moves),
            "prefetch": {**self.prefetch.as_dict(), "enabled": self.config.prefetch},
            "cache_slots": self.cache_slots, "evictions": self.evictions, "machine": dict(self.machine),
            "gating": dict(self.gating), "layer_slots": {str(k): v for k, v in self.layer_slots.items()},
        }  # fmt: skip
