"""Plain-weight matmuls, with the kernel chosen per call for decode's one- and two-row products.

Why: for one or two rows of bf16 activations on CPU, ATen's oneDNN path (which ATen takes for bf16
products on CPUs with AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX while `torch.backends.mkldnn` is
enabled) re-lays the weight out into its blocked format on every call, which costs more than the
product; ATen's own bf16 GEMV reads the weight as it is. Measured on this project's reference CPU
(AVX-512 bf16, one thread, 64 cache-cold expert matrices of 512x1024): 10.1 ms with oneDNN, 4.5 ms
native; from 4 rows up oneDNN wins. Every ATen entry point of a bf16 product (linear, mm, addmm,
matmul, mv, addmv, dot, bmm) asks the process-wide `userEnabledMkldnn()` flag, so no ATen op reaches
the native kernel per call, and flipping that flag around a call changes it for every thread.

How: `linear` calls ATen's native kernel itself where oneDNN would take the product (bf16, CPU,
1-2 rows, `onednn_takes_bf16()` and the flag on, which is only read): `bf16_gemv_trans` for the
running CPU capability, read from libtorch_cpu's exported dispatch table
(`DispatchStub<...>::AVX512/AVX2/DEFAULT`). It is the function ATen's native path (oneDNN off) runs
for one row; for two rows ATen runs the same dot product per (row, output), so one GEMV per row
gives the same bits. The entry's mangled name spells the kernel's full C++ signature, so a torch
whose kernel changed shape has no such entry and `linear` falls back to F.linear; one whose kernel
changed meaning fails the self-check run once when the entry is read. Everywhere else (CPUs where
oneDNN never takes bf16, such as AVX2-only ones, where F.linear already is the native path; other
dtypes; CUDA; 3+ rows; weights whose rows are not contiguous; autograd) `linear` is F.linear. A
bias also takes F.linear: ATen adds it in fp32 before rounding once, which the bf16-out GEMV cannot
(so biased 1-2 row products still go to oneDNN where oneDNN takes bf16).

Invariants: the result equals F.linear with oneDNN off bit for bit (tests/kernels/test_matmul.py
checks it, and both against float64); nothing here reads or writes a process-wide flag; the native
call releases the GIL (ctypes) and parallelises over outputs with torch's intra-op threads, like
ATen's own call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

NATIVE_MAX_ROWS = 2  # from 4 rows up oneDNN's blocked GEMM beats the GEMV (reference CPU)
_BF16_ONE = 0x3F80  # bfloat16 bits of 1.0 (alpha)
# DispatchStub<void (*)(int m, int n, BFloat16 alpha, const BFloat16* a, int lda, const BFloat16* x,
#   int incx, BFloat16 beta, BFloat16* y, int incy), bf16_gemv_trans_stub>::<capability>
_GEMV_SYMBOL = (
    "_ZN2at6native12DispatchStubIPFviiN3c108BFloat16EPKS3_iS5_iS3_PS3_iE"
    "NS0_42bf16_gemv_trans_stub_DECLARE_DISPATCH_typeEE{n}{cap}E"
)
_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")  # x86 dispatch levels, lowest first
_P, _I, _U16 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint16
_GemvFn = Callable[[int, int, int, int, int, int, int, int, int, int], None]
_INT_MAX = 2**31 - 1


def _read_gemv() -> _GemvFn | None:
    """ATen's bf16 GEMV kernel for the running capability (DispatchStub's choice: the highest level
    not above the CPU's that has a kernel), or None where the table has no such entry."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in _CAPABILITIES:
        return None  # aarch64, POWER, s390x: other dispatch members
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None
    for level in reversed(_CAPABILITIES[: _CAPABILITIES.index(cap) + 1]):
        try:
            ptr = ctypes.c_void_p.in_dll(lib, _GEMV_SYMBOL.format(n=len(level), cap=level)).value
        except ValueError:
            return None  # another torch: the kernel's signature (hence its mangled name) changed
        if ptr:
            proto = ctypes.CFUNCTYPE(None, _I, _I, _U16, _P, _I, _P, _I, _U16, _P, _I)
            return proto(ptr)
    return None


def _self_check(gemv: _GemvFn) -> bool:
    """The kernel computes x @ w.T here: checked once against float64 at bf16 tolerance."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen).to(torch.bfloat16)  # [N, K]
    x = torch.randn(1, 96, generator=gen).to(torch.bfloat16)  # [1, K]
    y = torch.full((1, 40), float("nan"), dtype=torch.bfloat16)
    gemv(96, 40, _BF16_ONE, w.data_ptr(), 96, x.data_ptr(), 1, 0, y.data_ptr(), 1)
    ref = x.double() @ w.double().T
    return bool(torch.isfinite(y).all()) and float((y.double() - ref).abs().max()) <= 0.02 * float(ref.abs().max())


@functools.cache
def native_gemv() -> _GemvFn | None:
    """ATen's native bf16 GEMV (read once per process), or None where it cannot be had."""
    gemv = _read_gemv()
    return gemv if gemv is not None and _self_check(gemv) else None


@functools.cache
def onednn_takes_bf16() -> bool:
    """Whether ATen hands bf16 CPU products to oneDNN here while torch.backends.mkldnn is enabled
    (torch built with oneDNN, a CPU with its bf16 ISA: AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def gemv_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv_linear(x, w)` can compute x @ w.T: 1-2 rows of bf16 on CPU, w [N, K] bf16 with
    contiguous rows, no autograd, and ATen's kernel found."""
    k = x.shape[-1] if x.dim() else 0
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.is_cpu
        and w.is_cpu
        and w.dim() == 2
        and 0 < k == w.shape[1]
        and 0 < x.numel() <= NATIVE_MAX_ROWS * k
        and 0 < w.shape[0] <= _INT_MAX
        and w.stride(1) == 1
        and k <= w.stride(0) <= _INT_MAX
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and native_gemv() is not None
    )


def gemv_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] (1-2 rows, bf16) @ w [N, K].T -> [..., N] by ATen's native bf16 GEMV, one call per
    row: bit for bit F.linear with oneDNN off. ValueError unless `gemv_fits(x, w)`."""
    if not gemv_fits(x, w):
        raise ValueError(f"gemv_linear: x {x.dtype} {list(x.shape)}, w {w.dtype} {list(w.shape)} do not fit")
    return _gemv_rows(x, w)


def _gemv_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gemv = native_gemv()
    assert gemv is not None
    n, k = w.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K], M <= 2
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x.new_empty((*x.shape[:-1], n))  # [..., N] bf16, contiguous: row r at r * N
    xp, x_step, yp, wp, lda = x2.data_ptr(), 2 * x2.stride(0), y.data_ptr(), w.data_ptr(), w.stride(0)
    for r in range(x2.shape[0]):
        gemv(k, n, _BF16_ONE, wp, lda, xp + r * x_step, 1, 0, yp + 2 * n * r, 1)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ bias [N]) -> [..., N], F.linear's math with the kernel chosen for this
    call: ATen's native GEMV for 1-2 bf16 rows on CPU where oneDNN would otherwise take the product
    (the flag is only read), F.linear otherwise."""
    if (
        bias is None
        and x.dtype == torch.bfloat16
        and onednn_takes_bf16()
        and torch._C._get_mkldnn_enabled()
        and gemv_fits(x, w)
    ):
        return _gemv_rows(x, w)
    return F.linear(x, w, bias)
