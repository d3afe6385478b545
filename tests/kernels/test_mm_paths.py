"""Every compiled path of the matrix kernels (csrc/mm.c) this CPU can run, against float64 references.

kernels/native.py builds the library once per path (`isa`: the CPU's best, "avx2", "avx2-novnni", "c");
each is called through its own `moetier_gemv` entry (4-row blocks, up to 4 activation rows a pass, every
tail: rows, activation rows, K not a multiple of 64 or 128) for every weight kind, symmetric (zero
NULL: the dense Q8_0 / Q4_0 layouts) and asymmetric (per-group zero: the expert formats).

Quantised kinds quantise x per block of 32 (d = max|x| / 127, round half even); `quantise_act` does the
same in fp32 torch ops, so the reference W @ x_q in float64 differs from the kernel only by fp32
accumulation and the final bf16 rounding. A block holding NaN or Inf makes every output that reads it
NaN (the engine's NumericalError depends on it), never a finite number.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kernels.test_decode import quantise_act
from moetier.kernels import decode, native

BF16 = torch.bfloat16
PATHS = ("native", "avx2", "avx2-novnni", "c", "novbmi")


def _flags() -> set[str]:
    return set(native.cpu_info()[1])


def _runs_here(isa: str) -> bool:
    flags = _flags()
    if isa.startswith("avx2"):
        return {"avx2", "fma"} <= flags
    if isa == "novbmi":  # differs from native only on a CPU with AVX512-VBMI (the fp8 rows' byte tables)
        return "avx512vbmi" in flags
    return True


@pytest.fixture(scope="module", params=PATHS)
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    isa = str(request.param)
    if not _runs_here(isa):
        pytest.skip(f"this CPU cannot run the {isa} path")
    root: Path = tmp_path_factory.getbasetemp() / "kernel-cache"  # shared by the paths: one build each
    got = native.load(True, root, isa)
    if got is None:
        pytest.skip(f"no native kernels here: {native.load_error(True, root, isa)}")
    return got


def gemv(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, z: torch.Tensor | None,
         kind: int, group: int, n: int) -> torch.Tensor:  # fmt: skip
    """x [M, K] bf16 @ W.T -> [M, N] bf16 through this library's moetier_gemv."""
    m, k = x.shape
    y = torch.empty((m, n), dtype=BF16)
    scratch = torch.empty(int(lib.moetier_gemv_scratch_bytes(m, k, kind)) + 64, dtype=torch.uint8)
    sp, zp = (s.data_ptr() if s is not None else None), (z.data_ptr() if z is not None else None)
    rc = lib.moetier_gemv(x.data_ptr(), m, k, n, kind, q.data_ptr(), sp, zp, group, y.data_ptr(), scratch.data_ptr(), 2)
    assert rc == 0, f"kernel refused kind {kind}, K={k}, group {group}"
    return y


def weights(kind: int, n: int, k: int, group: int, sym: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """(q in the kernel layout, scale, zero or None, W float64 [N, K]) for one kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == 16:
        w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
        return w, None, None, w.double()  # type: ignore[return-value]
    vmax = (1 << kind) - 1
    v = torch.randint(0, vmax + 1, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(BF16)
    zc = {8: 128.0, 4: 8.0, 2: 2.0}[kind]
    zero = None if sym else (torch.rand(n, k // group, generator=g) * vmax).to(BF16)
    z = torch.full((n, k // group), zc, dtype=torch.float64) if zero is None else zero.double()
    w = (v.double() - z.repeat_interleave(group, 1)) * scale.double().repeat_interleave(group, 1)
    if kind == 8:
        q = (v - 128).to(torch.int8)
    elif kind == 4:
        q = decode.pack_nibbles(v.to(torch.uint8))
    else:
        q = decode.pack_crumbs(v.to(torch.uint8))
    return q.contiguous(), scale, zero, w


def check(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    err = (y.double() - ref).abs()
    bad = err > 2.0**-8 * ref.abs() + 1e-5 * scale + 1e-30  # the bf16 output rounding, fp32 sums
    assert not bad.any(), f"max error {float(err.max())} at {bad.nonzero()[:3].tolist()}"


CASES = [  # kind, symmetric, group, K
    (16, True, 0, 1024), (16, True, 0, 1040), (16, True, 0, 24),
    (8, True, 32, 1024), (8, True, 32, 96), (8, False, 64, 1088), (8, False, 1024, 1024), (8, False, 96, 96),
    (4, True, 32, 1024), (4, True, 32, 160), (4, False, 32, 1056), (4, False, 128, 1024), (4, False, 64, 64),
    (2, False, 64, 512), (2, True, 128, 256), (2, False, 256, 256),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "sym", "group", "k"), CASES)
def test_every_kind_matches_float64(lib: ctypes.CDLL, kind: int, sym: bool, group: int, k: int) -> None:
    gen = torch.Generator().manual_seed(kind * 7 + k)
    for m, n in ((1, 9), (3, 8), (6, 13)):  # activation rows: 1, a partial block of 4, a block and a tail
        q, s, z, w = weights(kind, n, k, group, sym, seed=k + n)
        x = (torch.randn(m, k, generator=gen) * torch.linspace(0.1, 3, k)).to(BF16)
        y = gemv(lib, x, q, s, z, kind, group, n)
        xr = x.double() if kind == 16 else quantise_act(x).double()
        check(y, xr @ w.T, x.double().abs() @ w.abs().T)


F16_CASES = [  # kind, symmetric, group, K: fp16 scales (a GGUF file's Q8_0 / Q4_0 blocks), every row / group path
    (8, True, 32, 1024), (8, True, 32, 96), (4, True, 32, 1024), (4, True, 32, 160), (4, False, 128, 1024),
    (4, False, 32, 1056), (8, False, 64, 1088), (4, True, 256, 256),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "sym", "group", "k"), F16_CASES)
def test_fp16_scales_match_float64(lib: ctypes.CDLL, kind: int, sym: bool, group: int, k: int) -> None:
    """kind | MT_SF16 reads the scales as fp16: values bf16 cannot hold (11 significant bits) stay exact."""
    gen = torch.Generator().manual_seed(kind * 11 + k)
    for m, n in ((1, 9), (4, 8), (6, 13)):
        q, _, z, _ = weights(kind, n, k, group, sym, seed=k + n + 1)
        s16 = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(torch.float16)
        assert (s16.float() != s16.float().to(BF16).float()).any()  # bf16 would round these scales
        v = weights(kind, n, k, group, sym, seed=k + n + 1)[3]  # W with the bf16 scales: recover v - zero
        _, s_bf, _, _ = weights(kind, n, k, group, sym, seed=k + n + 1)
        w = v / s_bf.double().repeat_interleave(group, 1) * s16.double().repeat_interleave(group, 1)
        x = (torch.randn(m, k, generator=gen) * torch.linspace(0.1, 3, k)).to(BF16)
        y = gemv(lib, x, q, s16, z, kind | decode.SF16, group, n)
        check(y, quantise_act(x).double() @ w.T, x.double().abs() @ w.abs().T)


@pytest.mark.parametrize("kind", [16, 8, 4, 2])
def test_nan_in_an_activation_block_reaches_the_output(lib: ctypes.CDLL, kind: int) -> None:
    k, group = 256, 64
    q, s, z, _ = weights(kind, 8, k, group, sym=False, seed=3)
    x = torch.randn(2, k).to(BF16)
    x[0, 40] = float("nan")  # row 0: NaN; row 1: finite
    x[1, 200] = float("inf") if kind != 16 else 1.0
    y = gemv(lib, x, q, s, z, kind, group, 8)
    assert torch.isnan(y[0]).all(), y[0]
    if kind != 16:  # an Inf in a quantised block: NaN, not a finite product of a saturated int8
        assert torch.isnan(y[1]).all(), y[1]
    else:
        assert torch.isfinite(y[1]).all()


def test_the_native_build_names_its_path(lib: ctypes.CDLL) -> None:
    name = lib.moetier_isa_name().decode()
    flags = _flags()
    best = "avx512-bf16-vnni" if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"} <= flags else None
    if lib.moetier_decode_isa() // 10 == 3:
        assert name == "avx512-bf16-vnni" and best == name
    assert name in ("avx512-bf16-vnni", "avx2+vnni", "avx2", "c")


# every e4m3fn byte but the two NaNs (0x7f, 0xff), as the float8 dtype reads it
_F8_FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


@pytest.mark.parametrize(("m", "n", "k", "group"),
                         [(1, 9, 128, 128), (3, 5, 256, 64), (5, 7, 96, 32), (4, 12, 384, 128)])  # fmt: skip
def test_fp8_rows_against_float64(lib, m, n, k, group):
    """Kind 9 (fp8 e4m3fn rows, fp32 scales per group): every byte value (subnormals, zeros of both signs, the
    largest), 1-5 activation rows; the reference decodes with torch's float8_e4m3fn dtype, in float64."""
    g = torch.Generator().manual_seed(n * k + m)
    q = _F8_FINITE[torch.randint(0, len(_F8_FINITE), (n, k), generator=g)]  # [N, K] uint8
    scale = torch.rand(n, k // group, generator=g, dtype=torch.float32) * 0.01 + 1e-4  # [N, K / group]
    w = q.view(torch.float8_e4m3fn).double() * scale.double().repeat_interleave(group, 1)  # [N, K]
    x = (torch.randn(m, k, generator=g) * 0.5).to(BF16)
    want = x.double() @ w.T  # [M, N]
    got = gemv(lib, x, q, scale, None, 9, group, n).double()
    tol = 1e-2 * want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= tol  # bf16 output rounding and fp32 sums only


def test_fp8_nan_reaches_the_output(lib):
    """An e4m3fn NaN byte (0x7f or 0xff) in a weight row makes that row's outputs NaN, not a finite number."""
    k, n = 64, 4
    q = torch.full((n, k), 0x38, dtype=torch.uint8)  # 1.0
    q[1, 5], q[3, 40] = 0x7F, 0xFF
    scale = torch.ones(n, 1, dtype=torch.float32)
    got = gemv(lib, torch.ones(2, k, dtype=BF16), q, scale, None, 9, k, n)
    assert torch.isnan(got[:, 1]).all() and torch.isnan(got[:, 3]).all()
    ones = torch.full((2,), 64.0)
    assert torch.equal(got[:, 0].float(), ones) and torch.equal(got[:, 2].float(), ones)


def _mxfp4_w(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """W float64 [N, K] of nibbles v [N, K] (indexes of the e2m1 values doubled) and e8m0 exponents e [N, K / 32]:
    value * 2^(e - 128) per block of 32, NaN for e = 255."""
    scale = torch.exp2(e.double() - 128).masked_fill(e == 255, float("nan"))  # exact: powers of two, 2^-128 too
    return torch.tensor(decode.FP4_VALUES, dtype=torch.float64)[v.long()] * scale.repeat_interleave(32, 1)


MXFP4_SHAPES = ((1, 9), (2, 8), (4, 12), (6, 13))  # activation rows: the decode, short-row, block and tail paths


@pytest.mark.parametrize("k", [1024, 160, 96, 512])  # 4-block steps, tails; 512: the short-row path at 1-2 rows
def test_mxfp4_rows_match_float64(lib: ctypes.CDLL, k: int) -> None:
    """kind 4 | MT_FP4 (an MXFP4 matrix re-laid for our kernels, kernels/stored.py): each nibble one of the 16 e2m1
    values (doubled) times 2^(e - 128) per block of 32, e the block's e8m0 exponent byte as the file stores it
    (uint8 [N, K / 32], widened in the kernel; every exponent a block may have in a real checkpoint's range), 1, 2,
    4 and 6 activation rows."""
    g = torch.Generator().manual_seed(k)
    for m, n in MXFP4_SHAPES:
        v = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        e = torch.randint(110, 136, (n, k // 32), generator=g, dtype=torch.uint8)  # e8m0 exponents
        w = _mxfp4_w(v, e)  # [N, K]
        x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 3, k)).to(BF16)
        y = gemv(lib, x, decode.pack_nibbles(v).contiguous(), e, None, 4 | decode.FP4, 32, n)
        check(y, quantise_act(x).double() @ w.T, x.double().abs() @ w.abs().T)


def _int_act(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """x [M, K] bf16 of integers in [-127, 127] with 127 in every block of 32: the kernel's int8 activation is x
    itself (d = 1 exactly), so with power-of-two scales every product and sum is exact in fp32 and the output is
    the float64 reference rounded once to bf16."""
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::32] = 127.0
    return x.to(BF16)


@pytest.mark.parametrize("k", [1024, 160, 512])
def test_mxfp4_subnormal_scales_are_exact(lib: ctypes.CDLL, k: int) -> None:
    """e = 0 and 1 are the fp32 subnormals 2^-128 and 2^-127, widened exactly (neither flushed to zero nor rounded):
    rows of such blocks (and of the smallest normal scales, e = 2, 3) against integer activations give exactly the
    float64 reference rounded to bf16, on every path and row count."""
    g = torch.Generator().manual_seed(k + 1)
    for m, n in MXFP4_SHAPES:
        v = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        e = torch.randint(0, 2, (n, k // 32), generator=g, dtype=torch.uint8)  # 2^-128 or 2^-127 per block
        e[0], e[n - 1] = 0, 1  # a row of each alone
        e[1] = torch.randint(0, 4, (k // 32,), generator=g, dtype=torch.uint8)  # subnormal and normal blocks mixed
        x = _int_act(m, k, g)
        assert torch.equal(quantise_act(x), x.float())
        y = gemv(lib, x, decode.pack_nibbles(v).contiguous(), e, None, 4 | decode.FP4, 32, n)
        ref = x.double() @ _mxfp4_w(v, e).T  # [M, N]: multiples of 2^-128 below 2^-104, exact in fp32
        assert torch.equal(ref.float().double(), ref)
        assert torch.equal(y, ref.float().to(BF16)), (y, ref)
        assert (ref.abs() < 2.0**-100).all() and (y[:, [0, n - 1]] != 0).any()  # tiny, and not flushed


@pytest.mark.parametrize("k", [1024, 160, 512])
def test_mxfp4_nan_exponent_reaches_the_output(lib: ctypes.CDLL, k: int) -> None:
    """e = 255 is NaN (OCP MX): a row with such a block gives NaN against every activation row (a zero one too), as
    the float64 reference does; the other rows are finite and exactly the reference rounded to bf16."""
    g = torch.Generator().manual_seed(k + 2)
    for m, n in MXFP4_SHAPES:
        v = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        e = torch.randint(126, 130, (n, k // 32), generator=g, dtype=torch.uint8)
        nan_rows = [1, n - 1]
        e[1, 0] = 255  # the first block of a row
        e[n - 1, k // 32 - 1] = 255  # the last block (a tail block where K / 32 is not a multiple of 4)
        x = _int_act(m, k, g)
        x[0] = 0.0  # NaN * 0 is NaN
        y = gemv(lib, x, decode.pack_nibbles(v).contiguous(), e, None, 4 | decode.FP4, 32, n)
        ref = x.double() @ _mxfp4_w(v, e).T
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), (y, ref)
        assert torch.isnan(y[:, nan_rows]).all()
        ok = [r for r in range(n) if r not in nan_rows]
        assert torch.equal(y[:, ok], ref[:, ok].float().to(BF16))
