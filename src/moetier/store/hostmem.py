"""Host buffers on transparent huge pages: the expert pools and the decoder's dense weights.

Why: decode streams every active weight once a token, and on 4 KiB pages that stream misses the TLB every 4 KiB.
On this project's AVX-512 EPYC a 1 GiB read ran at 38 GB/s on huge pages against 33 on 4 KiB ones, and the
benchmark model's bf16 decode at 150-163 against 135-149 tok/s (three interleaved pairs of runs, 2026-11-29).

How: `empty` allocates `nbytes` plus 2 MiB of slack, asks the kernel for huge pages (madvise MADV_HUGEPAGE) over
the 2 MiB-aligned interior before anything touches it, and returns the aligned view. Checkpoint tensors are read
into such buffers (formats/safetensors.py `read_tensor`, and `to` for a dtype conversion at load), the fused
attention projections and the expert pools are allocated in them, and `rehome` copies a tensor that already
exists. The kernel decides: with transparent huge pages `never` (/sys/kernel/mm/transparent_hugepage/enabled) or a
refused madvise the same buffer keeps 4 KiB pages, the same bytes and the same results, only slower. Buffers
under 4 MiB, pinned memory and other devices are plain `torch.empty`; Linux only (elsewhere plain).
`anon_huge_bytes` reads how much of the process is on huge pages.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE = 2 << 20  # bytes of a transparent huge page on x86-64
MIN_BYTES = 2 * HUGE  # smaller buffers: not worth the slack
MADV_HUGEPAGE = 14

_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return int(_libc.madvise(addr, length, MADV_HUGEPAGE)) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
          pin: bool = False) -> torch.Tensor:  # fmt: skip
    """torch.empty(shape, dtype) on the CPU, its 2 MiB-aligned pages advised huge before first touch (see the module
    docstring); plain torch.empty for small buffers, other devices and pinned memory (`pin`: page-locked for CUDA
    copies, where a CUDA build of torch has it). The result is a contiguous view that keeps its backing buffer
    alive."""
    dev = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if pin or dev.type != "cpu" or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=dev, pin_memory=pin)
    base = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = -base.data_ptr() % HUGE
    out = base[off : off + nbytes].view(dtype).view(shape)
    advise_huge(out)
    return out


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside CPU tensor t's memory (madvise MADV_HUGEPAGE); whether
    the kernel accepted the advice (False off Linux, for other devices, or with nothing 2 MiB-aligned inside t). Pages
    already touched keep their size until the kernel's khugepaged collapses them."""
    if t.device.type != "cpu":
        return False
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start = ptr + (-ptr % HUGE)
    end = (ptr + nbytes) // HUGE * HUGE
    return _madvise(start, end - start) if end > start else False


def _copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """CPU tensor t copied (converted to `dtype`) into an `empty` buffer."""
    out = empty(tuple(t.shape), dtype)
    out.copy_(t)
    return out


def rehome(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in an `empty` buffer (t itself where it is small or not on the CPU)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
        return t
    return _copy(t, t.dtype)


def to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)` on the CPU, a converted copy landing in an `empty` buffer (t itself when it has that dtype)."""
    if t.dtype == dtype:
        return t
    return _copy(t, dtype) if t.device.type == "cpu" else t.to(dtype)


def anon_huge_bytes() -> int | None:
    """Bytes of this process's anonymous memory on huge pages (/proc/self/smaps_rollup), None where unreadable."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


__all__ = ["advise_huge", "anon_huge_bytes", "empty", "rehome", "to"]
