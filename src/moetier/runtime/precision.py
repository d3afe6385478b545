"""Expert precision in the engine: which store a config gets, and the switching loop of DynaExq.

`build_store` turns EngineConfig.precision into a store:
- full / int8 / int4 / int2: an ExpertStore whose pools hold that precision, read from
  the checkpoint (full) or from the quantized disk tier `moetier quantize` wrote;
- stored: an ExpertStore whose pools hold the checkpoint's own stored bytes (FP8, MXFP4, GPTQ ...),
  dequantised per call (store/source.py StoredSource); usable as hi or lo of dynamic, ordered by slot bytes;
- dynamic: a DynamicStore whose hi and lo pools are sized by `split_budget` (paper 3.5)
  from the compute tier's expert budget, every expert resident at lo to begin with.

`store_capabilities` is what the config's store declares (runtime/wire.py refuses from it
before any pool is allocated).

`Switching` is the control loop (paper 3.2-3.3): a route observer (runtime/observers.py) collects
each MoE layer's routing during a forward; `after_forward` (Engine.step) feeds it to the
PrecisionController, and every `period` tokens enqueues the decided switches, paired by
`order_switches`, on the SwitchPipeline (store/mover.py: up to transient + spare switches in
flight). Once per period, halfway between decisions, with `prefetch` on, the experts the
controller predicts the next decision will promote are staged at the high precision from disk
into the host DRAM cache (store/dram.py) on a background thread. The forward pass never waits for
either (unless `sync`), and always computes with the last registered version of each expert.

Invariants: the controller's plan never has more experts at hi than there are hi slots once its moves
have run (each promotion beyond the free quota is paired with a demotion: the demotion first without a
transient buffer, up to `transient_slots` promotions first with one, landing in its slots); a failed
switch leaves the expert at its registered precision and the controller is told so.
"""

from __future__ import annotations

import os
import queue
from typing import Any

import numpy as np
import torch

from moetier.config import EngineConfig, PrecisionConfig, format_size
from moetier.errors import BudgetError, ConfigError, MoetierError
from moetier.formats.diskio import DiskIO
from moetier.formats.qtier import QuantTier
from moetier.formats.quant import QuantSpec
from moetier.formats.safetensors import ExpertReader
from moetier.kernels import decode
from moetier.kernels.qformat import ExpertFormat
from moetier.policies.memory import MemoryNeeds, MemoryPlan
from moetier.policies.precision import ExpertState, PrecisionController, order_switches, split_budget
from moetier.runtime import memory
from moetier.runtime.observers import Route, Stage
from moetier.store.dynamic import DynamicStore
from moetier.store.mover import Mover, SwitchPipeline
from moetier.store.source import (
    ExpertSource,
    FullSource,
    QuantSource,
    StoredFp8Source,
    StoredIntSource,
    StoredSource,
)
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey, Move, MoveKind, Precision, Tier


def make_source(
    precision: str, reader: ExpertReader, model_dir: str | os.PathLike[str], cfg: PrecisionConfig, dtype: torch.dtype,
    device: torch.device, native: bool = False,
) -> ExpertSource:  # fmt: skip
    """The disk tier of one precision: the checkpoint itself, or its quantized copy (in the native decode
    kernels' slot formats when `native`)."""
    if precision in ("full", "auto"):  # "auto" unresolved (a store built outside runtime/wire.py load): full
        return FullSource(reader, dtype)
    if precision == Precision.STORED.value:
        here = native and device.type == "cpu" and dtype == torch.bfloat16
        fit = StoredIntSource.fits(reader) if here else None
        if fit is not None:  # GPTQ / AWQ / compressed-tensors int4: our int4 slots, the checkpoint's own values
            return StoredIntSource(reader, dtype, device, fit)
        fit8 = StoredFp8Source.fits(reader) if here else None
        if fit8 is not None:  # block-scaled FP8: fp8 slots, the checkpoint's own bytes and scales
            return StoredFp8Source(reader, fit8)
        return StoredSource(reader, dtype, native)
    spec = QuantSpec(Precision(precision), cfg.group(precision) or None)
    tier = QuantTier.open(model_dir, spec.precision, spec.group_size, root=cfg.quant_dir, reader=reader)
    if tier.layout != reader.layout:
        tier.close()
        raise ConfigError(f"quantized {precision} tier layout {tier.layout} does not match the model's {reader.layout}")
    if reader.io is not None:  # read as the checkpoint is (RuntimeConfig.disk_io), with its own bounce buffers
        tier.set_io(DiskIO(direct=reader.io.direct, depth=reader.io.depth))
    return QuantSource(tier, ExpertFormat(reader.layout, tier.spec, dtype, device, native=native))


AUTO_DIRECT_BYTES = 1 << 20  # RuntimeConfig.disk_io "auto": O_DIRECT for experts of at least this many bytes


def build_store(
    reader: ExpertReader, model_dir: str | os.PathLike[str], cfg: EngineConfig, dtype: torch.dtype,
    device: torch.device, reserve: int, top_k: int | None = None, needs: MemoryNeeds | None = None,
) -> tuple[ExpertStore | DynamicStore, MemoryPlan | None]:  # fmt: skip
    """The store the config asks for, and with --memory (`needs`: what the process holds besides experts,
    runtime/memory.py) the plan that sized its host expert budget: the rest of the budget, at least `top_k`
    slots (one token's experts of a layer at once) plus staging, or BudgetError naming the smallest budget."""
    pcfg = cfg.precision
    keys = list(reader.plans)
    # expert reads: O_DIRECT (or buffered), io_depth in flight; its bounce buffers join the sources' staging.
    # "auto": O_DIRECT for experts of at least AUTO_DIRECT_BYTES, buffered for smaller ones (a tiny model's experts:
    # bounce buffers as large as several experts, and a page cache that costs little)
    mode = cfg.runtime.disk_io
    largest = reader.largest_expert_bytes
    direct = mode == "direct" or (mode == "auto" and largest >= AUTO_DIRECT_BYTES)
    io = DiskIO(direct=direct, depth=cfg.runtime.io_depth)
    if mode == "auto" and not direct:
        io.fallback = f"auto: experts of {format_size(largest)}, under {format_size(AUTO_DIRECT_BYTES)}: buffered"
    reader.set_io(io)
    native = decode.formats_available(cfg.runtime.native_kernels, cfg.runtime.kernel_cache, dtype, device)
    plan: MemoryPlan | None = None
    if pcfg.mode != "dynamic":
        source = make_source(pcfg.mode, reader, model_dir, pcfg, dtype, device, native)
        try:
            if needs is not None:
                least = source.slot_bytes * min(max(top_k or 1, 1), len(keys)) + source.staging_bytes
                cfg, plan = memory.fit(cfg, needs, least)
            return ExpertStore(
                source, keys, device, cfg.budgets.host_expert_bytes, cfg.budgets.accel_expert_bytes,
                cfg.cache.policy, reserve=reserve, top_k=top_k,
            ), plan  # fmt: skip
        except BaseException:
            source.close()
            raise
    # dynamic: both pools in the compute tier, sized from its budget
    hi = make_source(pcfg.hi, reader, model_dir, pcfg, dtype, device, native)
    lo = make_source(pcfg.lo, reader, model_dir, pcfg, dtype, device, native)
    try:
        if hi.slot_bytes <= lo.slot_bytes:  # "stored" has no fixed bits: hi above lo is by slot bytes
            raise ConfigError(
                f"dynamic precision needs hi above lo: a {pcfg.hi} expert takes {format_size(hi.slot_bytes)}, "
                f"a {pcfg.lo} one {format_size(lo.slot_bytes)}"
            )
        per_layer: dict[int, int] = {}
        for key in keys:
            per_layer[key.layer] = per_layer.get(key.layer, 0) + 1
        # the transient buffer (spare low + transient high slots) and the staging buffers come off the budget
        staging = (hi.staging_bytes + lo.staging_bytes + pcfg.spare_slots * lo.slot_bytes
                   + pcfg.transient_slots * hi.slot_bytes)  # fmt: skip
        if pcfg.prefetch and not cfg.budgets.host_cache_bytes:
            raise ConfigError("precision prefetch stages experts in the host DRAM cache: set --host-cache-mem")
        all_lo, all_hi = len(keys) * lo.slot_bytes + staging, len(keys) * hi.slot_bytes + staging
        if needs is not None and device.type != "cuda":  # every expert at lo and one at hi, at least
            cfg, plan = memory.fit(cfg, needs, all_lo + max(hi.slot_bytes - lo.slot_bytes, 0))
        budget = cfg.budgets.accel_expert_bytes if device.type == "cuda" else cfg.budgets.host_expert_bytes
        flag = "--gpu-expert-mem" if device.type == "cuda" else "--host-expert-mem"
        if budget is None:
            raise ConfigError(
                f"dynamic precision needs an expert budget ({flag}): between {format_size(all_lo)} "
                f"(every expert {pcfg.lo}) and {format_size(all_hi)} (every expert {pcfg.hi})"
            )
        n_hot = split_budget(per_layer, hi.slot_bytes, lo.slot_bytes, budget, reserve=staging)
        if sum(n_hot.values()) < 1:
            raise BudgetError(
                f"expert budget {format_size(budget)} holds every expert at {pcfg.lo} but no {pcfg.hi} one: "
                f"raise it to at least {format_size(all_lo + hi.slot_bytes - lo.slot_bytes)} "
                f"or use --precision {pcfg.lo}"
            )
        return DynamicStore(
            hi, lo, keys, sum(n_hot.values()), pcfg.spare_slots, device, budget, per_layer=n_hot,
            transient=pcfg.transient_slots, cache_bytes=cfg.budgets.host_cache_bytes,
        ), plan  # fmt: skip
    except BaseException:
        hi.close()
        lo.close()
        raise


def store_capabilities(cfg: EngineConfig) -> frozenset[str]:
    """The capabilities of the store `build_store` gives this config (known before it is built)."""
    return DynamicStore.capabilities if cfg.precision.mode == "dynamic" else ExpertStore.capabilities


class Switching:
    """The precision control loop around one DynamicStore; the route observer of its model's blocks."""

    stage = Stage.RECORD

    def __init__(self, store: DynamicStore, n_hot: dict[int, int], num_experts: int, cfg: PrecisionConfig) -> None:
        self.store, self.cfg = store, cfg
        # every expert resident from the start: the first n_hot of each layer at hi until the
        # first decision (after the warmup) picks the hot ones
        initial = {layer: range(n) for layer, n in n_hot.items()}
        store.preload(ExpertKey(layer, e) for layer, experts in initial.items() for e in experts)
        self.controller = PrecisionController(
            n_hot, num_experts, alpha=cfg.alpha, period=cfg.period, hysteresis=cfg.hysteresis, initial_hot=initial,
            lookahead=cfg.lookahead,
        )  # fmt: skip
        self.hi_slots = sum(n_hot.values())
        self.planned_hi = self.hi_slots  # experts at hi once every queued move has run
        self.mover = SwitchPipeline(
            lambda m: store.begin_switch(m.key, m.precision, timeout=30.0), store.finish_switch,
            workers=cfg.transient_slots + cfg.spare_slots, on_error=lambda move, exc: self._failures.put(move),
        )  # fmt: skip
        # disk -> DRAM staging of predicted promotions, behind the switches (its own thread)
        self.stager = Mover(lambda m: store.stage(m.key), name="moetier-stage") if cfg.prefetch else None
        self._staged_this_period = False
        self.predicted = 0  # experts predicted to be promoted at the next decision (summed over periods)
        self.predicted_hits = 0  # of those, promoted at that decision
        self._last_prediction: set[ExpertKey] = set()
        self._failures: queue.SimpleQueue[Move] = queue.SimpleQueue()  # from the mover thread
        self._seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, ids [T, k], weights [T, k])

    def observe(self, route: Route) -> None:
        """Keep the call's routing for `after_forward`."""
        self._seen.append((route.layer, route.ids, route.weights))

    def discard_forward(self) -> None:
        """A forward that failed (a read error, non-finite logits): forget its routing, so that a retry of the
        same step is not counted twice."""
        self._seen = []

    def after_forward(self, force: bool = False) -> None:
        """Feed this forward's routing to the controller and enqueue what it decides."""
        while not self._failures.empty():
            self._failed(self._failures.get())
        seen, self._seen = self._seen, []
        for layer, ids, weights in seen:
            w = weights.float().cpu().numpy()  # [T, k]
            if not np.isfinite(w).all():
                raise MoetierError(
                    f"layer {layer}: the router gave non-finite expert weights (the activations overflowed); "
                    "expert hotness cannot be updated"
                )
            self.controller.observe(layer, ids.cpu().numpy(), w)
        decision = self.controller.decide(force=force)
        if decision.step >= 0:  # a decision ran: score the last prediction, predict anew halfway
            self.predicted_hits += len(self._last_prediction & set(decision.upgrades))
            self._last_prediction, self._staged_this_period = set(), False
        elif self.stager is not None and not self._staged_this_period:
            self._stage_predicted()
        if decision.empty:
            return
        # pair demotions with promotions (policies.precision.order_switches); what cannot move
        # keeps its precision, and the controller is told so
        plan = order_switches(decision, self.hi_slots - self.planned_hi, transient=self.cfg.transient_slots)
        for key in plan.rejected_upgrades:
            self.controller.reset_target(key, high=False)
        for key in plan.kept_high:
            self.controller.reset_target(key, high=True)
        lo, hi = self.store.lo_precision, self.store.hi_precision
        moves = [
            Move(MoveKind.PROMOTE, k, Tier.DISK, Tier.HOST, hi) if state is ExpertState.HIGH
            else Move(MoveKind.DEMOTE, k, Tier.DISK, Tier.HOST, lo)
            for k, state in plan.moves
        ]  # fmt: skip
        self.planned_hi += sum(1 if m.kind is MoveKind.PROMOTE else -1 for m in moves)
        self.mover.submit(moves)
        if self.cfg.sync:
            self.mover.drain()

    def _stage_predicted(self) -> None:
        """Halfway to the next decision: stage the high-precision bytes of the experts it is predicted to
        promote (controller.predict_upgrades) from disk into the DRAM cache."""
        c = self.controller
        if c.decisions == 0 or 2 * c.pending_tokens < c.period:
            return
        self._staged_this_period = True
        keys = c.predict_upgrades()
        self._last_prediction = set(keys)
        self.predicted += len(keys)
        assert self.stager is not None
        self.stager.submit(Move(MoveKind.PREFETCH, k, Tier.DISK, Tier.HOST, self.store.hi_precision) for k in keys)
        if self.cfg.sync:
            self.stager.drain()

    def _failed(self, move: Move) -> None:
        """The expert stays at its registered precision; let the controller decide it again."""
        self.planned_hi += -1 if move.kind is MoveKind.PROMOTE else 1
        actual = self.store.precision_of(move.key)
        self.controller.reset_target(move.key, high=actual == self.store.hi_precision)

    def stats(self) -> dict[str, Any]:
        c = self.controller
        return {
            "decisions": c.decisions, "decided_promotions": c.promotions, "decided_demotions": c.demotions,
            "pending_moves": self.mover.pending, "mover_errors": list(self.mover.errors),
            "n_hot": sum(c.n_hot.values()), "hysteresis": c.hysteresis, "alpha": c.hotness.alpha,
            "period": c.period, "lookahead": c.lookahead, "workers": self.mover.workers,
        } | self._store_stats() | self._prefetch_stats()  # fmt: skip

    def _store_stats(self) -> dict[str, Any]:
        """The transient buffer and the DRAM cache (`dram`: hit rates per precision), from the store."""
        s = self.store.stats()
        return {"transient": s["transient"]} | ({"dram": s["dram"]} if "dram" in s else {})

    def _prefetch_stats(self) -> dict[str, Any]:
        if self.stager is None:
            return {}
        return {"prefetch": {
            "predicted": self.predicted, "predicted_promoted": self.predicted_hits,
            "staged": self.store.prefetch_issued, "errors": list(self.stager.errors[-5:]),
        }}  # fmt: skip

    def close(self) -> None:
        self.mover.close()
        if self.stager is not None:
            self.stager.drain(30.0)
            self.stager.close()

