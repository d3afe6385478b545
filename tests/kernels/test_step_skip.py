"""The native MoE half (csrc/step.c) skips a pair whose id is -1 (a routing override's "no expert"): the result is
bit for bit the MoE half of the reduced routing written without those pairs, and the skipped pair's weight is
never read; any other negative id is refused."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moetier.kernels import decode, native
from moetier.kernels.step import DESC, MoeLayer, Step, desc_row
from moetier.store.pool import SlotViews

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    got = decode.load(True, None)
    if got is None:
        pytest.skip(f"no native kernels here: {native.load_error(True, None)}")
    return got


def _slot(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, SlotViews]:
    i2, hh = w13.shape
    row = torch.cat([w13.reshape(-1), w2.reshape(-1)]).contiguous()
    return row, SlotViews(row[: i2 * hh].view(i2, hh), row[i2 * hh :].view(hh, i2 // 2), None, None, row, {})


def _run(lib: ctypes.CDLL, h: int, inter: int, e: int, ids: torch.Tensor, wts: torch.Tensor, x0: torch.Tensor,
         hin: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x0 + the MoE half of rows hin routed by ids / wts [T, k] (bf16 [T, H])."""
    t, k = ids.shape
    moe = MoeLayer(h, inter, e, k)
    step = Step(lib, t, h, 1, k, e, [], [moe], None, 0, 2)
    step.layer(0)
    step.s.nthreads, step.s.T = 2, t
    step.x[:t].copy_(x0)
    step.h[:t].copy_(hin)
    step.ids[0, :t].copy_(ids)
    step.wts[0, :t].copy_(wts)
    for ex in range(e):
        moe.desc[ex] = None
    for ex in set(ids.reshape(-1).tolist()) - {-1}:
        moe.desc[ex] = table.data_ptr() + 8 * DESC * ex
    step.moe(moe)
    return step.x[:t].clone()


def test_skipped_pairs_equal_the_reduced_routing_bit_for_bit(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 6
    g = torch.Generator().manual_seed(7)
    experts = [((torch.randn(2 * inter, h, generator=g) * 0.2).to(BF16),
                (torch.randn(h, inter, generator=g) * 0.2).to(BF16)) for _ in range(e)]  # fmt: skip
    slots = [_slot(*w) for w in experts]
    table = torch.tensor([desc_row(s[1]) for s in slots], dtype=torch.int64)  # [E, DESC]
    x0, hin = torch.randn(4, h, generator=g).to(BF16), torch.randn(4, h, generator=g).to(BF16)
    # top-2 routing with one pair per row skipped (its weight garbage: it must not be read)
    ids = torch.tensor([[1, -1], [-1, 4], [0, -1], [5, -1]], dtype=torch.int32)
    wts = torch.tensor([[0.7, 123.0], [float("nan"), 0.4], [1.0, -9.0], [0.25, 1e30]])
    got = _run(lib, h, inter, e, ids, wts, x0, hin, table)
    kept = ids >= 0
    ids1 = ids[kept].reshape(4, 1)  # the same routing written with top-1: the pairs computed
    wts1 = wts[kept].reshape(4, 1)
    want = _run(lib, h, inter, e, ids1, wts1, x0, hin, table)
    assert torch.equal(got, want)
    # and against float64 by hand
    for t in range(4):
        ex = int(ids1[t, 0])
        w13, w2 = (w.double() for w in experts[ex])
        gu = hin[t : t + 1].double() @ w13.T
        a = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = float(wts1[t, 0]) * (a.to(BF16).double() @ w2.T)[0]
        ref = (x0[t].double() + y.to(BF16).double()).to(BF16).double()
        assert float((got[t].double() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_a_row_with_every_pair_skipped_adds_nothing(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 4
    g = torch.Generator().manual_seed(8)
    experts = [((torch.randn(2 * inter, h, generator=g) * 0.2).to(BF16),
                (torch.randn(h, inter, generator=g) * 0.2).to(BF16)) for _ in range(e)]  # fmt: skip
    slots = [_slot(*w) for w in experts]
    table = torch.tensor([desc_row(s[1]) for s in slots], dtype=torch.int64)
    x0, hin = torch.randn(2, h, generator=g).to(BF16), torch.randn(2, h, generator=g).to(BF16)
    ids = torch.tensor([[-1, -1], [2, 3]], dtype=torch.int32)
    got = _run(lib, h, inter, e, ids, torch.rand(2, 2, generator=g), x0, hin, table)
    assert torch.equal(got[0], x0[0])


def test_other_negative_ids_are_refused(lib: ctypes.CDLL) -> None:
    h, inter, e = 64, 32, 4
    g = torch.Generator().manual_seed(9)
    experts = [((torch.randn(2 * inter, h, generator=g) * 0.2).to(BF16),
                (torch.randn(h, inter, generator=g) * 0.2).to(BF16)) for _ in range(e)]  # fmt: skip
    slots = [_slot(*w) for w in experts]
    table = torch.tensor([desc_row(s[1]) for s in slots], dtype=torch.int64)
    x0, hin = torch.randn(1, h, generator=g).to(BF16), torch.randn(1, h, generator=g).to(BF16)
    with pytest.raises(Exception, match="MoE half"):
        _run(lib, h, inter, e, torch.tensor([[-2, 1]], dtype=torch.int32), torch.rand(1, 2), x0, hin, table)
