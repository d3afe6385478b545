"""Sparse SwiGLU execution against a float64 reference: the native C kernel (NativeSparse), the gather
path in torch ops (sparse_torch) and the masked dense path (masked_dense), plus building the kernel.

Reference, per (token x, expert): a = silu(x Wg^T) [I]; m = |a| >= thr, or with block > 1 per block of
`block` neurons, on if any neuron of the block is; y = (m * a * (x Wu^T)) @ Wd_rows; out[t] = sum over
the token's pairs of w * y. A slot is gate rows [I, H] | up rows [I, H] | down rows [I, H].
Masks are compared except where the (block's largest) |a| lies within 1e-3 relative of the threshold,
where fp32 and float64 may legitimately disagree.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetier.kernels import native
from moetier.kernels.sparse import NativeSparse, block_mask, masked_dense, native_kernel, sparse_torch

H = 64
BAND = 1e-3  # relative distance to the threshold inside which masks may differ


@dataclass
class Case:
    """E experts as one contiguous [E, 3I, H] buffer (a slot per expert) and their routed pairs."""

    slots: torch.Tensor  # [E, 3I, H] in the kernel's dtype
    x: torch.Tensor  # [T, H]
    tokens: list[list[int]]  # per expert, its tokens (ascending)
    weights: list[list[float]]  # per expert, the router weights of its pairs

    @property
    def inter(self) -> int:
        return self.slots.shape[1] // 3

    @property
    def flat(self) -> tuple[list[int], list[float], list[int]]:
        toks = [t for ts in self.tokens for t in ts]
        ws = [w for w_e in self.weights for w in w_e]
        starts = [0]
        for ts in self.tokens:
            starts.append(starts[-1] + len(ts))
        return toks, ws, starts

    def ptrs(self) -> list[int]:
        return [self.slots[e].data_ptr() for e in range(self.slots.shape[0])]


def make_case(inter: int, dtype: torch.dtype, seed: int = 0, hidden: int = H) -> Case:
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randn(4, 3 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    x = torch.randn(8, hidden, generator=gen).to(dtype)
    # different token sets (token 7 is routed nowhere), different weights
    tokens = [[0, 2, 5], [1], [0, 1, 2, 3, 4, 5, 6], [3, 6]]
    weights = [torch.rand(len(ts), generator=gen).add(0.1).tolist() for ts in tokens]
    return Case(slots, x, tokens, weights)


def ref_acts(case: Case) -> list[torch.Tensor]:
    """Per expert: a [n_e, I] in float64."""
    i, x = case.inter, case.x.double()
    return [F.silu(x[ts] @ case.slots[e, :i].double().T) for e, ts in enumerate(case.tokens)]


def ref_masks(case: Case, thr: float, block: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per expert: (mask [n_e, I] bool, ambiguous [n_e, I] bool: the (block) magnitude is within BAND of thr)."""
    masks, ambiguous = [], []
    for a in ref_acts(case):
        n, i = a.shape
        mag = a.abs().view(n, i // block, block).amax(-1, keepdim=True).expand(n, i // block, block).reshape(n, i)
        masks.append(mag >= thr)
        ambiguous.append((mag - thr).abs() <= BAND * thr)
    return masks, ambiguous


def ref_out(case: Case, masks: list[torch.Tensor], t_total: int | None = None) -> torch.Tensor:
    """out [T, H] float64 with the given masks: sum over pairs of w * (m * a * (x Wu^T)) @ Wd_rows."""
    i, x = case.inter, case.x.double()
    out = torch.zeros(t_total or x.shape[0], x.shape[1], dtype=torch.float64)
    for e, (ts, ws) in enumerate(zip(case.tokens, case.weights, strict=True)):
        w = case.slots[e].double()
        a = F.silu(x[ts] @ w[:i].T)
        y = (masks[e].double() * a * (x[ts] @ w[i : 2 * i].T)) @ w[2 * i :]
        out.index_add_(0, torch.tensor(ts), y * torch.tensor(ws, dtype=torch.float64)[:, None])
    return out


def quantile_threshold(case: Case, block: int, q: float = 0.5) -> float:
    """The q-quantile of the (block) magnitudes, moved to the middle of the widest nearby gap so that
    as few values as possible sit at the threshold."""
    mags = []
    for a in ref_acts(case):
        n, i = a.shape
        mags.append(a.abs().view(n, i // block, block).amax(-1).flatten())
    v = torch.cat(mags).sort().values
    k = int(q * (v.numel() - 1))
    lo, hi = max(0, k - 8), min(v.numel() - 1, k + 8)
    j = max(range(lo, hi), key=lambda j: float(v[j + 1] / v[j]))
    return float((v[j] * v[j + 1]).sqrt())


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}


@pytest.fixture(scope="module")
def lib() -> Iterator[object]:
    got = native.load()
    if got is None:
        pytest.skip(f"native sparse kernel unavailable: {native.load_error()}")
    yield got


def run_kernel(
    kernel: NativeSparse, case: Case, thr: float, block: int, out: torch.Tensor | None = None, accumulate: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    toks, ws, starts = case.flat
    out = torch.zeros_like(case.x) if out is None else out
    mask = torch.full((len(toks), case.inter), 7, dtype=torch.uint8)
    active = kernel(case.x, case.ptrs(), toks, ws, starts, out, thr, block, accumulate=accumulate, mask_out=mask)
    return out, mask, active


def split_mask(case: Case, mask: torch.Tensor) -> list[torch.Tensor]:
    _, _, starts = case.flat
    return [mask[starts[e] : starts[e + 1]].bool() for e in range(len(case.tokens))]


# --- NativeSparse ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inter", "block"), [(48, 1), (48, 4), (48, 16), (64, 1), (64, 4), (64, 16)])
@pytest.mark.parametrize("q", [0.0, 0.5, 0.9])
def test_native_matches_reference(lib: object, dtype: torch.dtype, inter: int, block: int, q: float) -> None:
    case = make_case(inter, dtype, seed=inter + block)
    thr = quantile_threshold(case, block, q) if q > 0 else 0.0
    kernel = NativeSparse(lib, H, inter, dtype)  # type: ignore[arg-type]
    out, mask, active = run_kernel(kernel, case, thr, block)
    assert set(mask.unique().tolist()) <= {0, 1}
    masks, ambiguous = ref_masks(case, thr, block)
    got = split_mask(case, mask)
    for m_ref, amb, m in zip(masks, ambiguous, got, strict=True):
        assert torch.equal(m[~amb], m_ref[~amb])
        # block structure: every block all on or all off
        n = m.shape[0]
        blocks = m.view(n, inter // block, block)
        assert torch.equal(blocks.all(-1), blocks.any(-1))
    assert active == int(mask.sum())
    if q > 0:
        frac_off = 1 - active / mask.numel()
        assert 0 < frac_off < 1
        assert frac_off == pytest.approx(q, abs=0.15)
    # outputs: the reference with the kernel's own mask (identical outside the band), and the reference mask
    torch.testing.assert_close(out.double(), ref_out(case, got), **tol(dtype))
    if not any(bool(a.any()) for a in ambiguous):
        torch.testing.assert_close(out.double(), ref_out(case, masks), **tol(dtype))
    assert torch.equal(out[7], torch.zeros(H, dtype=dtype))  # a token routed nowhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_threshold_zero_is_dense(lib: object, dtype: torch.dtype) -> None:
    case = make_case(48, dtype, seed=3)
    kernel = NativeSparse(lib, H, 48, dtype)  # type: ignore[arg-type]
    out, mask, active = run_kernel(kernel, case, 0.0, 1)
    pairs = sum(len(ts) for ts in case.tokens)
    assert active == pairs * 48 and bool(mask.all())
    dense = ref_out(case, [torch.ones(len(ts), 48, dtype=torch.bool) for ts in case.tokens])
    torch.testing.assert_close(out.double(), dense, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_accumulate_adds(lib: object, dtype: torch.dtype) -> None:
    case = make_case(64, dtype, seed=5)
    kernel = NativeSparse(lib, H, 64, dtype)  # type: ignore[arg-type]
    thr = quantile_threshold(case, 4)
    fresh, _, active = run_kernel(kernel, case, thr, 4)
    prior = torch.randn(case.x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, _, active2 = run_kernel(kernel, case, thr, 4, out=prior.clone(), accumulate=True)
    assert active2 == active
    torch.testing.assert_close(out.double(), prior.double() + fresh.double(), **tol(dtype))
    assert torch.equal(out[7], prior[7])  # untouched where no pair lands
    # two chunks of experts, the second accumulating, equal one call over all of them
    toks, ws, starts = case.flat
    first = torch.zeros_like(case.x)
    n1 = kernel(case.x, case.ptrs()[:2], toks[: starts[2]], ws[: starts[2]], starts[:3], first, thr, 4)
    rest = [s - starts[2] for s in starts[2:]]
    n2 = kernel(case.x, case.ptrs()[2:], toks[starts[2] :], ws[starts[2] :], rest, first, thr, 4, accumulate=True)
    assert n1 + n2 == active
    torch.testing.assert_close(first.double(), fresh.double(), **tol(dtype))


@pytest.mark.parametrize(("threads", "hidden"), [(2, 64), (3, 40)])
def test_native_threads_split_columns(lib: object, threads: int, hidden: int) -> None:
    case = make_case(32, torch.float32, seed=11, hidden=hidden)
    kernel = NativeSparse(lib, hidden, 32, torch.float32)  # type: ignore[arg-type]
    thr = quantile_threshold(case, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, mask, active = run_kernel(kernel, case, thr, 1)
    finally:
        torch.set_num_threads(before)
    assert active == int(mask.sum())
    torch.testing.assert_close(out.double(), ref_out(case, split_mask(case, mask)), **tol(torch.float32))


def test_native_bad_arguments(lib: object) -> None:
    case = make_case(48, torch.float32)
    kernel = NativeSparse(lib, H, 48, torch.float32)  # type: ignore[arg-type]
    toks, ws, starts = case.flat
    out = torch.zeros_like(case.x)
    ptrs = case.ptrs()
    with pytest.raises(ValueError, match="do not fit"):
        kernel(case.x.to(torch.bfloat16), ptrs, toks, ws, starts, out, 0.1, 1)  # x wrong dtype
    with pytest.raises(ValueError, match="do not fit"):
        kernel(case.x[:, :32].contiguous(), ptrs, toks, ws, starts, out[:, :32].contiguous(), 0.1, 1)  # wrong H
    with pytest.raises(ValueError, match="do not fit"):
        kernel(case.x, ptrs, toks, ws, starts, out[:4], 0.1, 1)  # out shape
    with pytest.raises(ValueError, match="contiguous"):
        kernel(case.x.t().contiguous().t(), ptrs, toks, ws, starts, out, 0.1, 1)
    with pytest.raises(ValueError, match="starts"):
        kernel(case.x, ptrs, toks, ws, starts[:-1], out, 0.1, 1)
    with pytest.raises(ValueError, match="starts"):
        kernel(case.x, ptrs, toks, ws[:-1], starts, out, 0.1, 1)
    with pytest.raises(ValueError, match="mask_out"):
        kernel(case.x, ptrs, toks, ws, starts, out, 0.1, 1, mask_out=torch.zeros(len(toks), 48, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask_out"):
        kernel(case.x, ptrs, toks, ws, starts, out, 0.1, 1, mask_out=torch.zeros(len(toks), 47, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        NativeSparse(lib, H, 48, torch.float16)  # type: ignore[arg-type]
    # what would make the C code write out of bounds or drop neurons is refused before it runs
    with pytest.raises(ValueError, match="does not divide"):
        kernel(case.x, ptrs, toks, ws, starts, out, 0.1, 32)  # 48 % 32: the tail would be dropped
    with pytest.raises(ValueError, match="does not divide"):
        kernel(case.x, ptrs, toks, ws, starts, out, 0.1, 0)
    with pytest.raises(ValueError, match="token ids"):
        kernel(case.x, ptrs, [*toks[:-1], case.x.shape[0]], ws, starts, out, 0.1, 1)
    with pytest.raises(ValueError, match="token ids"):
        kernel(case.x, ptrs, [-1, *toks[1:]], ws, starts, out, 0.1, 1)
    if len(starts) > 2:
        bad = [starts[0], starts[2], starts[1], *starts[3:]]
        with pytest.raises(ValueError, match="must not decrease"):
            kernel(case.x, ptrs, toks, ws, bad, out, 0.1, 1)
    with pytest.raises(ValueError, match="mask_out"):
        mask = torch.zeros(48, len(toks), dtype=torch.uint8).t()  # right size, not contiguous
        kernel(case.x, ptrs, toks, ws, starts, out, 0.1, 1, mask_out=mask)
    assert bool((out == 0).all())  # nothing ran


def test_native_kernel_picks() -> None:
    if native.load() is None:
        assert native_kernel(H, 48, torch.float32, torch.device("cpu")) is None
    else:
        k = native_kernel(H, 48, torch.bfloat16, torch.device("cpu"))
        assert isinstance(k, NativeSparse) and (k.hidden, k.inter, k.dtype) == (H, 48, torch.bfloat16)
    assert native_kernel(H, 48, torch.float16, torch.device("cpu")) is None
    assert native_kernel(H, 48, torch.float32, torch.device("cuda")) is None


# --- torch paths -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("inter", "block"), [(48, 1), (48, 16), (64, 4)])
@pytest.mark.parametrize("q", [0.0, 0.5])
def test_torch_paths_match_reference(dtype: torch.dtype, inter: int, block: int, q: float) -> None:
    case = make_case(inter, dtype, seed=inter * block)
    thr = quantile_threshold(case, block, q) if q > 0 else 0.0
    masks, ambiguous = ref_masks(case, thr, block)
    i = inter
    for e, ts in enumerate(case.tokens):
        slot = case.slots[e]
        xe = case.x[ts]
        unit = Case(case.slots[e : e + 1], case.x, [ts], [[1.0] * len(ts)])
        want = ref_out(unit, [masks[e]])[ts]
        assert not bool(ambiguous[e].any())  # quantile_threshold keeps clear of every magnitude here
        for y, active in (
            sparse_torch(xe, slot[: 2 * i], slot[2 * i :], F.silu, thr, block),
            masked_dense(xe, slot[: 2 * i], slot[2 * i :].t(), F.silu, thr, block),  # w2 as a transposed view
        ):
            assert active == int(masks[e].sum())
            assert y.dtype == dtype
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-5)
        if q == 0:
            assert sparse_torch(xe, slot[: 2 * i], slot[2 * i :], F.silu, 0.0, block)[1] == len(ts) * i


def test_torch_paths_agree_with_native(lib: object) -> None:
    case = make_case(64, torch.float32, seed=21)
    thr = quantile_threshold(case, 4, 0.7)
    kernel = NativeSparse(lib, H, 64, torch.float32)  # type: ignore[arg-type]
    out, _, active = run_kernel(kernel, case, thr, 4)
    acc_s, acc_d = torch.zeros_like(case.x), torch.zeros_like(case.x)
    n_s = n_d = 0
    for e, (ts, ws) in enumerate(zip(case.tokens, case.weights, strict=True)):
        slot, w = case.slots[e], torch.tensor(ws)[:, None]
        y, n = sparse_torch(case.x[ts], slot[:128], slot[128:], F.silu, thr, 4)
        acc_s.index_add_(0, torch.tensor(ts), y * w)
        n_s += n
        y, n = masked_dense(case.x[ts], slot[:128], slot[128:].t(), F.silu, thr, 4)
        acc_d.index_add_(0, torch.tensor(ts), y * w)
        n_d += n
    assert n_s == n_d == active
    torch.testing.assert_close(acc_s, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(acc_d, out, rtol=1e-4, atol=1e-5)


def test_block_mask() -> None:
    a = torch.tensor([[0.1, -0.5, 0.0, 0.2, 0.05, 0.01, -0.02, 0.0]])
    assert block_mask(a, 0.2, 1).tolist() == [[False, True, False, True, False, False, False, False]]
    assert block_mask(a, 0.2, 4).tolist() == [[True] * 4 + [False] * 4]
    assert block_mask(a, 0.0, 4).all()
    assert not block_mask(a, 1.0, 4).any()


def test_block_mask_bf16_uses_the_exact_threshold() -> None:
    thr = 0.2585571502743141  # bf16(thr) == 0.2578125
    a = torch.tensor([[0.2578125, -0.2578125, 0.1, 0.3]], dtype=torch.bfloat16)
    assert block_mask(a, thr, 1).tolist() == [[False, False, False, True]]


@pytest.mark.parametrize("path", ["masked_dense", "sparse_torch"])
def test_bf16_torch_paths_count_against_the_exact_threshold(path: str) -> None:
    case = make_case(48, torch.bfloat16, seed=2)
    slot, i = case.slots[2], 48
    xe = case.x[case.tokens[2]]
    a = F.silu(F.linear(xe, slot[: 2 * i])[:, :i])  # the bf16 activations both paths compute
    v = float(a.abs().flatten().median())
    thr = v * (1 + 2**-10)  # just above a bf16 value that occurs: bf16(thr) == v
    assert torch.tensor(thr).bfloat16().item() == v
    want = int((a.float().abs() >= thr).sum())  # the same activations, the exact threshold
    if path == "masked_dense":
        _, active = masked_dense(xe, slot[: 2 * i], slot[2 * i :].t(), F.silu, thr, 1)
    else:
        _, active = sparse_torch(xe, slot[: 2 * i], slot[2 * i :], F.silu, thr, 1)
    assert active == want


# --- building the kernel ---------------------------------------------------------------------------


def test_load_builds_into_the_configured_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """load(enabled, cache_dir): RuntimeConfig.native_kernels / kernel_cache as arguments, no environment."""
    if native.load() is None:
        pytest.skip(f"native sparse kernel unavailable: {native.load_error()}")
    good = native._compilers()
    false = shutil.which("false")
    assert false is not None
    cache = tmp_path / "cache"
    try:
        with monkeypatch.context() as m:
            m.setenv("MOETIER_CACHE", str(tmp_path / "ignored"))  # kernels/ reads no environment
            m.setenv("MOETIER_NATIVE", "0")
            assert native.cache_dir(cache) == cache / "kernels"
            assert native.cache_dir() == Path.home() / ".cache" / "moetier" / "kernels"
            lib = native.load(True, cache)
            assert lib is not None and native.load_error(True, cache) is None
            built = list((cache / "kernels").iterdir())
            assert len(built) == 1 and built[0].name.startswith(native.LIB_PREFIX) and built[0].suffix == ".so"
            assert not (tmp_path / "ignored").exists()
            assert lib.moetier_sparse_abi() == native.ABI
            assert native.load(True, str(cache)) is lib  # cached per process and folder
            assert native.build_key(True, cache) in built[0].name
            kernel = native_kernel(H, 48, torch.bfloat16, torch.device("cpu"), cache_dir=cache)
            assert kernel is not None and kernel.build_key == native.build_key(True, cache)
            # only a failing compiler: None, the reason kept, a note instead of a half-written file
            bad = tmp_path / "bad"
            m.setattr(native, "_compilers", lambda: [false])
            assert native.load(True, bad) is None
            assert "failed" in (native.load_error(True, bad) or "")
            assert native.load_error(True, cache) is None  # errors are per folder
            left = list((bad / "kernels").iterdir())
            assert [p.suffix for p in left] == [".failed"]
            native.clear_cache()  # a later start skips the failed compiler at once
            assert native.load(True, bad) is None and "remembered" in (native.load_error(True, bad) or "")
            # a failing compiler, then a working one: the working one is used
            native.clear_cache()
            m.setattr(native, "_compilers", lambda: [false, *good])
            assert native.load(True, bad) is not None and native.load_error(True, bad) is None
            # turned off: None with the reason, whatever the folder holds
            assert native.load(False, cache) is None
            assert "turned off" in (native.load_error(False, cache) or "")
            assert native_kernel(H, 48, torch.bfloat16, torch.device("cpu"), enabled=False, cache_dir=cache) is None
            assert native.build_key(False, cache) == "none"
    finally:
        native.clear_cache()  # the next load() finds the regular cache again
    assert native.load() is not None
