"""The dense/sparse switch of intra-expert sparsity, measured: where the gather path stops paying.

`tipping_profile` times one expert call on both paths (masked dense matmuls vs the gather kernel)
on synthetic experts of the model's shape, dtype and quantization, at token counts 1..64, on the
engine's device (the paper: "we profile the tipping batch size between the sparse execution path and
dense execution path during engine startup", 4.1); `policies.sparsity.tipping_point` reads the switch
from it. The dense side is the path the engine runs above the switch: the original, unmasked expert
(SparsityConfig.dense "original") or the masked matmuls ("masked"). On CUDA the
timing synchronises the device around each measured loop; this is **unverified**: no GPU was lent to
this work. `load_or_measure_tipping` caches profiles per machine (CPU, and the GPU's name on CUDA),
threads, shape, dtype, quantization, target, block, kernel build and torch in
CACHE/sparse-profiles.json (CACHE: RuntimeConfig.kernel_cache, default ~/.cache/moetier).

Invariants: the cache file is replaced atomically (temp file, then os.replace); an unreadable or
unwritable cache only costs a re-measure, never an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from moetier.config import SparsityConfig
from moetier.kernels import native
from moetier.kernels.decode import KIND_BF16, ROWS
from moetier.kernels.qformat import QExpertViews, QLinearWeight
from moetier.kernels.sparse import (
    NativeSparse,
    NativeSparseQuant,
    dense_original,
    dense_weights,
    masked_dense,
    sparse_torch,
)
from moetier.kernels.step import DESC, MoeLayer, Step
from moetier.policies.sparsity import tipping_point

PROFILE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROFILE_VERSION = 4  # 3: quantized rows' dense side is the native kernel at threshold 0; 4: bf16's the MoE half


def _profile_key(
    hidden: int, inter: int, dtype: torch.dtype, target: float, block: int, kernel: str,
    quant: tuple[int, int] | None = None, device: torch.device | None = None, masked: bool = True,
    native_dense: bool = False,
) -> str:  # fmt: skip
    """Everything a measured profile depends on: CPU (model and flags), threads, the GPU on CUDA, shape,
    dtype, target, block, which kernel (`kernel`: the native build's key (source, compiler, flags) or
    "torch"), which dense path (masked, original in torch, or the native MoE half) and torch."""
    cpu = hashlib.sha256(native._cpu_id().encode()).hexdigest()[:16]
    key = {"cpu": cpu, "threads": torch.get_num_threads(), "hidden": hidden, "inter": inter,
           "dtype": str(dtype), "target": round(target, 4), "block": block, "quant": list(quant or ()),
           "kernel": kernel, "version": PROFILE_VERSION, "torch": torch.__version__,
           "dense": "masked" if masked else ("native" if native_dense else "original")}  # fmt: skip
    if device is not None and device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    return json.dumps(key, sort_keys=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(
    fn: Callable[[], object], min_s: float = 0.01, rounds: int = 3, device: torch.device | None = None
) -> float:
    """Median over `rounds` of the mean time of fn over at least `min_s` seconds (the device synchronised
    before the clock starts and before it is read, so queued kernels are counted)."""
    dev = device or torch.device("cpu")
    fn()
    res = []
    for _ in range(rounds):
        _sync(dev)
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(dev)
            el = time.perf_counter() - t0
            if el >= min_s:
                break
        res.append(el / n)
    return float(sorted(res)[len(res) // 2])


def _synthetic_experts(
    hidden: int, inter: int, dtype: torch.dtype, quant: tuple[int, int] | None, gen: torch.Generator,
    device: torch.device | None = None,
) -> list[Any]:  # fmt: skip
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
            row = row.to(device) if device is not None else row
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
    stop_after: int = 2, quant: tuple[int, int] | None = None, device: torch.device | None = None,
    masked: bool = True, decode_lib: ctypes.CDLL | None = None,
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """tokens per expert -> (dense s, sparse s) for one expert call on synthetic experts of this shape
    (full precision, or `quant` = (bits, group) in the rows layout), rotating over enough of them to
    leave the CPU caches (as real experts are, at decode). Inputs are random; each token's threshold
    is its own quantile at `target`, so every token has the target's sparsity and the union over
    tokens is that of independent tokens (pessimistic for the gather path). Stops `stop_after`
    counts after dense first wins. `masked`: the dense side applies the mask (else it is the original,
    unmasked expert). `device` (default CPU) is where the experts live and both paths run;
    quantized rows are CPU-only (the native kernel's). `decode_lib` (bf16 CPU experts, unmasked): the dense side
    is the native MoE half reading the sparse layout's down rows (csrc/step.c, MT_ROWS), the path the engine's
    sparse executor runs above the switch."""
    dev = device or torch.device("cpu")
    if quant is not None and dev.type != "cpu":
        raise ValueError("quantized rows are timed on the CPU only")
    gen = torch.Generator().manual_seed(0)
    experts = _synthetic_experts(hidden, inter, dtype, quant, gen, dev)
    x_all = torch.randn(max(counts), hidden, generator=gen).to(dev, dtype)
    w13_0 = dense_weights(experts[0], dtype)[0]
    a = act(F.linear(x_all, w13_0[:inter]).float())  # [N, I]
    thr = float(torch.quantile(a.abs().flatten().float(), target)) if target > 0 else 0.0
    out: dict[int, tuple[float, float]] = {}
    it = [0]
    dense_wins = 0

    def pick() -> Any:
        it[0] = (it[0] + 1) % len(experts)
        return experts[it[0]]

    half = _NativeHalf(decode_lib, hidden, inter, max(counts), experts) if decode_lib is not None else None
    for c in counts:
        x = x_all[:c].contiguous()
        y = torch.empty_like(x)

        def dense(x: torch.Tensor = x, y: torch.Tensor = y, c: int = c) -> None:
            if half is not None:  # the engine's dense path on bf16 down rows: the native MoE half
                it[0] = (it[0] + 1) % len(experts)
                half(x, it[0])
                return
            if isinstance(kernel, NativeSparseQuant) and not masked:  # the engine's dense path on quantized rows
                kernel(x, [kernel.address(pick())], list(range(c)), [1.0] * c, [0, c], y, 0.0, block)
                return
            w13, w2, _ = dense_weights(pick(), dtype)
            if masked:
                masked_dense(x, w13, w2, act, thr, block)  # 1-2 rows: matmul.linear picks the kernel per call
            else:
                dense_original(x, w13, w2, act)

        def sparse(x: torch.Tensor = x, y: torch.Tensor = y, c: int = c) -> None:
            v = pick()
            if kernel is not None:
                experts: list[Any] = [kernel.address(v)]
                kernel(x, experts, list(range(c)), [1.0] * c, [0, c], y, thr, block)
            else:
                w13, _, rows = dense_weights(v, dtype)
                sparse_torch(x, w13, rows, act, thr, block)

        with torch.inference_mode():
            out[c] = (_best_time(dense, device=dev), _best_time(sparse, device=dev))
        dense_wins = dense_wins + 1 if out[c][0] <= out[c][1] else 0
        if dense_wins >= stop_after:
            break
    return out


class _NativeHalf:
    """One expert's call through the native MoE half (csrc/step.c) on synthetic bf16 experts of the sparse
    layout (rows [3I, H]: gate, up, then down rows), as the sparse executor's dense path runs it."""

    def __init__(self, lib: ctypes.CDLL, hidden: int, inter: int, rows: int, experts: Sequence[Any]) -> None:
        self.moe = MoeLayer(hidden, inter, 1, 1)
        self.step = Step(lib, rows, hidden, 1, 1, 1, [], [self.moe], None, 0, max(1, torch.get_num_threads()))
        self.step.layer(0)
        self.table = torch.tensor([[v.row.data_ptr(), KIND_BF16, 0, 0, -1, -1, 0, 2 * inter * hidden * 2, -1, -1,
                                    KIND_BF16 | ROWS, -1, -1] for v in experts], dtype=torch.int64)  # [n, DESC]

    def __call__(self, x: torch.Tensor, e: int) -> None:
        st, c = self.step, x.shape[0]
        st.s.T = c
        st.s.nthreads = torch.get_num_threads()
        st.h[:c].copy_(x)
        st.ids[0, :c] = 0
        st.wts[0, :c] = 1.0
        self.moe.desc[0] = self.table.data_ptr() + 8 * DESC * e
        st.moe(self.moe)


def load_or_measure_tipping(
    hidden: int, inter: int, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor], cfg: SparsityConfig,
    kernel: NativeSparse | NativeSparseQuant | None, cache: Path | None = None, quant: tuple[int, int] | None = None,
    kernel_cache: Path | str | None = None, device: torch.device | None = None, masked: bool = True,
    decode_lib: ctypes.CDLL | None = None,
) -> tuple[int, dict[int, tuple[float, float]], bool]:  # fmt: skip
    """(tipping point, profile, from cache). A profile is cached per machine, threads, shape, dtype,
    target and block in `cache`, by default KERNEL_CACHE/sparse-profiles.json (`kernel_cache`:
    RuntimeConfig.kernel_cache, None: ~/.cache/moetier); an unwritable cache only costs the re-measure."""
    path = cache or native.cache_root(kernel_cache) / "sparse-profiles.json"
    build = kernel.build_key if kernel is not None else "torch"
    key = _profile_key(hidden, inter, dtype, cfg.target, cfg.block, build, quant, device, masked,
                       decode_lib is not None)  # fmt: skip
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
    profile = tipping_profile(hidden, inter, dtype, act, cfg.target, cfg.block, kernel, quant=quant, device=device,
                              masked=masked, decode_lib=decode_lib)  # fmt: skip
    stored[key] = {str(c): list(v) for c, v in profile.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return tipping_point(profile), profile, False
