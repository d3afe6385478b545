"""Builds and loads the project's one C kernel (csrc/sparse_swiglu.c) with the system compiler.

Why C of our own: no library has a CPU kernel that gathers the rows of active neurons of several
experts and fuses gate, mask, up, down and the weighted combine into one call; composed from torch
ops the same math costs a dozen dispatches per expert (~5 us each), more than the skipped rows save
at decode. The kernel is plain C the compiler vectorises; it is built once per source, compiler and
CPU into the cache folder ($MOETIER_CACHE, else $XDG_CACHE_HOME/moetier, else ~/.cache/moetier)
and loaded with ctypes, so no Python headers are needed. Where no compiler works, `load()` returns
None with the reason in `load_error()` and callers fall back to torch ops. MOETIER_NATIVE=0 turns
the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "sparse_swiglu.c"
ABI = 1
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [
    _P, _I64, _I64, _I64, _I64, ctypes.c_float,  # x, n_tok, H, I, block, thr
    _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.POINTER(ctypes.c_int32),  # n_exp, wptr, start, tok
    ctypes.POINTER(ctypes.c_float),  # rw
    _P, ctypes.c_int, _P,  # out, accumulate, mask_out
    _P, _P, _P, _P, ctypes.c_int,  # xs, act, flat, ys, nthreads
]  # fmt: skip
_error: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("MOETIER_CACHE") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    return (base if os.environ.get("MOETIER_CACHE") else base / "moetier") / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent build or reader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None when it cannot be had."""
    global _error
    if os.environ.get("MOETIER_NATIVE", "1") == "0":
        _error = "turned off by MOETIER_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _error = "no C compiler found (set CC, or install cc/gcc/clang)"
        return None
    torch.zeros(1).add_(1)  # torch's libgomp is loaded before ours binds to it
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cc.encode(), " ".join(FLAGS).encode(),
                                     _cpu_id().encode(), platform.machine().encode()])).hexdigest()[:16]  # fmt: skip
    target = cache_dir() / f"sparse_swiglu-{key}.so"
    try:
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
        if lib.moetier_sparse_abi() != ABI:
            raise RuntimeError(f"{target}: kernel ABI {lib.moetier_sparse_abi()}, expected {ABI}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _error = str(exc)
        return None
    for name in ("moetier_sparse_moe_bf16", "moetier_sparse_moe_f32"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int64, _ARGTYPES
    return lib


def load_error() -> str | None:
    """Why `load()` returned None (None if it has not failed)."""
    return _error
