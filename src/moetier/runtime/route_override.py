"""Overrides of the router's decision, applied at the one point where a MoE layer call has routed (RoutingConfig).

`RouteOverride` is built once by the wiring (runtime/wire.py) and handed to every block in its Pipeline
(`Pipeline.override`). The two routing sites call it right after the router, before the observers and the
experts: the native step (runtime/native_step.py `_mlp`: in place on the step's buffers the MoE half reads) and
TieredMoE's torch path (runtime/moe_block.py). In order:
1. a followed trace (`TraceRoutes`, RoutingConfig.follow_trace) replaces the call's ids and weights by the next
   T rows of that layer's recorded stream (the router still ran; its logits no longer describe the routing, so
   the observers get none and score the trace's weights instead);
2. else, in a layer with pruned experts (RoutingConfig.prune, `PruneFile`), the router's top-k is recomputed from
   its logits with them masked out (policies/routing.py route_pruned);
3. the per-token reduction (threshold, top-k cap; policies/routing.py reduce_routing): dropped pairs become id -1,
   weight 0, skipped by the native MoE half and the torch executors, so a dropped expert is never read.

Counters (`stats`, Engine.stats()["routing"]): routed pairs before and after the reduction, tokens, the trace's
wraps. A trace stream shorter than the run starts again from its first row (counted in `trace_wraps`).

Invariants: the override changes the routing only (never the attention half, never the experts); the observers
see the routing the experts compute; a trace or pruning file that does not fit the model is a ConfigError naming
the file and both shapes, raised when the model is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier import traces
from moetier.config import RoutingConfig
from moetier.errors import ConfigError, TraceError
from moetier.policies.routing import reduce_routing, route_pruned

PRUNE_FORMAT = "moetier-prune/1"


class TraceRoutes:
    """A recorded routing trace as one stream of rows per MoE layer: `take(layer, T)` gives the next T rows
    (ids [T, k] int32, weights [T, k] float32) of that layer, the trace's layers mapped in ascending order onto the
    model's MoE layers."""

    def __init__(self, path: str | os.PathLike[str], moe_layers: tuple[int, ...], num_experts: int, top_k: int,
                 model: str) -> None:  # fmt: skip
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--follow-trace {p}: no such file")
        try:
            trace = traces.load(p)
        except TraceError as exc:
            raise ConfigError(f"--follow-trace: {exc}") from exc
        meta = trace.metadata
        table = trace.table
        layer_col = table.column("layer").to_numpy()
        t_layers = sorted({int(v) for v in np.unique(layer_col)})
        t_e, t_k = int(meta["num_experts"]), int(meta["top_k"])
        if (len(t_layers), t_e, t_k) != (len(moe_layers), num_experts, top_k):
            raise ConfigError(
                f"--follow-trace {p} ({meta.get('model', '?')}) has {len(t_layers)} MoE layers, {t_e} experts, "
                f"top-{t_k}; the model {model} has {len(moe_layers)} MoE layers, {num_experts} experts, "
                f"top-{top_k}: they must match"
            )  # fmt: skip
        if table.num_rows == 0:
            raise ConfigError(f"--follow-trace {p}: the trace has no rows")
        try:
            ids = traces._fixed(table.column("experts"), t_k, "experts", np.int32)  # [N, k]
            wts = traces._fixed(table.column("weights"), t_k, "weights", np.float32)  # [N, k]
        except TraceError as exc:
            raise ConfigError(f"--follow-trace {p}: {exc}") from exc
        if ids.min() < 0 or ids.max() >= num_experts:
            raise ConfigError(f"--follow-trace {p}: expert ids outside 0..{num_experts - 1}")
        if not np.isfinite(wts).all():
            raise ConfigError(f"--follow-trace {p}: non-finite gate weights")
        step = table.column("step").to_numpy()
        token = table.column("token").to_numpy()
        order = np.lexsort((token, step))  # stream order: step, then token within the step
        self.path = str(p)
        self.streams: dict[int, tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]] = {}
        for tl, ml in zip(t_layers, moe_layers, strict=True):
            rows = order[layer_col[order] == tl]
            self.streams[ml] = (np.ascontiguousarray(ids[rows]), np.ascontiguousarray(wts[rows]))
        self.cursor = dict.fromkeys(moe_layers, 0)
        self.wraps = 0
        self.tokens = min(len(s[0]) for s in self.streams.values())

    def take(self, layer: int, n: int, ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32]) -> None:
        """Write the next `n` rows of `layer`'s stream into ids [n, k] and weights [n, k] (wrapping at its end)."""
        s_ids, s_wts = self.streams[layer]
        total = len(s_ids)
        c = self.cursor[layer]
        done = 0
        while done < n:
            m = min(n - done, total - c)
            ids[done : done + m] = s_ids[c : c + m]
            weights[done : done + m] = s_wts[c : c + m]
            done += m
            c += m
            if c == total:
                c = 0
                self.wraps += 1
        self.cursor[layer] = c


class PruneFile:
    """Pruned experts per MoE layer (`moetier prune`'s JSON): {"format", "model": {num_experts, top_k,
    moe_layers, hidden_size}, "method", "fraction", "pruned": {layer: [expert ids]}, ...}."""

    def __init__(self, pruned: dict[int, list[int]], meta: dict[str, Any]) -> None:
        self.pruned, self.meta = pruned, meta

    @staticmethod
    def write(path: str | os.PathLike[str], pruned: dict[int, list[int]], meta: dict[str, Any]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": PRUNE_FORMAT, **meta, "pruned": {str(k): v for k, v in sorted(pruned.items())}}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], moe_layers: tuple[int, ...], num_experts: int, top_k: int,
             hidden: int) -> PruneFile:  # fmt: skip
        """Read and check against the model; ConfigError naming the file and the mismatch."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--prune {p}: no such file (write one with `moetier prune MODEL --text FILE`)")
        try:
            body = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--prune {p}: not a pruning file ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") != PRUNE_FORMAT or not isinstance(body.get("pruned"), dict):
            raise ConfigError(f"--prune {p}: not a pruning file (format {PRUNE_FORMAT!r} expected)")
        model = body.get("model") or {}
        have = (model.get("num_experts"), model.get("top_k"), tuple(model.get("moe_layers") or ()),
                model.get("hidden_size"))  # fmt: skip
        want = (num_experts, top_k, tuple(moe_layers), hidden)
        if have != want:
            raise ConfigError(
                f"--prune {p} was written for a model with {have[0]} experts, top-{have[1]}, MoE layers "
                f"{list(have[2])}, hidden size {have[3]}; this model has {want[0]} experts, top-{want[1]}, MoE layers "
                f"{list(want[2])}, hidden size {want[3]}"
            )  # fmt: skip
        pruned: dict[int, list[int]] = {}
        for key, experts in body["pruned"].items():
            try:
                layer = int(key)
                ids = sorted({int(e) for e in experts})
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"--prune {p}: layer {key!r}: {exc}") from exc
            if layer not in moe_layers:
                raise ConfigError(f"--prune {p}: layer {layer} is not a MoE layer of this model")
            if any(not 0 <= e < num_experts for e in ids):
                raise ConfigError(f"--prune {p}: layer {layer}: expert ids outside 0..{num_experts - 1}")
            if len(ids) > num_experts - top_k:
                raise ConfigError(f"--prune {p}: layer {layer} prunes {len(ids)} of {num_experts} experts; at most "
                                  f"{num_experts - top_k} leave the router top-{top_k} choices")  # fmt: skip
            if ids:
                pruned[layer] = ids
        return cls(pruned, {k: v for k, v in body.items() if k != "pruned"})


class RouteOverride:
    """The model's routing override (see the module docstring); one per engine, shared by its blocks."""

    def __init__(self, cfg: RoutingConfig, moe_layers: tuple[int, ...], num_experts: int, top_k: int, hidden: int,
                 router: str | None, norm_topk: bool, model: str) -> None:  # fmt: skip
        if cfg.max_k > top_k:
            raise ConfigError(f"--max-experts-per-token {cfg.max_k} exceeds the model's top-k of {top_k}")
        self.cfg, self.top_k, self.num_experts = cfg, top_k, num_experts
        self.router, self.norm_topk = router or "softmax_topk", norm_topk
        self.trace = (TraceRoutes(cfg.follow_trace, moe_layers, num_experts, top_k, model)
                      if cfg.follow_trace is not None else None)  # fmt: skip
        self.prune: PruneFile | None = None
        self.masks: dict[int, npt.NDArray[np.bool_]] = {}
        if cfg.prune is not None:
            if router is None:
                raise ConfigError("--prune needs a router moetier computes (a family row with a native router); "
                                  f"{model}'s routes inside its own module")  # fmt: skip
            self.prune = PruneFile.load(cfg.prune, moe_layers, num_experts, top_k, hidden)
            for layer, ids in self.prune.pruned.items():
                m = np.zeros(num_experts, dtype=np.bool_)
                m[ids] = True
                self.masks[layer] = m
        self.pairs_routed = 0  # (token, expert) pairs the routing gave (after a trace or pruning)
        self.pairs_dropped = 0  # of those, dropped by the reduction
        self.tokens = 0  # rows routed, summed over MoE layer calls

    def needs_logits(self, layer: int) -> bool:
        """Whether `apply` for `layer` reads the router logits (pruning recomputes the top-k from them)."""
        return self.trace is None and layer in self.masks

    def replaces_logits(self, layer: int) -> bool:
        """Whether the router's logits no longer describe the call's routing (a trace: observers get none)."""
        return self.trace is not None

    def apply(self, layer: int, ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32],
              logits: npt.NDArray[np.float32] | None = None) -> None:  # fmt: skip
        """In place: ids [T, k] int32 and weights [T, k] float32 of one call of `layer` -> the overridden routing.
        `logits` [T, E] (fp32 values) is needed where `needs_logits(layer)`."""
        t = ids.shape[0]
        if self.trace is not None:
            self.trace.take(layer, t, ids, weights)
        elif layer in self.masks:
            if logits is None:
                raise ValueError(f"layer {layer}: pruning needs the router logits")
            ids[:], weights[:] = route_pruned(logits, self.masks[layer], self.top_k, self.router, self.norm_topk)
        self.tokens += t
        self.pairs_routed += int((ids >= 0).sum())
        if self.cfg.reduces:
            self.pairs_dropped += reduce_routing(ids, weights, self.cfg.threshold, self.cfg.max_k, self.cfg.renormalize)

    def mask_logits(self, layer: int, logits: Any) -> Any:
        """Router logits [T, E] (a torch tensor) with the layer's pruned experts at -inf (what observers see)."""
        m = self.masks.get(layer)
        if m is None or logits is None:
            return logits
        out = logits.clone()
        out[:, np.flatnonzero(m).tolist()] = float("-inf")
        return out

    def stats(self) -> dict[str, Any]:
        kept = self.pairs_routed - self.pairs_dropped
        out: dict[str, Any] = {
            "threshold": self.cfg.threshold, "max_k": self.cfg.max_k, "renormalize": self.cfg.renormalize,
            "tokens": self.tokens, "pairs_routed": self.pairs_routed, "pairs_dropped": self.pairs_dropped,
            "experts_per_token": kept / self.tokens if self.tokens else 0.0,
        }  # fmt: skip
        if self.prune is not None:
            out["pruned_experts"] = sum(len(v) for v in self.prune.pruned.values())
            out["prune_file"] = self.cfg.prune
        if self.trace is not None:
            out["follow_trace"] = self.trace.path
            out["trace_tokens"] = self.trace.tokens
            out["trace_wraps"] = self.trace.wraps
        return out

    def close(self) -> None:
        return None


def build_override(cfg: RoutingConfig, info: Any, family: Any, config: Any) -> RouteOverride | None:
    """The model's RouteOverride, or None when RoutingConfig overrides nothing."""
    if not cfg.enabled:
        return None
    return RouteOverride(cfg, tuple(info.moe_layers), int(info.num_experts), int(info.top_k), int(info.hidden_size),
                         family.native_router, family.renormalizes_topk(config), str(info.path))  # fmt: skip


__all__ = ["PRUNE_FORMAT", "PruneFile", "RouteOverride", "TraceRoutes", "build_override"]
