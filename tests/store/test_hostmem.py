"""store/hostmem.py: buffers for weights the decode step streams, on transparent huge pages where the kernel has
them; the same values and shapes as torch.empty / .to / a copy either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier.store import hostmem

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_empty_is_an_aligned_writable_view_and_small_buffers_are_plain() -> None:
    t = hostmem.empty((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hostmem.HUGE == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * 3 * (1 << 20)
    small = hostmem.empty((4, 8), torch.float32)
    assert small.shape == (4, 8) and small.dtype == torch.float32


def test_rehome_and_to_keep_values() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 1024, generator=g)  # 8 MiB fp32
    y = hostmem.rehome(x)
    assert y.data_ptr() != x.data_ptr() and y.data_ptr() % hostmem.HUGE == 0 and torch.equal(x, y)
    b = hostmem.to(x, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b.data_ptr() % hostmem.HUGE == 0 and torch.equal(b, x.to(torch.bfloat16))
    assert hostmem.to(x, torch.float32) is x  # no conversion: the tensor itself
    tiny = torch.ones(3)
    assert hostmem.rehome(tiny) is tiny


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_kernel_accepts_the_advice() -> None:
    """Whether touched pages then come huge is the kernel's call (free 2 MiB blocks, its defrag setting), measured in
    the benchmarks rather than asserted here; the advice itself is accepted over the aligned interior only."""
    t = hostmem.empty((64 << 20,), torch.uint8)
    assert hostmem.advise_huge(t)
    assert not hostmem.advise_huge(t[: 1 << 20])  # no whole 2 MiB page inside 1 MiB
    assert not hostmem.advise_huge(torch.empty(0))
    assert hostmem.anon_huge_bytes() is not None
