"""kernels/matmul: the small-row kernel chosen per call, never by flipping oneDNN's process-wide flag.

- `gemv_linear` (ATen's native bf16 GEMV, one call per row) equals F.linear with oneDNN off bit for
  bit, for 1 and 2 rows, 1-D/2-D/3-D x, weights with padded rows; and both are within bf16 rounding
  of a float64 reference;
- `linear` picks the GEMV exactly for 1-2 bf16 rows without bias where oneDNN would take the product,
  F.linear otherwise, and its result always equals F.linear with oneDNN off;
- no forward through kernels/ (expert functions, generic quantized format, masked dense, gather in
  torch) reads a changed flag or calls its setter, also from two threads at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from moetier.kernels import matmul
from moetier.kernels.experts import GptOssGLU, SwiGLU
from moetier.kernels.sparse import masked_dense, sparse_torch

BF16 = torch.bfloat16
SHAPES = [(512, 1024), (1024, 256), (40, 96), (7, 33)]  # w [N, K]


def native_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with oneDNN off: ATen's native path (today's small-row kernel). Only the test flips it."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, w, bias)
    finally:
        torch._C._set_mkldnn_enabled(before)


def within_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|y - x @ w.T| within one bf16 rounding of the result plus fp32 accumulation error (float64 ref)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    tol = 2.0**-8 * ref.abs() + x.shape[-1] * 2.0**-23 * mag + 1e-30
    return bool(((y.double() - ref).abs() <= tol).all())


@pytest.fixture(scope="module")
def gemv() -> Iterator[None]:
    if matmul.native_gemv() is None:
        cap = torch.backends.cpu.get_cpu_capability()
        pytest.skip(f"ATen's bf16 GEMV is not in this torch's dispatch table (CPU capability {cap})")
    yield


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_equals_native_flinear_and_float64(gemv: None, n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g).to(BF16)
    x = torch.randn(rows, k, generator=g).to(BF16)
    y = matmul.gemv_linear(x, w)
    assert y.shape == (rows, n) and y.dtype == BF16
    assert torch.equal(y, native_reference(x, w))
    assert within_bf16(y, x, w)


def test_gemv_shapes_strides_and_views(gemv: None) -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 160, generator=g).to(BF16)
    w = big[:, :96]  # rows of 96 at a stride of 160 (a slice of a slot)
    x3 = torch.randn(1, 2, 96, generator=g).to(BF16)  # [B, T, K]
    assert torch.equal(matmul.gemv_linear(x3, w), native_reference(x3, w))
    x1 = x3[0, 1]  # [K]
    y1 = matmul.gemv_linear(x1, w)
    assert y1.shape == (64,) and torch.equal(y1, native_reference(x1, w))
    xs = torch.randn(96, 2, generator=g).to(BF16).t()  # [2, K], non-contiguous rows
    assert torch.equal(matmul.gemv_linear(xs, w), native_reference(xs, w))
    for bad_x, bad_w in [(x3.float(), w.float()), (torch.randn(3, 96).to(BF16), w), (x1, w.t().contiguous().t())]:
        assert not matmul.gemv_fits(bad_x, bad_w)
        with pytest.raises(ValueError, match="do not fit"):
            matmul.gemv_linear(bad_x, bad_w)


CASES = {
    "1 row": (1, BF16, False, False),
    "2 rows": (2, BF16, False, False),
    "3 rows": (3, BF16, False, False),
    "bias": (1, BF16, True, False),
    "fp32": (1, torch.float32, False, False),
    "transposed weight": (1, BF16, False, True),
}


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN-CPU", "other-CPU"])
@pytest.mark.parametrize("case", CASES)
def test_linear_chooses_per_call(monkeypatch: pytest.MonkeyPatch, case: str, onednn: bool) -> None:
    """Where oneDNN would take bf16 (forced here on any CPU), 1-2 bias-free rows go to the GEMV; all else,
    and every call on other CPUs, is F.linear; the result is F.linear with oneDNN off either way."""
    rows, dtype, bias, transposed = CASES[case]
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 80, generator=g).to(dtype)
    if transposed:
        w = w.t().contiguous().t()  # [N, K] view of a [K, N] matrix: rows not contiguous
    x = torch.randn(rows, 80, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    want_gemv = onednn and rows <= 2 and dtype == BF16 and not bias and not transposed
    if want_gemv and matmul.native_gemv() is None:
        pytest.skip("ATen's bf16 GEMV is not in this torch's dispatch table")
    monkeypatch.setattr(matmul, "onednn_takes_bf16", lambda: onednn)
    calls = {"gemv": 0, "F.linear": 0}
    real_rows, real_linear = matmul._gemv_rows, F.linear

    def count_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls["gemv"] += 1
        return real_rows(x, w)

    def count_linear(*args: object) -> torch.Tensor:
        calls["F.linear"] += 1
        return real_linear(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(matmul, "_gemv_rows", count_rows)
    monkeypatch.setattr(matmul.F, "linear", count_linear)
    with torch.inference_mode():
        y = matmul.linear(x, w, b)
    assert calls == ({"gemv": 1, "F.linear": 0} if want_gemv else {"gemv": 0, "F.linear": 1})
    assert torch.equal(y, native_reference(x, w, b))


def test_linear_keeps_autograd_on_flinear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "onednn_takes_bf16", lambda: True)
    w = torch.randn(16, 32).to(BF16).requires_grad_()
    x = torch.randn(1, 32).to(BF16)
    assert not matmul.gemv_fits(x, w)
    matmul.linear(x, w).float().sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


def _forwards(seed: int) -> list[torch.Tensor]:
    """One token through every kernels/ path the small-row choice covers (bf16, CPU)."""
    g = torch.Generator().manual_seed(seed)
    h, i = 64, 32
    w13 = (torch.randn(2 * i, h, generator=g) * 0.1).to(BF16)
    down = (torch.randn(i, h, generator=g) * 0.1).to(BF16)  # down rows [I, H]
    b13 = (torch.randn(2 * i, generator=g) * 0.1).to(BF16)
    b2 = (torch.randn(h, generator=g) * 0.1).to(BF16)
    x = torch.randn(1, h, generator=g).to(BF16)

    class Views:
        pass

    v = Views()
    v.w13, v.w2, v.b13, v.b2 = w13, down.t().contiguous(), b13, b2  # type: ignore[attr-defined]
    return [
        SwiGLU(F.silu)(x, v),
        GptOssGLU(alpha=1.702, limit=7.0)(x, v),
        masked_dense(x, w13, down.t(), F.silu, 0.05, 1)[0],
        sparse_torch(x, w13, down, F.silu, 0.05, 1)[0],
        matmul.linear(x, w13),
    ]


def test_forwards_never_touch_the_onednn_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads run forwards while a third watches the flag; the setter must never be called."""
    before = torch._C._get_mkldnn_enabled()
    setter_calls: list[bool] = []
    monkeypatch.setattr(torch._C, "_set_mkldnn_enabled", lambda on: setter_calls.append(on))
    monkeypatch.setattr(matmul, "onednn_takes_bf16", lambda: True)  # the GEMV path, on any CPU
    stop = threading.Event()
    seen: set[bool] = set()
    errors: list[BaseException] = []

    def watch() -> None:
        while not stop.is_set():
            seen.add(torch._C._get_mkldnn_enabled())

    def work(seed: int) -> None:
        try:
            with torch.inference_mode():
                for _ in range(50):
                    _forwards(seed)
        except BaseException as exc:  # reported below
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    workers = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors
    assert setter_calls == []
    assert seen == {before} and torch._C._get_mkldnn_enabled() == before
    assert torch.backends.mkldnn.enabled == before
