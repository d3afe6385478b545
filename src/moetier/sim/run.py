"""Replay a routing trace on a simulated machine through the same policies the engine uses.

`simulate(spec, profile, calls, config)` runs, per step (step 0 = the prefill chunk when there
is a prompt; then one decode step per trace step) and per decoder layer:
1. the layer's non-expert work (CostModel.dense_s) on the fast domain;
2. for an MoE layer: the cache policy hears the call's router scores (on_route); the routed
   experts are looked up in the fast tier (hit = resident, or arriving by a prefetch already on
   the link); the call is priced (CostModel.work) and scheduled (scheduler.schedule with the
   link's ready time, busy with earlier prefetches); prefetches for the next MoE layers of the
   step are chosen (policies.prefetch.choose_prefetch) and queued behind the demand moves; the
   schedule is replayed on the machine (sim/machine.py); moved experts are admitted into the
   cache when the scheduler admits (victims never among the call's own experts).
Prefetched experts are admitted on arrival.
The fast tier is one global cache, or with config.cache_alloc "dp" (the default of a scheduler declaring
`cache_alloc = "dp"`: adapmoe, adapmoe-gated) one cache per MoE layer (sim/residency.LayerCaches), sized by AdapMoE's DP
(policies/cache_alloc.py) on each layer's LRU misses over the warm-up window (gated, for a gating scheduler:
adapmoe-gated; the default adapmoe computes every routed expert).
Warm-up (config.warmup_steps = W > 0): the trace's first W decode steps are not replayed; their
per-expert token counts build the scheduler's initial placement (static mappings) and every
initial cache, so no placement sees the calls it is timed on. W = 0 builds them from the replayed
calls themselves (an oracle placement; kept for short hand-made traces).
Prefill staging (config.prefill_admit False, the default): experts moved during the prefill
chunk, by the schedule or by a prefetch, sit in a staging buffer for the call they were moved for
and are dropped after it, never admitted: a prefill routes to nearly every expert of every layer,
and admitting those moves would evict the experts later layers of the same chunk and the decode
need (the engine's store stages its moves the same way). benchmarks/hybrid_sim.py --staging
measures both; /work/study5.md has the evidence.

Invariants: hits + misses = accesses (distinct routed experts per call); link bytes = experts
moved x bytes per expert; the result is deterministic for a given config (seeded prediction).
Machines: GPU (fast gpu, slow cpu, link pcie, every expert in host DRAM) or CPU-only (fast cpu,
no slow domain, link disk; the cache is the host tier). A GPU machine whose host memory cannot
hold every expert is refused (the SSD behind the host tier is not modelled there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from moetier.errors import ConfigError, TraceError
from moetier.policies import make_cache_policy
from moetier.policies.cache_alloc import allocate_slots, lru_miss_curve
from moetier.policies.costmodel import CostModel, HardwareProfile
from moetier.policies.prefetch import PrefetchStats, choose_prefetch
from moetier.policies.route_history import RouteHistoryPredictor
from moetier.policies.schedule_adapmoe import fit_gate_threshold, gated_counts
from moetier.policies.schedule_base import ExpertWork, Scheduler, lane_ready, moved_timeline
from moetier.policies.schedulers import make_scheduler
from moetier.sim.cache_replay import call_scores
from moetier.sim.config import SimConfig, SimResult
from moetier.sim.initial import default_cache_policy, initial_keys
from moetier.sim.machine import Machine, MachineShape, PrefetchItem, SimGen
from moetier.sim.predict import degrade
from moetier.sim.price import Pricer
from moetier.sim.residency import FastCache, LayerCaches
from moetier.specs import ModelSpec
from moetier.traces import Call
from moetier.types import ExpertKey, Lane


class _Prepared:
    """The calls to replay, grouped per step, with per-call token counts and router scores."""

    def __init__(self, spec: ModelSpec, calls: Sequence[Call], config: SimConfig) -> None:
        moe = spec.moe_layers
        by_step: dict[int, dict[int, Call]] = {}
        for c in calls:
            if c.layer not in moe:
                raise TraceError(f"trace call at step {c.step} is for layer {c.layer}, not an MoE layer of "
                                 f"spec {spec.name!r} (MoE layers {list(moe)[:4]}...)")  # fmt: skip
            if c.ids.size and (int(c.ids.max()) >= spec.num_experts or int(c.ids.min()) < 0):
                raise TraceError(f"trace step {c.step} layer {c.layer}: expert ids outside [0, {spec.num_experts})")
            if c.layer in by_step.setdefault(c.step, {}):
                raise TraceError(f"trace has two calls of layer {c.layer} at step {c.step}")
            by_step[c.step][c.layer] = c
        if not by_step:
            raise TraceError("trace has no layer calls")
        for s, layers in by_step.items():
            missing = [x for x in moe if x not in layers]
            if missing:
                raise TraceError(f"trace step {s} lacks MoE layer(s) {missing[:4]}; every step needs all "
                                 f"{len(moe)} MoE layers of {spec.name!r}")  # fmt: skip
        steps = sorted(by_step)
        first_rows = int(by_step[steps[0]][moe[0]].ids.shape[0])
        decode_rows = int(by_step[steps[1]][moe[0]].ids.shape[0]) if len(steps) > 1 else None
        # 1. batch and prompt length: from the config, else the trace's shapes
        batch = config.batch_size or decode_rows or first_rows
        prompt = config.prompt_len
        if prompt is None:
            prompt = first_rows // batch if (decode_rows is not None and first_rows > decode_rows) else 0
        has_prefill = prompt > 0
        decode_steps = steps[1:] if has_prefill else steps
        w = config.warmup_steps
        if w >= len(decode_steps) and w > 0:
            raise TraceError(f"trace has {len(decode_steps)} decode step(s), the warm-up alone takes {w}")
        self.warmup = [by_step[s] for s in decode_steps[:w]]  # per warm-up step: layer -> Call
        decode_steps = decode_steps[w:]
        want = len(decode_steps) if config.steps is None else config.steps
        if want > len(decode_steps):
            raise TraceError(f"trace has {len(decode_steps)} decode step(s) after a warm-up of {w}, {want} asked for")
        self.steps = ([steps[0]] if has_prefill else []) + decode_steps[:want]
        self.has_prefill, self.batch, self.prompt = has_prefill, batch, prompt
        self.by_step = by_step
        self.config = replace(config, batch_size=batch, prompt_len=prompt, steps=want)

    def counts(self, c: Call) -> dict[int, int]:
        ids = np.asarray(c.ids).ravel()  # [T*k]
        bc = np.bincount(ids, minlength=1)  # [<=E]
        nz = np.flatnonzero(bc)
        return dict(zip(nz.tolist(), bc[nz].tolist(), strict=True))


def default_cache_alloc(scheduler: Scheduler) -> str:
    """The allocation a scheduler declares (`cache_alloc`: "dp" for adapmoe), else one global cache."""
    return scheduler.cache_alloc


class _Replay:
    """One run's state: machine, cache, scheduler, prediction, counters."""

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, prep: _Prepared) -> None:
        cfg = prep.config
        self.spec, self.prep, self.cfg = spec, prep, cfg
        self.shape = MachineShape.from_profile(profile)
        if self.shape.fast == "gpu" and spec.total_expert_bytes > profile.host_mem_bytes:
            raise ConfigError(f"{spec.name} needs {spec.total_expert_bytes / 2**30:.1f} GiB of experts, more than "
                              f"profile {profile.name!r}'s host memory ({profile.host_mem_bytes / 2**30:.1f} GiB); "
                              "the SSD tier behind host memory is not modelled on GPU machines")  # fmt: skip
        self.cm = CostModel(profile, spec, cfg.precision)
        self.price = Pricer(self.cm, self.shape.fast, self.shape.slow, self.shape.link)
        self.scheduler: Scheduler = make_scheduler(cfg.scheduler)
        policy_name = cfg.cache_policy or default_cache_policy(self.scheduler)
        if policy_name == "belady":
            raise ConfigError("cache policy 'belady' needs exact demand paging; use it with `moetier replay`")
        alloc = cfg.cache_alloc or default_cache_alloc(self.scheduler)
        if alloc == "dp" and not self.scheduler.admits:
            raise ConfigError(f"cache_alloc 'dp' sizes per-layer dynamic caches; scheduler {cfg.scheduler!r} keeps "
                              "a static placement (it admits nothing), so only 'global' applies")  # fmt: skip
        self.cfg = cfg = replace(cfg, cache_policy=policy_name, cache_alloc=alloc)
        slots = round(cfg.cache_ratio * len(spec.moe_layers) * spec.num_experts)
        ts, tl = cfg.timeline_steps, cfg.timeline_layers
        self.m = Machine(self.shape, lambda s, layer: ts[0] <= s < ts[1] and tl[0] <= layer < tl[1])
        self.rng = np.random.default_rng(cfg.seed)
        self.stats = PrefetchStats()
        self.predicted: dict[int, dict[int, set[ExpertKey]]] = {}  # call index -> distance -> prediction for it
        self.used_inflight: set[ExpertKey] = set()
        self.pf_pins: dict[int, list[ExpertKey]] = {}  # call index -> prefetched experts pinned until it ran
        self.call_index = -1
        self.accesses = self.hits = self.dec_accesses = self.dec_hits = 0
        self.step_s: list[float] = []
        self.moe_s: list[tuple[bool, float]] = []  # (decode?, seconds)
        self.layer_period = 0.0  # EMA of the time between MoE layer starts
        self._last_start: float | None = None
        # the ordered MoE calls, for prediction: (step, layer) per call index
        self.order = [(s, layer) for s in prep.steps for layer in spec.moe_layers]
        self.has_scores = all(c.scores is not None for c in prep.by_step[prep.steps[0]].values())
        self.calls = [prep.by_step[s][layer] for s, layer in self.order]
        self.counts = [prep.counts(c) for c in self.calls]  # per call index: {expert: tokens}
        self.scores = np.asarray([call_scores(c, spec.num_experts) for c in self.calls])  # [calls, E] summed
        seen = [(c.layer, prep.counts(c)) for step in prep.warmup for c in step.values()] if prep.warmup else [
            (c.layer, n) for c, n in zip(self.calls, self.counts, strict=True)]  # fmt: skip
        self.n_prefill = len(spec.moe_layers) if prep.has_prefill else 0  # call indices < this are the prefill
        # the history predictor learns from the warm-up window first (the routing seen before the replay)
        self.hist: RouteHistoryPredictor | None = None
        if cfg.prefetch and cfg.predictor == "history":
            self.hist = RouteHistoryPredictor(spec.moe_layers, spec.num_experts, spec.top_k, cfg.prefetch_depth)
            for step in prep.warmup:
                for layer in spec.moe_layers:
                    self.hist.feed(layer, step[layer].ids)
        # adaptive gating (schedulers that declare `gates`): decode calls lose their low-weight experts
        self.gating: dict[str, float] = {}
        fit_calls = [c for step in prep.warmup for c in step.values()] or self.calls[self.n_prefill :]
        thr: float | None = None
        if self.scheduler.gates:
            thr = fit_gate_threshold([c.weights for c in fit_calls], cfg.gate_drop)
            routed = dropped = 0
            for i in range(self.n_prefill, len(self.calls)):
                c = self.calls[i]
                g = gated_counts(c.ids, c.weights, thr)
                n = int(np.asarray(c.ids).size)
                routed += n
                dropped += n - sum(g.values())
                self.counts[i] = g
            self.gating = {"threshold": thr, "routed": routed, "dropped": dropped,
                           "dropped_frac": dropped / routed if routed else 0.0}  # fmt: skip
        # the fast tier: one global cache, or one per MoE layer sized by the DP on the calibration window
        self.layer_slots: dict[int, int] = {}
        self.cache: FastCache | LayerCaches
        if alloc == "dp":
            order = initial_keys(self.scheduler, spec, len(spec.moe_layers) * spec.num_experts, seen)
            self.layer_slots = self._layer_allocation(slots, fit_calls, thr, order)
            self.cache = LayerCaches(self.layer_slots, lambda: make_cache_policy(policy_name, top_k=spec.top_k))
            self.cache.warm(order)
        else:
            self.cache = FastCache(slots, make_cache_policy(policy_name, top_k=spec.top_k))
            self.cache.warm(initial_keys(self.scheduler, spec, slots, seen))
        first = profile.cpu.first_expert_s if self.shape.slow == "cpu" else 0.0
        self.cpu_ready = float(first)  # HybriMoE Fig. 3e: the first CPU expert of a call pays this once
        self.staged: dict[ExpertKey, int] = {}  # prefill prefetches in the staging buffer -> call index

    def _layer_allocation(
        self, slots: int, calls: Sequence[Call], threshold: float | None, order: Sequence[ExpertKey]
    ) -> dict[int, int]:
        """AdapMoE's per-layer cache sizes: each MoE layer's LRU miss curve (policies/cache_alloc.py) over the
        calibration `calls` (gated with `threshold` when the scheduler gates), its cache warmed in `order`; the
        DP splits `slots` among the layers."""
        moe = self.spec.moe_layers
        seq: dict[int, list[list[int]]] = {layer: [] for layer in moe}
        for c in calls:
            n = gated_counts(c.ids, c.weights, threshold) if threshold is not None else self.prep.counts(c)
            seq[c.layer].append(sorted(n, key=lambda e: (-n[e], e)))  # the heaviest expert the most recent
        warm: dict[int, list[int]] = {layer: [] for layer in moe}
        for k in order:
            warm[k.layer].append(k.expert)
        curves = [lru_miss_curve(seq[layer], self.spec.num_experts, warm[layer]) for layer in moe]
        return dict(zip(moe, allocate_slots(curves, slots), strict=True))

    # 1. The forward pass -----------------------------------------------------------------------------------------
    def forward(self) -> SimGen:
        spec, prep, m, fast = self.spec, self.prep, self.m, self.shape.fast
        moe = set(spec.moe_layers)
        idx = 0
        for n, step in enumerate(prep.steps):
            t0 = m.now
            prefill = prep.has_prefill and n == 0
            new = prep.prompt if prefill else 1
            ctx = prep.prompt if prefill else prep.prompt + (n if prep.has_prefill else n + 1)
            # dense_s prices one sequence; a batch of sequences is `batch` such calls
            d_moe = prep.batch * self.cm.dense_s(fast, new, ctx, moe=True)
            d_plain = prep.batch * self.cm.dense_s(fast, new, ctx, moe=False) if len(moe) < spec.num_layers else 0.0
            for layer in range(spec.num_layers):
                m.step, m.layer = step, layer
                yield from m.compute(fast, d_moe if layer in moe else d_plain, "dense", f"L{layer}")
                if layer in moe:
                    self.call_index = idx
                    yield from self._moe(idx, self.calls[idx], decode=not prefill)
                    idx += 1
            # the LM head of each sequence's last position, and the engine's fixed per-forward cost
            yield from m.compute(fast, prep.batch * self.cm.head_s(fast, 1), "dense", "head")
            self.step_s.append(m.now - t0)

    def _moe(self, idx: int, call: Call, decode: bool) -> SimGen:
        m, cache = self.m, self.cache
        layer = call.layer
        start = m.now
        if self._last_start is not None:
            self.layer_period = (
                0.8 * self.layer_period + 0.2 * (start - self._last_start)
                if self.layer_period
                else start - self._last_start
            )
        self._last_start = start
        # 1. route: scores to the policy, then the accesses
        counts = self.counts[idx]
        cache.on_route(layer, self.scores[idx])
        keys = [ExpertKey(layer, e) for e in counts]
        preds = self.predicted.pop(idx, None)
        if preds:
            for d, pred in preds.items():
                self.stats.record_distance(d, pred, keys)
            self.stats.record_prediction(preds[min(preds)], keys)
        if self.hist is not None:
            self.hist.feed(layer, call.ids)
        staged = {k for k in keys if self.staged.get(k) == idx}
        self.stats.used += len(staged)
        hitset = {k for k in keys if cache.access(k)} | staged
        inflight = {k for k in keys if k in m.pending} - hitset  # prefetches still on the link: misses,
        self.used_inflight |= inflight  # but used, and a demand move of one waits for it instead
        self.accesses += len(keys)
        self.hits += len(hitset)
        if decode:
            self.dec_accesses += len(keys)
            self.dec_hits += len(hitset)
        cache.pin(keys)
        # 2. price and schedule
        work = self.price.work(layer, counts, hitset, shared_tokens=int(call.ids.shape[0]))
        ready: dict[Lane, float] = {"gpu": 0.0, "cpu": self.cpu_ready, "link": m.link_ready()}
        if not decode and self.scheduler.prefill_on_gpu:  # kTransformers: prefill experts on the GPU, misses streamed
            sched = moved_timeline(work, lane_ready(ready))
        else:
            sched = self.scheduler.schedule(work, ready)
        nbytes = {w.key: w.nbytes for w in work}
        # 3. replay; prefetches are queued right after the demand moves
        took = yield from m.replay(sched, nbytes, then=lambda: self._prefetch(idx, work), inflight=inflight)
        self.moe_s.append((decode, took))
        # 4. admit what the schedule moved (during the prefill only with prefill_admit; else staged, dropped)
        if self.staged:
            self.staged = {k: c for k, c in self.staged.items() if c > idx}
        if self.scheduler.admits and (decode or self.cfg.prefill_admit):
            for k in sched.moved:
                if k.expert >= 0:
                    cache.admit(k)
        cache.unpin(keys)
        cache.unpin(self.pf_pins.pop(idx, []))
        if self.cfg.fill and decode and cache.capacity:  # inter-iteration caching: not during the prefill
            moved = set(sched.moved)
            miss = [w for w in work if w.key.expert >= 0 and w.key not in hitset and w.key not in moved
                    and w.key not in cache]  # fmt: skip
            if miss:
                m.prefetch([PrefetchItem(w.key, w.move_s, w.nbytes, len(self.order), fill=True) for w in miss],
                           self._valid, self._arrived)  # fmt: skip

    # 2. Prefetch -------------------------------------------------------------------------------------------------
    def _prefetch(self, idx: int, work: Sequence[ExpertWork]) -> None:
        cfg, spec = self.cfg, self.spec
        if not cfg.prefetch or self.cache.capacity == 0:
            return
        step = self.order[idx][0]
        layers: dict[int, list[ExpertWork]] = {}
        target: dict[int, int] = {}  # layer -> call index
        known = self.cache.resident | set(self.m.pending) | set(self.staged)
        for d in range(1, cfg.prefetch_depth + 1):
            j = idx + d
            if j >= len(self.order) or self.order[j][0] != step:
                break  # predictions do not cross into the next token
            call = self.calls[j]
            if self.hist is not None:
                pred = self.hist.predict_counts(self.order[idx][1], d)
            else:
                pred = degrade(
                    self.counts[j],
                    cfg.prefetch_accuracy[d - 1],
                    spec.num_experts,
                    self.rng,
                    self.scores[j] if self.has_scores else None,
                )
            self.predicted.setdefault(j, {})[d] = {ExpertKey(call.layer, e) for e in pred}
            layers[call.layer] = self.price.work(call.layer, pred, known, shared_tokens=int(call.ids.shape[0]))
            target[call.layer] = j
        if not any(not w.cached and w.key.expert >= 0 for ws in layers.values() for w in ws):
            return  # nothing predicted is missing: no choice to make
        period = self.layer_period or sum(w.fast_s for w in work)
        budget = max(0.0, period * len(layers) - self.m.link_ready())
        max_n = cfg.prefetch_max or spec.top_k * len(layers)
        chosen = choose_prefetch(layers, self.scheduler, budget, max_n)
        if not chosen:
            return
        cost = {w.key: w for ws in layers.values() for w in ws}
        items = [PrefetchItem(k, cost[k].move_s, cost[k].nbytes, target[k.layer]) for k in chosen]
        self.m.prefetch(items, self._valid, self._arrived)

    def _valid(self, item: PrefetchItem) -> bool:
        return item.key not in self.cache and item.key not in self.staged and self.call_index < item.call

    def _arrived(self, item: PrefetchItem) -> None:
        if item.fill:
            self.cache.admit(item.key)
            return
        self.stats.issued += 1
        if item.call < self.n_prefill and not self.cfg.prefill_admit:  # staged for its prefill call
            if item.key in self.used_inflight:
                self.used_inflight.discard(item.key)
                self.stats.used += 1
            elif item.call > self.call_index:
                self.staged[item.key] = item.call
            return
        placed = self.cache.admit(item.key, prefetched=True)
        if placed and item.call > self.call_index:
            self.cache.pin([item.key])
            self.pf_pins.setdefault(item.call, []).append(item.key)
        if item.key in self.used_inflight:
            self.used_inflight.discard(item.key)
            if placed:
                self.cache.access(item.key)
            else:
                self.stats.used += 1

    # 3. Result ---------------------------------------------------------------------------------------------------
    def result(self, profile: HardwareProfile) -> SimResult:
        m, prep = self.m, self.prep
        total = m.now
        self.stats.used += self.cache.used_prefetches
        dec = self.step_s[1:] if prep.has_prefill else self.step_s
        tbt = float(np.mean(dec)) if dec else 0.0
        dmoe = [t for d, t in self.moe_s if d]
        pmoe = [t for d, t in self.moe_s if not d]
        return SimResult(
            spec=self.spec.name, profile=profile.name, config=self.cfg,
            ttft_s=self.step_s[0] if prep.has_prefill else 0.0, tbt_s=tbt,
            throughput_tok_s=prep.batch / tbt if tbt > 0 else 0.0,
            moe_layer_s=float(np.mean(dmoe)) if dmoe else 0.0,
            prefill_moe_layer_s=float(np.mean(pmoe)) if pmoe else 0.0,
            hit_rate=self.hits / self.accesses if self.accesses else 0.0,
            decode_hit_rate=self.dec_hits / self.dec_accesses if self.dec_accesses else 0.0,
            accesses=self.accesses, hits=self.hits, total_s=total,
            utilization={k: (v / total if total > 0 else 0.0) for k, v in m.busy.items()},
            busy_s=dict(m.busy), link_bytes={self.shape.link: m.link_bytes}, moves=dict(m.moves),
            prefetch=self.stats, cache_slots=self.cache.capacity, evictions=self.cache.evictions,
            layer_slots=dict(self.layer_slots),
            machine={"fast": self.shape.fast, "slow": self.shape.slow, "link": self.shape.link},
            gating=dict(self.gating),
            timeline=tuple(m.ops),
        )  # fmt: skip


def simulate(spec: ModelSpec, profile: HardwareProfile, calls: Sequence[Call], config: SimConfig) -> SimResult:
    """Replay `calls` (traces.iter_calls) of `spec` on `profile` under `config`."""
    prep = _Prepared(spec, calls, config)
    run = _Replay(spec, profile, prep)
    proc = run.m.env.process(run.forward())
    run.m.env.run(until=proc)
    return run.result(profile)
