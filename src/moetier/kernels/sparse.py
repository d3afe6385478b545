"""Threshold tables and sparse SwiGLU execution (intra-expert activation sparsity).

**Table** (`ThresholdTable`): per MoE layer and mask block size, the thresholds on |act(gate x)|
of routed experts for the targets 0, 0.05, ..., 0.95, calibrated by `moetier calibrate`. Stored as
JSON, by default at MODEL/moetier-sparsity/thresholds.json, with the model's fingerprint so a
table from another checkpoint is refused.

**Execution** of routed SwiGLU experts with a threshold t, all with the same semantics
(per token: a = act(x Wg^T); neurons with |a| < t, or whole blocks with none >= t, contribute 0):
- `NativeSparse`: the gather path, one C call per layer call (csrc/sparse_swiglu.c) for the
  experts that run sparse: each gate row read once, only active up and down rows after that;
- `sparse_torch`: the same gather path in torch ops, for where the kernel is missing (no
  compiler, CUDA: unverified here, activations other than SiLU);
- `masked_dense`: the dense matmuls with the mask applied, for calls with many tokens, where
  contiguous matmuls beat gathers (with it the dense/sparse switch never changes the result's math);
- `dense_original`: the unmasked expert on dequantised weights (the paper's dense path above the
  switch, for quantized rows; full-precision slots use the layer's own expert function).

The torch paths' products with the weight as [out, in] rows go through `matmul.linear` (the
small-row kernel chosen per call); the down product of the gather path (x @ rows [k, H]) is a plain
matmul.

A kernel call accumulates in fp32 and writes its output once; when a layer call is split into
chunks (a compute tier that cannot pin all its experts at once), chunks add up in the output's
dtype.

Sparse execution needs the down projection stored as rows [I, H] (ExpertLayout.down_rows): the
slot is gate rows | up rows | down rows, each neuron's weights a contiguous row of H.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.config import SPARSITY_BLOCKS
from moetier.errors import ConfigError
from moetier.formats.quant import dequantize_into
from moetier.kernels import matmul, native
from moetier.kernels.qformat import QExpertViews
from moetier.policies.sparsity import TARGETS, interpolate

TABLE_FORMAT = "moetier-sparsity-table"
TABLE_VERSION = 1
DEFAULT_DIR = "moetier-sparsity"
DEFAULT_NAME = "thresholds.json"


def default_table_path(model_dir: str | os.PathLike[str]) -> Path:
    return Path(model_dir) / DEFAULT_DIR / DEFAULT_NAME


# --------------------------------------------------------------------------- table


@dataclass
class ThresholdTable:
    """layer -> block -> thresholds per target (TARGETS), plus what it was calibrated on."""

    model: dict[str, Any]  # identity: family, hidden_size, moe_intermediate, num_experts, moe_layers, fingerprint
    activation: str
    calibration: dict[str, Any]  # text, sha256, tokens, pairs per layer
    thresholds: dict[int, dict[int, list[float]]]
    targets: tuple[float, ...] = TARGETS
    shared_dense: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def threshold(self, layer: int, target: float, block: int = 1) -> float:
        if layer not in self.thresholds:
            raise ConfigError(f"the sparsity table has no MoE layer {layer} (it has {sorted(self.thresholds)})")
        row = self.thresholds[layer].get(block)
        if row is None:
            raise ConfigError(
                f"the sparsity table has no thresholds for blocks of {block} neurons "
                f"(it has {sorted(self.thresholds[layer])}); recalibrate with this moetier version"
            )
        try:
            return interpolate(self.targets, row, target)
        except ValueError as exc:
            raise ConfigError(f"sparsity table: {exc}; recalibrate with `moetier calibrate`") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TABLE_FORMAT, "version": TABLE_VERSION, "model": self.model, "activation": self.activation,
            "shared_experts": "dense" if self.shared_dense else "sparse", "calibration": self.calibration,
            "targets": list(self.targets),
            "thresholds": {str(layer): {str(b): row for b, row in rows.items()}
                           for layer, rows in sorted(self.thresholds.items())},
        } | self.extra  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        if out.is_dir():
            raise ConfigError(f"sparsity table path {out} is a directory; give a file name, e.g. {out / DEFAULT_NAME}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ThresholdTable:
        src = Path(path)
        if not src.is_file():
            raise ConfigError(f"no sparsity table at {src}; run `moetier calibrate MODEL --text FILE` first")
        try:
            raw = json.loads(src.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{src}: not a sparsity table (invalid JSON: {exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != TABLE_FORMAT:
            raise ConfigError(f"{src}: not a moetier sparsity table (no format {TABLE_FORMAT!r})")
        if raw.get("version") != TABLE_VERSION:
            raise ConfigError(f"{src}: sparsity table version {raw.get('version')}, this moetier reads {TABLE_VERSION}")
        try:
            targets = tuple(float(t) for t in raw["targets"])
            thresholds = {
                int(layer): {int(b): [float(v) for v in row] for b, row in rows.items()}
                for layer, rows in raw["thresholds"].items()
            }
            table = cls(
                model=dict(raw["model"]), activation=str(raw["activation"]), calibration=dict(raw["calibration"]),
                thresholds=thresholds, targets=targets, shared_dense=raw.get("shared_experts", "dense") == "dense",
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{src}: malformed sparsity table ({type(exc).__name__}: {exc})") from exc
        table._check(src)
        return table

    def _check(self, src: Path) -> None:
        if not self.targets or self.targets[0] != 0 or list(self.targets) != sorted(self.targets):
            raise ConfigError(f"{src}: targets must start at 0 and increase, got {list(self.targets)}")
        for layer, rows in self.thresholds.items():
            for b, row in rows.items():
                if b not in SPARSITY_BLOCKS:
                    raise ConfigError(f"{src}: layer {layer} has block size {b}, not one of {SPARSITY_BLOCKS}")
                bad = len(row) != len(self.targets) or any(not math.isfinite(v) or v < 0 for v in row)
                if bad or row != sorted(row):
                    raise ConfigError(
                        f"{src}: layer {layer} block {b}: thresholds must be {len(self.targets)} finite, "
                        "non-negative, non-decreasing numbers"
                    )

    def check_model(self, identity: dict[str, Any], src: str | os.PathLike[str]) -> None:
        """Refuse a table calibrated on another model (or another version of the weights)."""
        for key in ("family", "hidden_size", "moe_intermediate", "num_experts", "moe_layers", "fingerprint"):
            want, have = identity.get(key), self.model.get(key)
            if key == "moe_layers":
                want, have = list(want or []), list(have or [])
            if want != have:
                raise ConfigError(
                    f"{src}: sparsity table was calibrated for another model ({key} is {have}, this model's is "
                    f"{want}); recalibrate with `moetier calibrate`"
                )


# --------------------------------------------------------------------------- execution


def block_mask(a: torch.Tensor, threshold: float, block: int) -> torch.Tensor:
    """a [N, I] activations -> bool mask [N, I]: |a| >= t, or per block of `block` neurons any."""
    on = a.abs().float() >= threshold  # fp32 compare: a bf16 one would round the threshold first
    if block == 1:
        return on
    n, i = a.shape
    return on.view(n, i // block, block).any(-1, keepdim=True).expand(n, i // block, block).reshape(n, i)


def masked_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
    threshold: float, block: int,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """x [N, H], w13 [2I, H], w2 [H, I] (any strides) -> (y [N, H], active (token, neuron) pairs)."""
    h = matmul.linear(x, w13)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)
    a = act(gate)  # [N, I]
    m = block_mask(a, threshold, block)
    return matmul.linear(a * m * up, w2), int(m.sum())


def dense_original(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The unmasked expert on plain weights: x [N, H], w13 [2I, H], w2 [H, I] (any strides) -> y [N, H]
    (kernels/experts.py SwiGLU's math, for weights that are dequantised copies)."""
    gate, up = matmul.linear(x, w13).chunk(2, dim=-1)  # [N, I] each
    return matmul.linear(act(gate) * up, w2)


def sparse_torch(
    x: torch.Tensor, w13: torch.Tensor, down_rows: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
    threshold: float, block: int,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The gather path in torch ops: x [N, H], w13 [2I, H], down_rows [I, H] -> (y [N, H], pairs)."""
    i = down_rows.shape[0]
    a = act(matmul.linear(x, w13[:i]))  # [N, I], gate rows only
    m = block_mask(a, threshold, block)
    idx = m.any(0).nonzero().squeeze(1)  # [k] union of active neurons over the tokens
    u = matmul.linear(x, w13[i:].index_select(0, idx))  # [N, k], gathered up rows
    h = (a * m).index_select(1, idx) * u  # [N, k]
    return h @ down_rows.index_select(0, idx), int(m.sum())  # [N, H]


class _Scratch(threading.local):
    """Per-thread fp32/int32 buffers of the native call, grown as needed (never shrunk)."""

    def __init__(self) -> None:
        self.f32 = torch.empty(0)
        self.i32 = torch.empty(0, dtype=torch.int32)

    def get(self, n_f32: int, n_i32: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.f32.numel() < n_f32:
            self.f32 = torch.empty(max(n_f32, 2 * self.f32.numel()))
        if self.i32.numel() < n_i32:
            self.i32 = torch.empty(max(n_i32, 2 * self.i32.numel()), dtype=torch.int32)
        return self.f32, self.i32


_I64, _I32, _F32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float


def _check_call(
    hidden: int, inter: int, dtype: torch.dtype, x: torch.Tensor, out: torch.Tensor, n_exp: int,
    tokens: Sequence[int], weights: Sequence[float], starts: Sequence[int], block: int, mask_out: torch.Tensor | None,
) -> None:  # fmt: skip
    """Refuse what would make the C code read or write out of bounds, or drop neurons."""
    n_tok, h = x.shape
    if h != hidden or x.dtype != dtype or out.dtype != dtype or out.shape != x.shape:
        raise ValueError(f"native sparse: x {x.dtype} {list(x.shape)} / out {out.dtype} {list(out.shape)} do "
                         f"not fit experts of hidden size {hidden} in {dtype}")  # fmt: skip
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("native sparse: x and out must be contiguous")
    pairs = len(tokens)
    if block < 1 or inter % block:
        raise ValueError(f"native sparse: block {block} does not divide the expert size {inter}")
    if len(starts) != n_exp + 1 or starts[0] != 0 or starts[-1] != pairs or len(weights) != pairs:
        raise ValueError(f"native sparse: {n_exp} experts need {n_exp + 1} starts from 0 to {pairs} pairs")
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"native sparse: starts must not decrease, got {list(starts)}")
    if pairs and (min(tokens) < 0 or max(tokens) >= n_tok):
        raise ValueError(f"native sparse: token ids must be in [0, {n_tok}), got {min(tokens)}..{max(tokens)}")
    if mask_out is not None and (
        mask_out.dtype != torch.uint8 or mask_out.numel() < pairs * inter or not mask_out.is_contiguous()
    ):
        raise ValueError(f"mask_out must be a contiguous uint8 tensor of at least {pairs * inter} elements")


class NativeSparse:
    """The C kernel for one expert shape and dtype (SiLU SwiGLU; bf16 or fp32 weights on CPU)."""

    def __init__(self, lib: ctypes.CDLL, hidden: int, inter: int, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the native sparse kernel takes bf16 or fp32 weights, not {dtype}")
        self.fn = lib.moetier_sparse_moe_bf16 if dtype == torch.bfloat16 else lib.moetier_sparse_moe_f32
        self.build_key = native.build_key_of(lib)  # which build computes (tipping profiles are keyed by it)
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self._scratch = _Scratch()

    @staticmethod
    def address(views: Any) -> int:
        """What the kernel takes of one expert: its slot's address (gate | up | down rows)."""
        return int(views.row.data_ptr())

    def __call__(
        self, x: torch.Tensor, slots: Sequence[int], tokens: Sequence[int], weights: Sequence[float],
        starts: Sequence[int], out: torch.Tensor, threshold: float, block: int, accumulate: bool = False,
        mask_out: torch.Tensor | None = None,
    ) -> int:  # fmt: skip
        """out [T, H] (=, or += with accumulate) the sum over experts e of, for each of its pairs j in
        starts[e]:starts[e+1], weights[j] * expert_e(x[tokens[j]]). `slots` are the experts' slot
        addresses (gate | up | down rows). x and out: contiguous [T, H] of the kernel's dtype.
        mask_out, uint8 [pairs, I], receives the masks. Returns the active (pair, neuron) count."""
        _check_call(self.hidden, self.inter, self.dtype, x, out, len(slots), tokens, weights, starts, block, mask_out)
        n_tok, h = x.shape
        n_exp, pairs, i = len(slots), len(tokens), self.inter
        f32, i32 = self._scratch.get(2 * n_tok * h + pairs * i, n_exp * (i // block))
        return int(
            self.fn(
                x.data_ptr(), n_tok, h, i, block, threshold, n_exp, (_I64 * n_exp)(*slots),
                (_I64 * (n_exp + 1))(*starts), (_I32 * pairs)(*tokens), (_F32 * pairs)(*weights),
                out.data_ptr(), int(accumulate), mask_out.data_ptr() if mask_out is not None else None,
                f32.data_ptr(), f32.data_ptr() + 4 * (2 * n_tok * h), i32.data_ptr(),
                f32.data_ptr() + 4 * (n_tok * h), torch.get_num_threads(),
            )
        )  # fmt: skip


class NativeSparseQuant:
    """The C kernel for quantized experts in the rows layout (`moetier quantize --for-sparsity`): every
    matrix row-major [rows, H], quantised along H in groups of `group`, `bits` 8, 4 or 2. int4 rows under
    bf16 activations (groups a multiple of 32) take the integer path: gate and up rows by mm.c's integer
    dot products against x quantised to int8 per block of 32 (as the dense int4 experts read it), the down
    rows of a few tokens together with their up rows; the others dequantise rows to fp32."""

    def __init__(self, lib: ctypes.CDLL, hidden: int, inter: int, dtype: torch.dtype, bits: int, group: int) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the native sparse kernel takes bf16 or fp32 activations, not {dtype}")
        if bits not in (8, 4, 2) or group < 1 or hidden % group or group % (8 // bits):
            raise ValueError(f"native sparse: {bits}-bit groups of {group} do not fit rows of {hidden}")
        self.fn, self.qbytes = lib.moetier_sparse_moe_quant, lib.moetier_sparse_quant_qbytes
        self.build_key = native.build_key_of(lib)
        self.hidden, self.inter, self.dtype, self.bits, self.group = hidden, inter, dtype, bits, group
        self._scratch = _Scratch()
        self._addresses: dict[int, tuple[Any, tuple[int, ...]]] = {}  # id(views) -> (views, addresses)

    def address(self, views: Any) -> tuple[int, ...]:
        """What the kernel takes of one expert: (w13 q, scale, zero, w2 q, scale, zero) addresses. Remembered per
        views object (a pool slot's views are built once: six data_ptr calls a decode expert cost about 5 us); the
        entry holds the views, so its id is never reused for another object while remembered."""
        got = self._addresses.get(id(views))
        if got is None or got[0] is not views:
            got = (views, tuple(t.data_ptr() for w in (views.w13, views.w2) for t in (w.q, w.scale, w.zero)))
            if len(self._addresses) >= 1 << 16:  # more views than any store holds: start over
                self._addresses.clear()
            self._addresses[id(views)] = got
        return got[1]

    def __call__(
        self, x: torch.Tensor, experts: Sequence[Sequence[int]], tokens: Sequence[int], weights: Sequence[float],
        starts: Sequence[int], out: torch.Tensor, threshold: float, block: int, accumulate: bool = False,
        mask_out: torch.Tensor | None = None,
    ) -> int:  # fmt: skip
        """As NativeSparse.__call__; `experts[e]` = (w13 q, scale, zero, w2 q, scale, zero) addresses."""
        _check_call(self.hidden, self.inter, self.dtype, x, out, len(experts), tokens, weights, starts, block,
                    mask_out)  # fmt: skip
        if any(len(a) != 6 for a in experts):
            raise ValueError("native sparse: each quantized expert needs 6 addresses (w13, w2: q, scale, zero)")
        n_tok, h = x.shape
        n_exp, pairs, i, threads = len(experts), len(tokens), self.inter, torch.get_num_threads()
        qbytes = int(self.qbytes(int(x.dtype == torch.bfloat16), h, i, self.bits, self.group, n_tok, pairs, threads))
        f32, i32 = self._scratch.get(2 * n_tok * h + pairs * i + threads * h + (qbytes + 64) // 4, n_exp * (i // block))
        base = f32.data_ptr()
        qbuf = -(-(base + 4 * (2 * n_tok * h + pairs * i + threads * h)) // 64) * 64 if qbytes else None
        return int(
            self.fn(
                x.data_ptr(), int(x.dtype == torch.bfloat16), n_tok, h, i, block, threshold, self.bits, self.group,
                n_exp, (_I64 * (6 * n_exp))(*[a for e in experts for a in e]), (_I64 * (n_exp + 1))(*starts),
                (_I32 * pairs)(*tokens), (_F32 * pairs)(*weights), out.data_ptr(), int(accumulate),
                mask_out.data_ptr() if mask_out is not None else None, base, base + 4 * (2 * n_tok * h),
                i32.data_ptr(), base + 4 * (n_tok * h), base + 4 * (2 * n_tok * h + pairs * i), qbuf, threads,
            )
        )  # fmt: skip


def dense_weights(views: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I] view, down rows [I, H]) in `dtype`: the slot's own tensors at full
    precision, dequantised copies for a quantized expert in the rows layout."""
    if isinstance(views, QExpertViews):
        w13, w2 = views.w13, views.w2
        d13 = torch.empty((w13.n, w13.k), dtype=dtype, device=w13.q.device)
        d2 = torch.empty((w2.n, w2.k), dtype=dtype, device=w2.q.device)
        assert w13.zero is not None and w2.zero is not None and w13.scale is not None and w2.scale is not None
        dequantize_into(w13.q, w13.scale, w13.zero, w13.bits, d13)
        dequantize_into(w2.q, w2.scale, w2.zero, w2.bits, d2)
        return d13, d2.t(), d2
    return views.w13, views.w2, views.down_rows


def native_kernel(
    hidden: int, inter: int, dtype: torch.dtype, device: torch.device, quant: tuple[int, int] | None = None,
    enabled: bool = True, cache_dir: Path | str | None = None,
) -> NativeSparse | NativeSparseQuant | None:  # fmt: skip
    """The native kernel for this shape: for full-precision slots, or for quantized rows when `quant` =
    (bits, group); None on CUDA, for other dtypes, when `enabled` (RuntimeConfig.native_kernels) is
    False, or without a compiler (see native.load_error(enabled, cache_dir)). `cache_dir` is
    RuntimeConfig.kernel_cache (None: ~/.cache/moetier)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    lib = native.load(enabled, cache_dir)
    if lib is None:
        return None
    if quant is None:
        return NativeSparse(lib, hidden, inter, dtype)
    return NativeSparseQuant(lib, hidden, inter, dtype, *quant)
