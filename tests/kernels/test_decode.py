"""The native decode kernels (kernels/decode.py; csrc/mm.c, csrc/step.c) against float64 references.

Quantised kinds quantise the activation per block of 32 to int8 (d = max|x| / 127, round half even);
`quantise_act` does the same in fp32 torch ops (the same IEEE operations), so the reference
W_deq @ x_q in float64 differs from the kernel only by its fp32 accumulation and the final bf16
rounding: |y - ref| <= 2^-8 |ref| + 1e-5 * sum |w x|. A second check against the unquantised
product bounds what the activation quantisation costs (relative error under 2%).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetier.formats.layout import ExpertLayout
from moetier.formats.quant import QMatrix, QuantSpec, dequantize, quantize_expert
from moetier.kernels import decode, native
from moetier.kernels.qformat import ExpertFormat, linear
from moetier.types import Precision

CPU = torch.device("cpu")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def lib() -> object:
    got = decode.load(True, None)
    if got is None:
        pytest.skip(f"no native kernels here: {native.load_error(True, None)}")
    return got


def quantise_act(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> what the kernel's int8 activation stands for, fp32 [M, K] (a * d per block of 32)."""
    xb = x.float().reshape(x.shape[0], -1, 32)  # [M, B, 32]
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    # tensor / tensor: IEEE division, as the kernel's 127.0f / amax (torch's int / tensor multiplies by a
    # reciprocal, one ulp off at times, which moves x * inv across a rounding tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    a = (xb * inv).round().clamp(-127, 127)
    return (a * d).reshape(x.shape)


def check(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
    """y [M, N] (bf16) against x [M, K] @ w [N, K].T in float64."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (y.double() - ref).abs()
    bad = err > 2.0**-8 * ref.abs() + 1e-5 * scale + 1e-30
    assert not bad.any(), f"max error {float(err.max())}, at {bad.nonzero()[:3].tolist()}"


def canonical(n: int, k: int, precision: Precision, group: int | None, seed: int = 0) -> tuple[QMatrix, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    spec = QuantSpec(precision, group)
    pieces = quantize_expert({"gate": w[: n // 2], "up": w[n // 2 :], "down": torch.zeros(k, n // 2)}, spec, "rtn")
    qm = QMatrix(pieces["w13.q"], pieces["w13.scale"], pieces["w13.zero"], n, k, spec)
    return qm, dequantize(qm)


def test_gemv_bf16_rows_and_tails(lib: object) -> None:
    g = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 300, 1024), (3, 70, 1040), (2, 33, 24)):  # K % 16 and K % 32 tails
        w = torch.randn(n, k, generator=g).to(BF16)
        x = torch.randn(m, k, generator=g).to(BF16)
        check(decode.gemv(x, w, None, None, decode.KIND_BF16, 0), w, x)


@pytest.mark.parametrize(("precision", "group"), [(Precision.INT8, None), (Precision.INT4, 32), (Precision.INT4, 128),
                                                  (Precision.INT2, 64), (Precision.INT2, 256)])  # fmt: skip
def test_native_formats_match_float64(lib: object, precision: Precision, group: int | None) -> None:
    """kernels/qformat's n8 / n4 / n2 slots through qformat.linear: the canonical weights, x quantised per 32."""
    h, i = 256, 128
    layout = ExpertLayout(h, i, False)
    spec = QuantSpec(precision, group)
    fmt = ExpertFormat(layout, spec, BF16, CPU, native=True)
    assert fmt.kinds == {"w13": f"n{spec.bits}", "w2": f"n{spec.bits}"}
    gen = torch.Generator().manual_seed(2)
    pieces = {"gate": torch.randn(i, h, generator=gen) * 0.05, "up": torch.randn(i, h, generator=gen) * 0.05,
              "down": torch.randn(h, i, generator=gen) * 0.05}  # fmt: skip
    can = quantize_expert(pieces, spec, method="rtn")
    row = torch.empty(fmt.slot_bytes, dtype=torch.uint8)
    views = fmt.views(row)
    fmt.pack_into(can, views)
    for m, w in (("w13", views.w13), ("w2", views.w2)):
        wd = dequantize(QMatrix(can[f"{m}.q"], can[f"{m}.scale"], can[f"{m}.zero"], w.n, w.k, spec))
        x = torch.randn(3, w.k, generator=gen).to(BF16)
        y = linear(x, w)
        check(y, wd, quantise_act(x))
        exact = x.double() @ wd.double().T
        assert float((y.double() - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("bits", [8, 4])
def test_dense_quantised_q8_q4(lib: object, bits: int) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 512, generator=g)
    w[5, :32] = 0  # an all-zero block: scale 0, no division by zero
    qd = decode.quantize_dense(w, bits)
    wd = decode.dequantize_dense(qd)
    assert qd.nbytes == 96 * 512 * bits // 8 + 96 * 16 * 2
    rel = float((wd - w).norm() / w.norm())
    assert rel < (0.006 if bits == 8 else 0.1), rel  # Q8_0 ~0.5%, Q4_0 ~9% on Gaussian weights
    assert torch.all(wd[5, :32] == 0)
    x = torch.randn(2, 512, generator=g).to(BF16)
    check(decode.dense_linear(x, qd, None, True), wd, quantise_act(x))
    # the bf16 path of dense_linear: native up to native_rows(), torch beyond, both F.linear's math
    wb = w.to(BF16)
    for rows in (1, decode.native_rows(), decode.native_rows() + 1):
        xr = torch.randn(rows, 512, generator=g).to(BF16)
        check(decode.dense_linear(xr, wb, None, True), wb, xr)


def _slots(h: int, i: int, kinds: list[str], seed: int = 4) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """One slot per kind ("bf16" or a precision): (slot memory, layout rows, the dequantised w13 | w2 as
    one fp32 [3I, H] + [H, I] tensor per expert, stored as (w13 [2I, H], w2 [H, I]) pairs)."""
    gen = torch.Generator().manual_seed(seed)
    slots, layout, mats = [], [], []
    for kind in kinds:
        pieces = {"gate": torch.randn(i, h, generator=gen) * 0.05, "up": torch.randn(i, h, generator=gen) * 0.05,
                  "down": torch.randn(h, i, generator=gen) * 0.05}  # fmt: skip
        if kind == "bf16":
            w13 = torch.cat([pieces["gate"], pieces["up"]]).to(BF16)
            w2 = pieces["down"].to(BF16)
            slot = torch.cat([w13.reshape(-1), w2.reshape(-1)])
            slots.append(slot)
            layout += [decode.KIND_BF16, 0, 0, -1, -1, 0, w13.numel() * 2, -1, -1]
            mats += [w13.float(), w2.float()]
            continue
        spec = QuantSpec(Precision(kind), None)
        fmt = ExpertFormat(ExpertLayout(h, i, False), spec, BF16, CPU, native=True)
        can = quantize_expert(pieces, spec, method="rtn")
        row = torch.empty(fmt.slot_bytes, dtype=torch.uint8)
        views = fmt.views(row)
        fmt.pack_into(can, views)
        slots.append(row)
        layout.append(spec.bits)
        for m, w in (("w13", views.w13), ("w2", views.w2)):
            assert w.zero is not None
            base = row.data_ptr()
            layout += [w.group, w.q.data_ptr() - base, w.scale.data_ptr() - base, w.zero.data_ptr() - base]
            mats.append(dequantize(QMatrix(can[f"{m}.q"], can[f"{m}.scale"], can[f"{m}.zero"], w.n, w.k, spec)))
    return slots, layout, mats


def test_moe_all_kinds_one_call(lib: object) -> None:
    """Mixed kinds in one call (a dynamic store's hi and lo slots), several tokens, experts with 0-2 pairs."""
    h, i = 256, 128
    kinds = ["bf16", "int8", "int4", "int2", "int4"]
    slots, layout, mats = _slots(h, i, kinds)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, h, generator=gen).to(BF16)
    pairs = {0: [(0, 0.5), (2, 0.25)], 1: [(1, 0.7)], 2: [], 3: [(0, 0.3), (1, 0.2)], 4: [(2, 0.9)]}
    start, tok, rw = [0], [], []
    for e in range(len(kinds)):
        tok += [t for t, _ in pairs[e]]
        rw += [w for _, w in pairs[e]]
        start.append(len(tok))
    out = decode.moe(x, slots, layout, start, tok, rw, i)
    # reference: the kernel's own activation quantisation for quantised experts, float64 everywhere else
    ref = torch.zeros(3, h, dtype=torch.float64)
    for e, kind in enumerate(kinds):
        w13, w2 = mats[2 * e].double(), mats[2 * e + 1].double()
        for t, wt in pairs[e]:
            xt = x[t : t + 1].float()
            xe = xt if kind == "bf16" else quantise_act(xt)
            gu = xe.double() @ w13.T  # [1, 2I]
            act = (F.silu(gu[:, :i]) * gu[:, i:]).float()
            ae = act if kind == "bf16" else quantise_act(act)
            ref[t] += wt * (ae.double() @ w2.T)[0]
    err = (out.double() - ref).abs()
    assert float(err.max()) <= 2.0**-8 * float(ref.abs().max()) + 1e-4, float(err.max())


def test_moe_refuses_bad_input(lib: object) -> None:
    slots, layout, _ = _slots(64, 32, ["bf16"])
    x = torch.randn(1, 64).to(BF16)
    with pytest.raises(ValueError, match="tokens must be in"):
        decode.moe(x, slots, layout, [0, 1], [3], [1.0], 32)
    with pytest.raises(ValueError, match="layout ints"):
        decode.moe(x, slots, layout[:-1], [0, 1], [0], [1.0], 32)
    with pytest.raises(ValueError, match="contiguous bf16"):
        decode.moe(x.float(), slots, layout, [0, 1], [0], [1.0], 32)
    with pytest.raises(ValueError, match="not a layout"):
        decode.gemv(x, torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=BF16), None, 4, 48)
    with pytest.raises(ValueError, match="layout kind 3"):  # an unknown kind is refused, not read as int2
        decode.moe(x, slots, [3, *layout[1:]], [0, 1], [0], [1.0], 32)
    with pytest.raises(ValueError, match="outside its"):  # a down matrix past the end of the slot
        decode.moe(x, slots, [*layout[:5], 0, layout[6] + 64, -1, -1], [0, 1], [0], [1.0], 32)


def test_thread_count_does_not_change_results(lib: object) -> None:
    h, i = 256, 128
    slots, layout, _ = _slots(h, i, ["int4", "bf16", "int8"], seed=7)
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(8)).to(BF16)
    args = (slots, layout, [0, 1, 2, 3], [0, 0, 0], [0.2, 0.3, 0.5], i)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode.moe(x, *args)
        torch.set_num_threads(max(2, before))
        many = decode.moe(x, *args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_rms_norm_matches_float64(lib: object) -> None:
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 16, 64, generator=g) * 3).to(BF16)  # per-head rows, as the q/k norms use it
    w = torch.randn(64, generator=g).to(BF16)
    y = decode.rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert y.shape == x.shape and y.dtype == BF16
    assert torch.all((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6)
    close = F.rms_norm(x, (64,), w, 1e-6)  # torch's bf16 op: the same function up to rounding
    assert float((y.float() - close.float()).abs().max()) <= 2.0**-7 * float(close.float().abs().max())
    with pytest.raises(ValueError, match="rms_norm"):
        decode.rms_norm(x.float(), w, 1e-6)


def test_moe_in_groups_gives_the_bits_of_one_call(lib: object) -> None:
    """moe_acc over groups of experts in ascending id, then one rounding: what a compute tier with fewer
    slots than the call's experts runs (runtime/executors/native.py)."""
    h, i = 256, 128
    slots, layout, _ = _slots(h, i, ["bf16", "int4", "int8", "int4", "bf16"], seed=11)
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(12)).to(BF16)
    start, tok, rw = [0, 2, 3, 5, 6, 7], [0, 1, 1, 0, 1, 0, 1], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    one = decode.moe(x, slots, layout, start, tok, rw, i)
    acc = torch.zeros(2, h)
    for g0, g1 in ((0, 2), (2, 4), (4, 5)):
        lo, hi = start[g0], start[g1]
        decode.moe_acc(x, slots[g0:g1], layout[9 * g0 : 9 * g1], [p - lo for p in start[g0 : g1 + 1]], tok[lo:hi],
                       rw[lo:hi], i, acc)  # fmt: skip
    assert torch.equal(acc.to(BF16), one)


def test_cpu_info_reads_the_first_cpu_of_proc_cpuinfo() -> None:
    """native.cpu_info: the model and flags of the first CPU listed, as the profile and the benchmarks report them
    (and the lines native._cpu_id keys the kernel build on)."""
    model, flags = native.cpu_info()
    raw = native._cpu_id()  # the raw "model name" and "flags" lines, or the platform's name without /proc/cpuinfo
    assert isinstance(model, str) and all(isinstance(f, str) and f for f in flags)
    assert model in raw and " ".join(flags) in raw
    if "flags" in raw:
        assert flags and len(set(flags)) == len(flags)
