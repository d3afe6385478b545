"""Compute formats of quantised experts (kernels/qformat.py): slot layout, pack_into, views, `linear`.

Reference: x @ dequantize(...).T in fp32. The CPU kernels read bf16 activations and bf16
scale/offset rows: int8 and int4 agree to ~0.3% relative, int2 to ~1% (its kernel offset
(8 - zero) * scale is rounded to bf16, an error of up to 2^-9 of ~6 quantisation steps).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from moetier.errors import CheckpointError
from moetier.formats.layout import ExpertLayout
from moetier.formats.quant import QMatrix, QuantSpec, dequantize, quantize_expert
from moetier.kernels.qformat import ALIGN, ExpertFormat, QExpertViews, QLinearWeight, _int2_layout_ok, linear
from moetier.types import Precision

CPU = torch.device("cpu")
# the int2 kernel format needs the int4 packer's AVX-512 block layout; elsewhere int2 uses "generic"
INT2 = "int2" if _int2_layout_ok() else "generic"
needs_int2_kernel = pytest.mark.skipif(
    INT2 != "int2",
    reason=f"the int2 kernel format needs the AVX-512 int4 packer layout (CPU capability "
    f"{torch.backends.cpu.get_cpu_capability()}: int2 falls back to the generic format)",
)
QUANTISED = (Precision.INT8, Precision.INT4, Precision.INT2)
TOL = {Precision.INT8: 0.01, Precision.INT4: 0.01, Precision.INT2: 0.025}

# (hidden, inter) -> what each matrix must use. w13 is [2I, H], w2 is [H, I].
#  (96, 64): w13 K=96 -> int4/int2 g=32, G=3 (odd: uneven int2 fold); w2 N=96 (int2 needs N % 64 -> generic)
#  (128, 256): int4 w13 g=128 G=1, w2 g=128 G=2; int2 w13 g=64 G=2, w2 g=64 G=4
#  (64, 40): w13 K=64 fine; w2 K=40 only int8 can quantise it (g=K, K % 16 != 0 -> generic)
LAYOUTS = {
    (96, 64): {Precision.INT8: ("int8", "int8"), Precision.INT4: ("int4", "int4"), Precision.INT2: (INT2, "generic")},
    (128, 256): {Precision.INT8: ("int8", "int8"), Precision.INT4: ("int4", "int4"), Precision.INT2: (INT2, INT2)},
}


def make_expert(
    hidden: int, inter: int, precision: Precision, bias: bool, seed: int = 0, group: int | None = None
) -> tuple[ExpertLayout, QuantSpec, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pieces = {
        "gate": torch.randn(inter, hidden, generator=g) * 0.05,
        "up": torch.randn(inter, hidden, generator=g) * 0.05,
        "down": torch.randn(hidden, inter, generator=g) * 0.05,
    }
    if bias:
        pieces |= {p: torch.randn(n, generator=g).bfloat16() for p, n in (("gate_bias", inter), ("up_bias", inter))}
        pieces["down_bias"] = torch.randn(hidden, generator=g).bfloat16()
    spec = QuantSpec(precision, group)
    return ExpertLayout(hidden, inter, bias), spec, quantize_expert(pieces, spec, method="rtn")


def reference(canonical: dict[str, torch.Tensor], m: str, w: QLinearWeight, spec: QuantSpec) -> torch.Tensor:
    qm = QMatrix(canonical[f"{m}.q"], canonical[f"{m}.scale"], canonical[f"{m}.zero"], w.n, w.k, spec)
    return dequantize(qm)  # [N, K] fp32


def packed_slot(
    layout: ExpertLayout, spec: QuantSpec, canonical: dict[str, torch.Tensor], dtype: torch.dtype, kernels: bool = True
) -> tuple[ExpertFormat, QExpertViews]:
    fmt = ExpertFormat(layout, spec, dtype, CPU, kernels=kernels)
    row = torch.full((fmt.slot_bytes,), 0xAB, dtype=torch.uint8)
    views = fmt.views(row)
    fmt.pack_into(canonical, views)
    return fmt, views


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_int2_fold_layout_holds_on_this_cpu() -> None:
    """The probe must hold where torch runs its AVX-512 kernels (the packer layout the fold relies on)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if not cap.startswith("AVX512"):
        pytest.skip(f"the int2 fold relies on the AVX-512 int4 packer layout; this CPU's capability is {cap}")
    assert _int2_layout_ok()


@pytest.mark.parametrize("shape", list(LAYOUTS))
@pytest.mark.parametrize("precision", QUANTISED)
def test_kernel_linear_matches_dequantised_reference(precision: Precision, shape: tuple[int, int]) -> None:
    layout, spec, canonical = make_expert(*shape, precision, bias=True)
    fmt, views = packed_slot(layout, spec, canonical, torch.bfloat16)
    assert (fmt.kinds["w13"], fmt.kinds["w2"]) == LAYOUTS[shape][precision]
    for m, w, b in (("w13", views.w13, views.b13), ("w2", views.w2, views.b2)):
        assert b is not None
        deq = reference(canonical, m, w, spec)
        for rows in (1, 2, 7):
            x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            y = linear(x, w)
            assert y.shape == (rows, w.n) and y.dtype == torch.bfloat16
            assert rel(y, x.float() @ deq.T) < TOL[precision], (m, rows)
            yb = linear(x, w, b)
            assert rel(yb, x.float() @ deq.T + b.float()) < TOL[precision], (m, rows, "bias")


@pytest.mark.parametrize(
    "precision", [Precision.INT8, Precision.INT4, pytest.param(Precision.INT2, marks=needs_int2_kernel)]
)
def test_generic_path_equals_kernel_path(precision: Precision) -> None:
    layout, spec, canonical = make_expert(128, 256, precision, bias=False)
    _, kernel = packed_slot(layout, spec, canonical, torch.bfloat16)
    fmt, generic = packed_slot(layout, spec, canonical, torch.bfloat16, kernels=False)
    assert set(fmt.kinds.values()) == {"generic"}
    for wk, wg in ((kernel.w13, generic.w13), (kernel.w2, generic.w2)):
        assert wk.kind != "generic"
        x = torch.randn(3, wk.k).bfloat16()
        assert rel(linear(x, wk), linear(x, wg)) < TOL[precision]


@pytest.mark.parametrize("precision", QUANTISED)
def test_fp32_model_uses_generic_format_exactly(precision: Precision) -> None:
    layout, spec, canonical = make_expert(96, 64, precision, bias=True)
    fmt, views = packed_slot(layout, spec, canonical, torch.float32)
    assert set(fmt.kinds.values()) == {"generic"}
    assert views.b13 is not None and views.b13.dtype == torch.float32
    x = torch.randn(5, 96)
    deq = reference(canonical, "w13", views.w13, spec)
    assert torch.allclose(linear(x, views.w13, views.b13), x @ deq.T + views.b13, rtol=1e-5, atol=1e-5)


def test_generic_fallbacks_for_shapes_and_groups() -> None:
    # int8 with g < K: generic
    layout, spec, canonical = make_expert(128, 64, Precision.INT8, bias=False, group=64)
    fmt, views = packed_slot(layout, spec, canonical, torch.bfloat16)
    assert fmt.kinds == {"w13": "generic", "w2": "int8"}  # w2 has K=64 = g
    x = torch.randn(2, 128).bfloat16()
    assert rel(linear(x, views.w13), x.float() @ reference(canonical, "w13", views.w13, spec).T) < 0.01
    # int8 with K % 16 != 0 (w2 K=40): generic
    layout, spec, canonical = make_expert(64, 40, Precision.INT8, bias=False)
    fmt, views = packed_slot(layout, spec, canonical, torch.bfloat16)
    assert fmt.kinds == {"w13": "int8", "w2": "generic"}
    x = torch.randn(2, 40).bfloat16()
    assert rel(linear(x, views.w2), x.float() @ reference(canonical, "w2", views.w2, spec).T) < 0.01


@pytest.mark.parametrize("precision", QUANTISED)
def test_swiglu_expert_from_slot_equals_dequantised_reference(precision: Precision) -> None:
    layout, spec, canonical = make_expert(128, 256, precision, bias=True, seed=3)
    _, v = packed_slot(layout, spec, canonical, torch.bfloat16)
    assert v.b13 is not None and v.b2 is not None
    w13, w2 = reference(canonical, "w13", v.w13, spec), reference(canonical, "w2", v.w2, spec)
    x = torch.randn(4, 128).bfloat16()
    gate, up = linear(x, v.w13, v.b13).chunk(2, dim=-1)
    y = linear(F.silu(gate) * up, v.w2, v.b2)  # [4, H]
    rg, ru = (x.float() @ w13.T + v.b13.float()).chunk(2, dim=-1)
    want = (F.silu(rg) * ru) @ w2.T + v.b2.float()
    assert y.shape == (4, 128) and rel(y, want) < 2 * TOL[precision]


@pytest.mark.parametrize("precision", QUANTISED)
def test_slot_layout_is_aligned_and_views_alias_the_row(precision: Precision) -> None:
    layout, spec, canonical = make_expert(96, 64, precision, bias=True)
    fmt = ExpertFormat(layout, spec, torch.bfloat16, CPU)
    assert fmt.slot_bytes % ALIGN == 0
    pool = torch.zeros((3, fmt.slot_bytes), dtype=torch.uint8)  # a pool: rows stay aligned
    views = fmt.views(pool[1])
    base, end = pool[1].data_ptr(), pool[1].data_ptr() + fmt.slot_bytes
    tensors = [views.w13.q, views.w13.scale, views.w2.q, views.w2.scale, views.b13, views.b2]
    tensors += [t for t in (views.w13.zero, views.w2.zero) if t is not None]
    ptrs = []
    for t in tensors:
        assert t is not None
        assert t.data_ptr() % ALIGN == 0 and base <= t.data_ptr() and t.data_ptr() + t.nbytes <= end
        ptrs.append(t.data_ptr())
    fmt.pack_into(canonical, views)
    assert [t.data_ptr() for t in tensors if t is not None] == ptrs  # written in place
    assert pool[0].eq(0).all() and pool[2].eq(0).all()  # neighbours untouched
    assert pool[1].ne(0).any()
    int2_scratch = 128 * 96 // 2 if fmt.kinds["w13"] == "int2" else 0  # w13 [128, 96]; w2 is generic
    assert fmt.compute_scratch_bytes == int2_scratch
    if fmt.kinds["w13"] == "generic":  # int2 where the probe fails: packing copies nothing on CPU
        assert fmt.pack_scratch_bytes == 0
    else:
        assert fmt.pack_scratch_bytes >= 128 * 96  # at least one unpacked copy of w13


def test_views_reject_bad_rows() -> None:
    layout, spec, _ = make_expert(96, 64, Precision.INT4, bias=False)
    fmt = ExpertFormat(layout, spec, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="uint8"):
        fmt.views(torch.zeros(fmt.slot_bytes // 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=str(fmt.slot_bytes)):
        fmt.views(torch.zeros(fmt.slot_bytes + 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned"):
        fmt.views(torch.zeros(fmt.slot_bytes + 64, dtype=torch.uint8)[1 : fmt.slot_bytes + 1])


def test_pack_into_rejects_bad_canonical_tensors() -> None:
    layout, spec, canonical = make_expert(96, 64, Precision.INT4, bias=True)
    fmt = ExpertFormat(layout, spec, torch.bfloat16, CPU)
    views = fmt.views(torch.zeros(fmt.slot_bytes, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=r"w2\.zero"):
        fmt.pack_into({k: v for k, v in canonical.items() if k != "w2.zero"}, views)
    with pytest.raises(CheckpointError, match=r"w13\.scale"):
        fmt.pack_into(canonical | {"w13.scale": canonical["w13.scale"][:, :1]}, views)
    with pytest.raises(CheckpointError, match=r"w13\.q"):
        fmt.pack_into(canonical | {"w13.q": canonical["w13.q"].to(torch.int32)}, views)


def test_linear_inputs_plain_weights_and_odd_activations() -> None:
    w = torch.randn(8, 16)
    x = torch.randn(3, 16)
    assert torch.equal(linear(x, w), F.linear(x, w))
    layout, spec, canonical = make_expert(128, 256, Precision.INT8, bias=False)
    _, v = packed_slot(layout, spec, canonical, torch.bfloat16)
    deq = reference(canonical, "w13", v.w13, spec)
    buf = torch.randn(8 + 3 * 128).bfloat16()
    x_odd = buf[8:].view(3, 128)  # 16 bytes past an aligned start: the int8 kernel needs 32
    assert x_odd.data_ptr() % 32
    assert rel(linear(x_odd, v.w13), x_odd.float() @ deq.T) < 0.01
    x_t = torch.randn(128, 3).bfloat16().T  # non-contiguous
    assert rel(linear(x_t, v.w13), x_t.float() @ deq.T) < 0.01
    x3 = torch.randn(2, 3, 128)  # fp32, 3-D: computed in bf16, returned as fp32
    y3 = linear(x3, v.w13)
    assert y3.shape == (2, 3, 512) and y3.dtype == torch.float32 and rel(y3, x3 @ deq.T) < 0.01
    assert linear(torch.zeros(0, 128).bfloat16(), v.w13).shape == (0, 512)
    with pytest.raises(ValueError, match="features"):
        linear(torch.randn(2, 64).bfloat16(), v.w13)


@needs_int2_kernel
def test_int2_scratch_is_per_thread() -> None:
    """Two slots of one format share the int2 unfold scratch object; threads must not see each other's."""
    layout, spec, canonical_a = make_expert(128, 256, Precision.INT2, bias=False, seed=5)
    canonical_b = make_expert(128, 256, Precision.INT2, bias=False, seed=6)[2]
    fmt = ExpertFormat(layout, spec, torch.bfloat16, CPU)
    pool = torch.zeros((2, fmt.slot_bytes), dtype=torch.uint8)
    a, b = fmt.views(pool[0]), fmt.views(pool[1])
    fmt.pack_into(canonical_a, a)
    fmt.pack_into(canonical_b, b)
    assert a.w13.kind == "int2" and a.w13.scratch is b.w13.scratch
    x = torch.randn(2, 128).bfloat16()
    want = {"a": linear(x, a.w13), "b": linear(x, b.w13)}
    errors: list[str] = []

    def run(name: str, w: QLinearWeight) -> None:
        for _ in range(50):
            if not torch.equal(linear(x, w), want[name]):
                errors.append(name)
                return

    threads = [threading.Thread(target=run, args=(n, w)) for n, w in (("a", a.w13), ("b", b.w13))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
