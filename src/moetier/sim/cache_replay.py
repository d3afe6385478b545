"""Cache-only replay of a routing trace: the hit rate a cache policy would get, no timing.

One global cache holds `slots = floor(cache_ratio * total_experts)` experts (at least 1), where
total_experts counts the routed experts of all MoE layers (the paper's "GPU expert cache ratio").
With `per_layer=True` each MoE layer has its own cache of `floor(cache_ratio * E)` slots (at least 1)
and its own policy instance (equal slots per layer, as mixtral-offloading's per-layer LRU); the layers'
caches never compete, so each layer's calls are replayed on their own and `slots` reports the sum.
A cache starts empty. Per layer call, in trace order:

1. the policy sees the call's router scores summed over its tokens (`on_route`; a trace without
   scores falls back to the top-k gate weights scattered into an [E] vector, and the result says
   `scores="weights"`);
2. each unique expert of the call is accessed once, the resident ones first (a layer computes
   its cached experts while the others load), each group in ascending id order: a hit calls
   `on_access`; a miss evicts, when the cache is full, the policy's victim among the residents
   that are not experts of this call (if the call alone needs more experts than the cache
   holds, among all residents but the one being fetched), then inserts the expert.

A policy that admits (declares `transient_slots` and `admit`, policies/cache_base.py; mrs-admit) is replayed as
the engine's store runs it (store/tier.py): min(transient_slots, slots // 4) of the slots are transient (none
when every expert fits), the call's unique experts are taken in groups of that many in ascending id (the
executors' pin groups, ExpertStore.pin_groups: contiguous, each with at most that many experts not cached when
the call starts), each group's residents first; a miss goes to a free cached slot while there is one, else the
policy's victim among the cached residents outside the call is evicted for it if `admit(key, victim)`, else (or
with no such resident) it is computed from a transient slot and not cached (`bypasses`).

`batched_calls` merges a batch-1 stream into B sequences decoding together (the serving pattern of
runtime/batch.py): B cursors spread evenly over the stream's decode steps, one call per step and layer holding
the B tokens' rows.

An access is one unique expert of one layer call. Decode counts cover calls with step > 0
(step 0 is the prefill chunk in engine traces). Belady gets the whole access sequence up front
(per call in ascending id order; it only consumes each key's positions in order, so the
hits-first reordering inside a call does not disturb it).

Invariants: hits + misses == accesses, per layer and overall; resident experts never exceed
the slots (of the layer's cache in per-layer mode); the victim is always a resident outside the current
call (checked). Pure numpy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetier.errors import ConfigError, TraceError
from moetier.policies import CACHE_POLICIES, make_cache_policy
from moetier.policies.cache_base import admission_groups
from moetier.traces import Call, Trace, iter_calls
from moetier.types import ExpertKey

ALL_POLICIES = ("lru", "lfu", "mrs", "belady")


@dataclass(frozen=True)
class LayerHits:
    layer: int
    accesses: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    cache_ratio: float
    slots: int
    total_experts: int
    scores: str  # "router" (the trace's scores) | "weights" (fallback: top-k gate weights)
    calls: int
    accesses: int
    hits: int
    evictions: int
    decode_accesses: int
    decode_hits: int
    layers: tuple[LayerHits, ...]
    options: tuple[tuple[str, Any], ...] = ()
    seconds: float = 0.0
    per_layer: bool = False  # one cache per layer (slots = their sum) instead of one global cache
    bypasses: int = 0  # misses computed from a transient slot and not cached (admitting policies)

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def decode_hit_rate(self) -> float:
        return self.decode_hits / self.decode_accesses if self.decode_accesses else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "cache_ratio": self.cache_ratio, "slots": self.slots,
            "total_experts": self.total_experts, "scores": self.scores, "calls": self.calls,
            "accesses": self.accesses, "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
            "hit_rate": self.hit_rate, "decode_accesses": self.decode_accesses, "decode_hits": self.decode_hits,
            "decode_hit_rate": self.decode_hit_rate,
            "per_layer": {str(h.layer): {"accesses": h.accesses, "hits": h.hits, "hit_rate": h.hit_rate}
                          for h in self.layers},
            "options": dict(self.options), "replay_s": self.seconds, "per_layer_caches": self.per_layer,
            "bypasses": self.bypasses,
        }  # fmt: skip


def slots_for(cache_ratio: float, total_experts: int) -> int:
    """Cache slots for a ratio in (0, 1] of `total_experts` (floor, at least 1)."""
    if not (isinstance(cache_ratio, (int, float)) and math.isfinite(cache_ratio) and 0.0 < cache_ratio <= 1.0):
        raise ConfigError(f"cache ratio must lie in (0, 1], got {cache_ratio}")
    if total_experts < 1:
        raise ConfigError(f"total experts must be >= 1, got {total_experts}")
    return max(1, math.floor(cache_ratio * total_experts + 1e-9))


def parse_policies(spec: str) -> list[str]:
    """'lru', 'lru,mrs' or 'all' -> policy names, each checked against the registry."""
    names = list(ALL_POLICIES) if spec.strip() == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise ConfigError("no cache policy given")
    unknown = [n for n in names if n not in CACHE_POLICIES]
    if unknown:
        raise ConfigError(f"unknown cache policy {unknown[0]!r}; known: {', '.join(sorted(CACHE_POLICIES))}, all")
    return list(dict.fromkeys(names))


def _call_experts(calls: Sequence[Call], num_experts: int) -> list[list[int]]:
    """Unique experts of each call, ascending; ids checked against [0, E)."""
    out = []
    for call in calls:
        ids = np.asarray(call.ids)  # [T, k]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise TraceError(f"step {call.step} layer {call.layer}: expert id out of range [0, {num_experts})")
        out.append(sorted(set(ids[0].tolist())) if ids.shape[0] == 1 else np.unique(ids).tolist())  # [k] one token
    return out


def call_scores(call: Call, num_experts: int) -> np.ndarray:
    """Router scores of one call summed over its tokens [E]; fallback: gate weights scattered."""
    if call.scores is not None:
        s = np.asarray(call.scores, dtype=np.float64)  # [T, E]
        if s.ndim != 2 or s.shape[1] != num_experts:
            raise TraceError(f"step {call.step} layer {call.layer}: scores {s.shape}, expected [T, {num_experts}]")
        return s[0] if s.shape[0] == 1 else s.sum(axis=0)  # [E]
    ids = np.asarray(call.ids).ravel()  # [T*k]
    w = np.asarray(call.weights, dtype=np.float64).ravel()  # [T*k]
    return np.bincount(ids, weights=w, minlength=num_experts).astype(np.float64)  # [E]


@dataclass
class _Counts:
    """Hit / access counters of one replay (per layer and decode-only)."""

    acc: dict[int, int]
    hit: dict[int, int]
    dec_acc: int = 0
    dec_hit: int = 0
    evictions: int = 0
    bypasses: int = 0
    options: dict[str, Any] | None = None


def _run(
    calls: Sequence[Call],
    call_keys: Sequence[list[ExpertKey]],
    policy: str,
    slots: int,
    num_experts: int,
    top_k: int | None,
    counts: _Counts,
    knobs: dict[str, Any],
) -> None:
    """Replay `calls` (their unique keys in `call_keys`) through one fresh policy and one cache of `slots`."""
    future: list[Hashable] = [key for keys in call_keys for key in keys]
    pol = make_cache_policy(policy, top_k=top_k, future=future, **knobs)  # only Belady takes the future
    transient = getattr(pol, "transient_slots", 0)
    total = len({key.layer for keys in call_keys for key in keys}) * num_experts
    if transient and slots < total and slots // 4 > 0:
        _run_admitting(calls, call_keys, pol, slots, min(int(transient), slots // 4), num_experts, counts)
        counts.options = dict(getattr(pol, "options", knobs))
        return
    resident: set[ExpertKey] = set()
    for call, keys in zip(calls, call_keys, strict=True):
        layer = int(call.layer)
        pol.on_route(layer, call_scores(call, num_experts))
        in_call = set(keys)
        n_hit = 0
        for key in [k for k in keys if k in resident] + [k for k in keys if k not in resident]:  # hits first
            if key in resident:
                n_hit += 1
                pol.on_access(key)
                continue
            if len(resident) >= slots:
                cands = resident - in_call or resident - {key}
                victim = pol.victim(cands)
                if victim not in cands:
                    raise AssertionError(f"policy {policy!r} chose {victim!r}, not a candidate")
                resident.discard(victim)
                pol.on_evict(victim)
                counts.evictions += 1
            resident.add(key)
            pol.on_insert(key)
        counts.acc[layer] += len(keys)
        counts.hit[layer] += n_hit
        if call.step > 0:
            counts.dec_acc += len(keys)
            counts.dec_hit += n_hit
    counts.options = dict(getattr(pol, "options", knobs))  # the knobs in effect, defaults included (MRS)


def _run_admitting(
    calls: Sequence[Call],
    call_keys: Sequence[list[ExpertKey]],
    pol: Any,
    slots: int,
    transient: int,
    num_experts: int,
    counts: _Counts,
) -> None:
    """`_run` for an admitting policy: `slots - transient` cached slots, groups of `transient` (module doc)."""
    cached: set[ExpertKey] = set()
    for call, keys in zip(calls, call_keys, strict=True):
        layer = int(call.layer)
        pol.on_route(layer, call_scores(call, num_experts))
        n_hit = 0
        in_call = set(keys)
        groups: list[list[ExpertKey]] = []
        at = 0  # ExpertStore.pin_groups' rule (the pool is never the limit here: a call fits the slots)
        for size in admission_groups((key not in cached for key in keys), transient, len(keys) + 1):
            groups.append(keys[at : at + size])
            at += size
        for group in groups:
            held: list[ExpertKey] = []  # bypassed: in a transient slot until the group is computed
            for key in [k for k in group if k in cached] + [k for k in group if k not in cached]:
                if key in cached:
                    n_hit += 1
                    pol.on_access(key)
                    continue
                pol.on_insert(key)  # written to a transient slot (or a free one) first, as the store does
                if len(cached) < slots - transient:
                    cached.add(key)
                    continue
                cands = cached - in_call
                victim = pol.victim(cands) if cands else None
                if victim is not None and victim not in cands:
                    raise AssertionError(f"policy chose {victim!r}, not a candidate")
                if victim is not None and pol.admit(key, victim):
                    cached.discard(victim)
                    pol.on_evict(victim)
                    counts.evictions += 1
                    cached.add(key)
                else:
                    held.append(key)
                    counts.bypasses += 1
            for key in held:
                pol.on_evict(key)
        counts.acc[layer] += len(keys)
        counts.hit[layer] += n_hit
        if call.step > 0:
            counts.dec_acc += len(keys)
            counts.dec_hit += n_hit


def batched_calls(calls: Sequence[Call], batch: int, steps: int | None = None) -> list[Call]:
    """B sequences decoding together from one batch-1 stream: `batch` cursors spread evenly over its decode steps
    (step > 0 with one row per layer call), advancing one step per merged step (wrapping at the end); per merged
    step and layer one call of the B rows (ids, weights, scores concatenated). `steps` merged steps (default: as
    many as the stream has). TraceError for a stream with a call of more than one row after step 0."""
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    by_step: dict[int, dict[int, Call]] = {}
    for call in calls:
        if call.step > 0:
            if np.asarray(call.ids).shape[0] != 1:
                raise TraceError(f"step {call.step} layer {call.layer}: batched_calls needs a batch-1 stream")
            by_step.setdefault(int(call.step), {})[int(call.layer)] = call
    layers = sorted({layer for per in by_step.values() for layer in per})
    stream = [by_step[s] for s in sorted(by_step) if len(by_step[s]) == len(layers)]
    if not stream:
        raise TraceError("the trace holds no complete decode step")
    n = len(stream)
    out = []
    for s in range(n if steps is None else steps):
        for layer in layers:
            rows = [stream[(b * n // batch + s) % n][layer] for b in range(batch)]
            scores = None if any(r.scores is None for r in rows) else np.concatenate([r.scores for r in rows])
            out.append(Call(s + 1, layer, np.concatenate([r.ids for r in rows]),
                            np.concatenate([r.weights for r in rows]), scores))  # fmt: skip
    return out


def replay(
    calls: Sequence[Call],
    policy: str,
    cache_ratio: float,
    num_experts: int,
    top_k: int | None = None,
    layers: Sequence[int] | None = None,
    per_layer: bool = False,
    **knobs: Any,
) -> ReplayResult:
    """Replay `calls` (traces.iter_calls) through a fresh `policy` with a cache of `cache_ratio` of all
    experts (`per_layer`: one cache of `cache_ratio` of E per layer); `layers` are the MoE layers (default:
    those in the calls); `knobs` go to the policy (MRS: alpha, top_p, normalize)."""
    t0 = time.perf_counter()
    # 1. size the cache(s)
    layer_ids = sorted({int(c.layer) for c in calls}) if layers is None else sorted({int(x) for x in layers})
    missing = sorted({int(c.layer) for c in calls} - set(layer_ids))
    if missing:
        raise TraceError(f"trace calls layer(s) {missing[:4]} outside the MoE layers {layer_ids[:8]}")
    if num_experts < 1:
        raise TraceError(f"num_experts must be >= 1, got {num_experts}")
    total = num_experts * max(1, len(layer_ids))
    slots = slots_for(cache_ratio, total)
    if policy not in CACHE_POLICIES:
        raise ConfigError(f"unknown cache policy {policy!r}; known: {', '.join(sorted(CACHE_POLICIES))}")
    # 2. the access sequence (Belady's future): unique experts per call
    call_keys = [[ExpertKey(int(c.layer), e) for e in ex] for c, ex in zip(calls, _call_experts(calls, num_experts),
                                                                          strict=True)]  # fmt: skip
    counts = _Counts(dict.fromkeys(layer_ids, 0), dict.fromkeys(layer_ids, 0))
    # 3. replay: one global cache, or one cache per layer (independent, so replayed layer by layer)
    if per_layer:
        per = slots_for(cache_ratio, num_experts)
        slots = per * max(1, len(layer_ids))
        for layer in layer_ids:
            idx = [i for i, c in enumerate(calls) if int(c.layer) == layer]
            _run([calls[i] for i in idx], [call_keys[i] for i in idx], policy, per, num_experts, top_k, counts, knobs)
    else:
        _run(calls, call_keys, policy, slots, num_experts, top_k, counts, knobs)
    options = counts.options if counts.options is not None else dict(knobs)  # no layer replayed: knobs as given
    return ReplayResult(
        policy=policy, cache_ratio=float(cache_ratio), slots=slots, total_experts=total,
        scores="router" if all(c.scores is not None for c in calls) else "weights", calls=len(calls),
        accesses=sum(counts.acc.values()), hits=sum(counts.hit.values()), evictions=counts.evictions,
        decode_accesses=counts.dec_acc, decode_hits=counts.dec_hit,
        layers=tuple(LayerHits(layer, counts.acc[layer], counts.hit[layer]) for layer in layer_ids),
        options=tuple(sorted(options.items())), seconds=time.perf_counter() - t0, per_layer=per_layer,
        bypasses=counts.bypasses,
    )  # fmt: skip


def trace_layers(trace: Trace) -> list[int] | None:
    """The MoE layers named by the trace metadata (engine traces), else None (use the calls')."""
    moe = trace.metadata.get("moe_layers")
    if isinstance(moe, list) and moe and all(isinstance(x, int) for x in moe):
        return [int(x) for x in moe]
    return None


def replay_trace(trace: Trace, policy: str, cache_ratio: float, per_layer: bool = False, **knobs: Any) -> ReplayResult:
    """`replay` with num_experts, top_k and the MoE layers taken from the trace's metadata."""
    calls = iter_calls(trace)
    if not calls:
        raise TraceError("the trace holds no layer calls")
    meta = trace.metadata
    return replay(
        calls, policy, cache_ratio, num_experts=int(meta["num_experts"]), top_k=int(meta["top_k"]),
        layers=trace_layers(trace), per_layer=per_layer, **knobs,
    )  # fmt: skip
