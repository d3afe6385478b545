"""Intra-expert activation sparsity in the engine: the sparse executor of a MoE layer, the
dense/sparse tipping profile, and calibration.

`SparseExperts` replaces the compute step of one TieredMoE block: it groups the call's tokens
by expert, plans with the sparsity target and tipping point (policies.plan), runs every task
below the tipping point through one native gather call (store/sparse.py; torch ops where the
kernel is missing) and the others through the masked dense matmuls, and combines. It counts
active (token, neuron) pairs per layer: the achieved sparsity.

`tipping_profile` times both paths on synthetic experts of the model's shape at token counts
1..64 (cached per machine, shape, dtype, threads and target); `policies.sparsity.tipping_point`
reads the switch from it.

`calibrate` runs text through the model with a recording executor and returns the
ThresholdTable: per MoE layer and block size, the quantiles of |act(gate x)| of routed experts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moetier.config import SPARSITY_BLOCKS, EngineConfig, SparsityConfig
from moetier.errors import ConfigError
from moetier.models.families import Family
from moetier.policies.plan import plan_layer
from moetier.policies.sparsity import LogHistogram, thresholds_for, tipping_point
from moetier.runtime.experts import SwiGLU
from moetier.runtime.kernels import small_rows
from moetier.store import native
from moetier.store.qformat import QExpertViews, QLinearWeight, linear
from moetier.store.sparse import (
    NativeSparse,
    NativeSparseQuant,
    ThresholdTable,
    dense_weights,
    masked_dense,
    native_kernel,
    sparse_torch,
)
from moetier.types import ExpertKey

if TYPE_CHECKING:
    from moetier.runtime.moe_block import TieredMoE

PROFILE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROFILE_VERSION = 2


def check_supported(cfg: EngineConfig, family: Family) -> None:
    """Refuse, with the reason, combinations the sparse path does not run yet."""
    if not cfg.sparsity.enabled:
        return
    if cfg.precision.mode == "dynamic":
        raise ConfigError(
            "--sparsity cannot be combined with --precision dynamic yet; use full, or a static int8/int4/int2 "
            "tier written with `moetier quantize --for-sparsity`"
        )
    if family.expert_kind != "swiglu":
        raise ConfigError(f"--sparsity supports SwiGLU-type experts; {family.name} experts are not supported yet")


@dataclass
class LayerCounts:
    """Per-layer counters: active and total (token, neuron) pairs; calls and tokens per path."""

    active: int = 0
    total: int = 0
    sparse_calls: int = 0
    dense_calls: int = 0
    sparse_tokens: int = 0
    dense_tokens: int = 0

    @property
    def achieved(self) -> float:
        return 1.0 - self.active / self.total if self.total else 0.0


Groups = dict[int, tuple[list[int], list[float]]]  # expert -> (token indices, router weights)


def group_tokens(ids: torch.Tensor, weights: torch.Tensor) -> Groups:
    """ids/weights [T, k] -> expert -> (token indices, router weights), tokens in order."""
    t, k = ids.shape
    if t == 1:
        return {e: ([0], [w]) for e, w in zip(ids[0].tolist(), weights[0].float().tolist(), strict=True)}
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
    experts = flat[order].tolist()
    tokens = (order // k).tolist()
    ws = weights.reshape(-1)[order].float().tolist()
    out: dict[int, tuple[list[int], list[float]]] = {}
    for e, tok, w in zip(experts, tokens, ws, strict=True):
        entry = out.setdefault(e, ([], []))
        entry[0].append(tok)
        entry[1].append(w)
    return out


def add_weighted(out: torch.Tensor, toks: list[int], ws: list[float], y: torch.Tensor) -> None:
    """out[toks[j]] += ws[j] * y[j]: one expert's outputs y [c, H] combined into out [T, H]."""
    w = torch.tensor(ws, dtype=y.dtype, device=y.device)[:, None]  # [c, 1]
    out.index_add_(0, torch.tensor(toks, device=out.device), (y * w).to(out.dtype))


class SparseExperts:
    """The compute step of one MoE layer with intra-expert activation sparsity."""

    def __init__(
        self, layer: int, threshold: float, target: float, block: int, tipping: int, inter: int,
        act: Callable[[torch.Tensor], torch.Tensor], kernel: NativeSparse | NativeSparseQuant | None,
    ) -> None:  # fmt: skip
        self.layer, self.threshold, self.target, self.block = layer, threshold, target, block
        self.tipping, self.inter, self.act, self.kernel = tipping, inter, act, kernel
        self.counts = LayerCounts()

    def forward(self, moe: TieredMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> sum_k w * masked expert(x) as [T, H]."""
        # 1. group and plan: tasks under the tipping point carry the target (gather path)
        groups = group_tokens(ids, weights)
        store, c = moe.store, self.counts
        plan = plan_layer(
            self.layer, {e: len(g[0]) for e, g in groups.items()}, store.index,
            sparsity=self.target, tipping=self.tipping,
        )  # fmt: skip
        sparse = [t for t in plan.tasks if t.sparsity > 0]
        dense = [t for t in plan.tasks if t.sparsity == 0]
        xc = x.contiguous()
        out = torch.zeros_like(xc)
        # 2. gather path: one native call per chunk of experts the compute tier can pin at once
        if sparse:
            self._sparse(store, xc, out, sparse, groups)
        # 3. masked dense path for the big calls
        for task in dense:
            toks, ws = groups[task.key.expert]
            views = store.acquire(task.key)
            try:
                w13, w2, _ = dense_weights(views, x.dtype)  # quantized rows: dequantised copies
                with small_rows(len(toks), x.dtype, x.device):
                    y, active = masked_dense(xc[toks], w13, w2, self.act, self.threshold, self.block)
            finally:
                store.release(task.key)
            add_weighted(out, toks, ws, y)
            c.active += active
            c.total += len(toks) * self.inter
            c.dense_calls += 1
            c.dense_tokens += len(toks)
        return out

    def _native(
        self, x: torch.Tensor, out: torch.Tensor, chunk: Sequence[Any], views: Sequence[Any], groups: Groups,
        accumulate: bool,
    ) -> int:  # fmt: skip
        """One kernel call for a chunk of experts. When the chunk covers only some of the call's tokens
        (prefill with a mix of paths), the kernel sees just those rows, gathered, and its output is
        added back; a decode step (or a chunk covering every token) reads and writes x and out as
        they are."""
        assert self.kernel is not None
        toks = [t for task in chunk for t in groups[task.key.expert][0]]
        ws = [w for task in chunk for w in groups[task.key.expert][1]]
        starts = [0]
        for task in chunk:
            starts.append(starts[-1] + task.tokens)
        slots: list[Any] = [self.kernel.address(v) for v in views]
        rows = sorted(set(toks))
        if len(rows) == x.shape[0]:  # every token (rows == 0..T-1): in place
            return self.kernel(x, slots, toks, ws, starts, out, self.threshold, self.block, accumulate=accumulate)
        where = {t: j for j, t in enumerate(rows)}
        idx = torch.tensor(rows, device=x.device)
        y = torch.empty((len(rows), x.shape[1]), dtype=out.dtype, device=out.device)  # [R, H]
        active = self.kernel(x[idx], slots, [where[t] for t in toks], ws, starts, y, self.threshold, self.block)
        out.index_add_(0, idx, y)
        return active

    def _sparse(self, store: Any, x: torch.Tensor, out: torch.Tensor, tasks: Sequence[Any], groups: Groups) -> None:
        c = self.counts
        cap = max(1, int(getattr(store, "capacity", 1)))
        for first in range(0, len(tasks), cap):
            chunk = tasks[first : first + cap]
            keys: list[ExpertKey] = []
            try:
                views = []
                for task in chunk:
                    views.append(store.acquire(task.key))
                    keys.append(task.key)
                if self.kernel is not None:
                    active = self._native(x, out, chunk, views, groups, accumulate=first > 0)
                else:
                    active = 0
                    for task, v in zip(chunk, views, strict=True):
                        toks, ws = groups[task.key.expert]
                        w13, _, rows = dense_weights(v, x.dtype)
                        y, n = sparse_torch(x[toks], w13, rows, self.act, self.threshold, self.block)
                        add_weighted(out, toks, ws, y)
                        active += n
            finally:
                for key in keys:
                    store.release(key)
            n_tok = sum(task.tokens for task in chunk)
            c.active += active
            c.total += n_tok * self.inter
            c.sparse_calls += len(chunk)
            c.sparse_tokens += n_tok


# --------------------------------------------------------------------------- tipping profile


def _profile_key(
    hidden: int, inter: int, dtype: torch.dtype, target: float, block: int, kernel: bool,
    quant: tuple[int, int] | None = None,
) -> str:  # fmt: skip
    """Everything a measured profile depends on: CPU (model and flags), threads, shape, dtype, target,
    block, which kernel (the native build's key: source, compiler, flags) and torch."""
    cpu = hashlib.sha256(native._cpu_id().encode()).hexdigest()[:16]
    return json.dumps(
        {"cpu": cpu, "threads": torch.get_num_threads(), "hidden": hidden, "inter": inter,
         "dtype": str(dtype), "target": round(target, 4), "block": block, "quant": list(quant or ()),
         "kernel": native.build_key() if kernel else "torch", "version": PROFILE_VERSION,
         "torch": torch.__version__}, sort_keys=True,
    )  # fmt: skip


def _best_time(fn: Callable[[], object], min_s: float = 0.01, rounds: int = 3) -> float:
    """Median over `rounds` of the mean time of fn over at least `min_s` seconds."""
    fn()
    res = []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= min_s:
                break
        res.append(el / n)
    return float(sorted(res)[len(res) // 2])


def _synthetic_experts(
    hidden: int, inter: int, dtype: torch.dtype, quant: tuple[int, int] | None, gen: torch.Generator
) -> list[Any]:
    """Random experts of this shape in the layout the engine uses: full precision as SlotViews-like
    (w13 [2I, H], w2 view, down_rows [I, H], row) or quantized rows as QExpertViews; about 64 MiB, one
    at a time, in the target dtype (never fewer than one)."""
    bits = quant[0] if quant else 8 * dtype.itemsize
    slot = 3 * inter * hidden * bits // 8
    n_exp = int(min(16, max(1, (64 << 20) // max(slot, 1))))
    out: list[Any] = []
    for _ in range(n_exp):
        if quant is None:
            row = torch.empty(3 * inter, hidden, dtype=dtype).normal_(0.0, hidden**-0.5, generator=gen)
            down = row[2 * inter :]
            out.append(SimpleNamespace(w13=row[: 2 * inter], w2=down.t(), down_rows=down, row=row))
            continue
        b, g = quant
        mats = []
        for n in (2 * inter, inter):
            q = torch.randint(0, 256, (n, hidden * b // 8), dtype=torch.uint8, generator=gen)
            scale = torch.full((n, hidden // g), 2.0 * hidden**-0.5 / (2**b), dtype=torch.bfloat16)
            zero = torch.full((n, hidden // g), (2**b - 1) / 2, dtype=torch.bfloat16)
            mats.append(QLinearWeight("generic", n, hidden, g, b, q, scale, zero))
        out.append(QExpertViews(mats[0], mats[1], None, None, torch.empty(0, dtype=torch.uint8)))
    return out


def tipping_profile(
    hidden: int, inter: int, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor], target: float,
    block: int, kernel: NativeSparse | NativeSparseQuant | None, counts: Sequence[int] = PROFILE_COUNTS,
    stop_after: int = 2, quant: tuple[int, int] | None = None,
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """tokens per expert -> (dense s, sparse s) for one expert call on synthetic experts of this shape
    (full precision, or `quant` = (bits, group) in the rows layout), rotating over enough of them to
    leave the CPU caches (as real experts are, at decode). Inputs are random; each token's threshold
    is its own quantile at `target`, so every token has the target's sparsity and the union over
    tokens is that of independent tokens (pessimistic for the gather path). Stops `stop_after`
    counts after dense first wins."""
    gen = torch.Generator().manual_seed(0)
    experts = _synthetic_experts(hidden, inter, dtype, quant, gen)
    x_all = torch.randn(max(counts), hidden, generator=gen).to(dtype)
    w13_0 = dense_weights(experts[0], dtype)[0]
    a = act(F.linear(x_all, w13_0[:inter]).float())  # [N, I]
    thr = float(torch.quantile(a.abs().flatten().float(), target)) if target > 0 else 0.0
    out: dict[int, tuple[float, float]] = {}
    it = [0]
    dense_wins = 0

    def pick() -> Any:
        it[0] = (it[0] + 1) % len(experts)
        return experts[it[0]]

    for c in counts:
        x = x_all[:c].contiguous()
        y = torch.empty_like(x)

        def dense(x: torch.Tensor = x) -> None:
            w13, w2, _ = dense_weights(pick(), dtype)
            with small_rows(x.shape[0], dtype, x.device):
                masked_dense(x, w13, w2, act, thr, block)

        def sparse(x: torch.Tensor = x, y: torch.Tensor = y, c: int = c) -> None:
            v = pick()
            if kernel is not None:
                experts: list[Any] = [kernel.address(v)]
                kernel(x, experts, list(range(c)), [1.0] * c, [0, c], y, thr, block)
            else:
                w13, _, rows = dense_weights(v, dtype)
                sparse_torch(x, w13, rows, act, thr, block)

        with torch.inference_mode():
            out[c] = (_best_time(dense), _best_time(sparse))
        dense_wins = dense_wins + 1 if out[c][0] <= out[c][1] else 0
        if dense_wins >= stop_after:
            break
    return out


def load_or_measure_tipping(
    hidden: int, inter: int, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor], cfg: SparsityConfig,
    kernel: NativeSparse | NativeSparseQuant | None, cache: Path | None = None, quant: tuple[int, int] | None = None,
) -> tuple[int, dict[int, tuple[float, float]], bool]:  # fmt: skip
    """(tipping point, profile, from cache). A profile is cached per machine, threads, shape, dtype,
    target and block in CACHE/sparse-profiles.json; an unwritable cache only costs the re-measure."""
    path = cache or native.cache_dir().parent / "sparse-profiles.json"
    key = _profile_key(hidden, inter, dtype, cfg.target, cfg.block, kernel is not None, quant)
    stored: dict[str, Any] = {}
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        stored = {}
    if key in stored:
        try:
            profile = {int(c): (float(d), float(s)) for c, (d, s) in stored[key].items()}
            return tipping_point(profile), profile, True
        except (AttributeError, TypeError, ValueError):
            pass  # a malformed entry: measure again and overwrite it
    profile = tipping_profile(hidden, inter, dtype, act, cfg.target, cfg.block, kernel, quant=quant)
    stored[key] = {str(c): list(v) for c, v in profile.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return tipping_point(profile), profile, False


# --------------------------------------------------------------------------- wiring


@dataclass
class SparsityState:
    """What the engine keeps about sparsity: per-layer executors, the switch and where it came from."""

    target: float
    block: int
    tipping: int
    table_path: str
    kernel: str  # "native" or "torch (<why>)"
    profile: dict[int, tuple[float, float]] = field(default_factory=dict)
    profile_cached: bool = False
    layers: dict[int, SparseExperts] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        per_layer = {
            layer: {
                "threshold": s.threshold, "achieved": round(s.counts.achieved, 4),
                "sparse_calls": s.counts.sparse_calls, "dense_calls": s.counts.dense_calls,
                "sparse_tokens": s.counts.sparse_tokens, "dense_tokens": s.counts.dense_tokens,
            }
            for layer, s in sorted(self.layers.items())
        }  # fmt: skip
        active = sum(s.counts.active for s in self.layers.values())
        total = sum(s.counts.total for s in self.layers.values())
        return {
            "target": self.target, "achieved": round(1 - active / total, 4) if total else 0.0,
            "block": self.block, "tipping_tokens": self.tipping, "kernel": self.kernel, "table": self.table_path,
            "profile_cached": self.profile_cached, "layers": per_layer,
        }  # fmt: skip

    def reset_counts(self) -> None:
        """Start the achieved-sparsity counters over (e.g. between measured runs)."""
        for s in self.layers.values():
            s.counts = LayerCounts()


def attach(
    blocks: Sequence[TieredMoE], table: ThresholdTable, table_path: str, cfg: SparsityConfig, hidden: int,
    inter: int, dtype: torch.dtype, device: torch.device, act_name: str | None, quant: tuple[int, int] | None = None,
) -> SparsityState:  # fmt: skip
    """Give every MoE block a SparseExperts executor with its layer's threshold. `quant` = (bits, group)
    when the experts are quantized (rows layout)."""
    if inter % cfg.block:
        raise ConfigError(f"--sparsity-block {cfg.block} does not divide the expert size {inter}")
    fn = blocks[0].expert_fn
    if not isinstance(fn, SwiGLU):
        raise ConfigError("--sparsity supports SwiGLU-type experts only")
    kernel = native_kernel(hidden, inter, dtype, device, quant) if act_name in ("silu", "swish") else None
    why = (
        "native" if kernel is not None else
        f"torch ({native.load_error() or ('CUDA, unverified' if device.type == 'cuda' else f'activation {act_name}')})"
    )  # fmt: skip
    profile: dict[int, tuple[float, float]] = {}
    cached = False
    if cfg.tipping is not None:
        tipping = cfg.tipping
    elif device.type == "cuda":  # unverified here: no GPU to measure on; dense beyond 8 tokens per expert
        tipping = 8
    else:
        tipping, profile, cached = load_or_measure_tipping(hidden, inter, dtype, fn.act, cfg, kernel, quant=quant)
    state = SparsityState(cfg.target, cfg.block, tipping, table_path, why, profile, cached)
    for block in blocks:
        thr = table.threshold(block.layer, cfg.target, cfg.block)
        block.sparse = state.layers[block.layer] = SparseExperts(
            block.layer, thr, cfg.target, cfg.block, tipping, inter, fn.act, kernel
        )
    return state


# --------------------------------------------------------------------------- calibration


class _Recording:
    """A layer's expert function during calibration: the dense SwiGLU of runtime/experts.py, recording
    |act(gate x)| of every (token, neuron) in histograms (per block size: the block's largest magnitude).
    It runs inside the engine's own dense expert path, so calibration sees what serving computes."""

    def __init__(self, inter: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inter, self.act = inter, act
        self.blocks = [b for b in SPARSITY_BLOCKS if inter % b == 0]
        self.hist = {b: LogHistogram() for b in self.blocks}
        self.pairs = 0

    def __call__(self, x: torch.Tensor, v: Any) -> torch.Tensor:
        gate, up = linear(x, v.w13).chunk(2, dim=-1)  # [N, I] each
        a = self.act(gate)
        mag = a.detach().abs().float().cpu().numpy()  # [N, I]
        n = mag.shape[0]
        self.pairs += n
        for b in self.blocks:
            self.hist[b].add(mag if b == 1 else mag.reshape(n, self.inter // b, b).max(-1))
        return linear(a * up, v.w2)  # [N, H]


def calibrate(
    engine: Any, ids: Sequence[int], window: int, model_identity: dict[str, Any], act_name: str,
    text_meta: dict[str, Any], on_window: Callable[[int, int], None] | None = None,
) -> ThresholdTable:  # fmt: skip
    """Run `ids` through the engine's model in windows of `window` tokens with recording executors;
    return the table (thresholds per layer, block size and target)."""
    blocks = engine.loaded.blocks
    fn = blocks[0].expert_fn
    if not isinstance(fn, SwiGLU):
        raise ConfigError(f"calibrate supports SwiGLU-type experts; {engine.info.family} is not supported yet")
    if len(ids) < 2:
        raise ConfigError(f"calibration text has {len(ids)} tokens; give at least a few hundred")
    recorders = {b.layer: _Recording(engine.info.expert_intermediate, fn.act) for b in blocks}
    saved = [(b.sparse, b.expert_fn) for b in blocks]
    for b in blocks:  # the dense path, with recording expert functions
        b.sparse, b.expert_fn = None, recorders[b.layer]
    try:
        starts = list(range(0, len(ids), window))
        for n, s in enumerate(starts):
            engine.logits(torch.tensor([ids[s : s + window]]))
            if on_window is not None:
                on_window(n + 1, len(starts))
    finally:
        for b, (sparse, fn_) in zip(blocks, saved, strict=True):
            b.sparse, b.expert_fn = sparse, fn_
    thresholds = {layer: {b: thresholds_for(r.hist[b]) for b in r.blocks} for layer, r in recorders.items()}
    calibration = dict(text_meta) | {"tokens": len(ids), "window": window,
                                     "pairs": {str(k): r.pairs for k, r in recorders.items()}}  # fmt: skip
    zero = {str(k): round(float(r.hist[1].counts[0] / max(r.hist[1].total, 1)), 6) for k, r in recorders.items()}
    return ThresholdTable(
        model=model_identity, activation=act_name, calibration=calibration | {"zero_fraction": zero},
        thresholds=thresholds,
    )


def table_summary(path: str | os.PathLike[str], identity: dict[str, Any]) -> dict[str, Any] | None:
    """What `moetier info` shows of a sparsity table: path, tokens calibrated on, and status ("ok", or
    why the engine would refuse it); None when there is no file."""
    if not Path(path).exists():
        return None
    out: dict[str, Any] = {"path": str(path)}
    try:
        table = ThresholdTable.load(path)
        out["tokens"] = table.calibration.get("tokens")
        table.check_model(identity, path)
        out["status"] = "ok"
    except ConfigError as exc:
        out["status"] = f"refused: {exc}"
    return out


def model_identity(info: Any, source_fingerprint: str) -> dict[str, Any]:
    return {
        "path": info.path, "family": info.family, "hidden_size": info.hidden_size,
        "moe_intermediate": info.expert_intermediate, "num_experts": info.num_experts,
        "moe_layers": list(info.moe_layers), "fingerprint": source_fingerprint,
    }  # fmt: skip
