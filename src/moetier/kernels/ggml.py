"""ggml's CPU dot products for GGUF block types, lent to the decode kernels (csrc/mm.h `MT_KIND_GG`).

A GGUF file's expert (and dense) weights are rows of its own blocks: Q4_0 ... Q8_0, the K-quants, the IQ
types, MXFP4. ggml, the library llama.cpp computes them with, has a CPU dot product for every one of them on
every x86 ISA we meet (AVX2, AVX-512, VNNI, AMX for some), maintained upstream: `ggml_get_type_traits_cpu(t)`
gives a type's `vec_dot` (one weight row against one activation row in the type's `vec_dot_type`, e.g. Q8_K
blocks for Q4_K) and the `from_float` that makes such an activation row. We take them from `ggml-python`
(PyPI, MIT; its sdist vendors ggml and builds it with cmake at install, for the CPU it is built on) and
register each type's pair in our kernel library once (`moetier_gg_register`); from then on a weight of kind
`MT_KIND_GG + type` is read by our MoE call, the native decode step and `gemv` like any other kind, one
`vec_dot` call per (row, activation row), threaded by our own OpenMP loops. Nothing of ggml's graph,
allocator or thread pool is used.

A wheel built with `-march=native` and reused on another CPU would die of SIGILL at the first dot product:
before registering anything, every ISA feature the ggml build reports (`ggml_cpu_has_*`, compile-time in
ggml) is checked against /proc/cpuinfo, and a build that wants a feature this CPU lacks is refused with the
command that rebuilds it (`load_error` says why); the engine then decodes such files to bf16 as before.

Invariants: registration happens once per kernel library and before any kernel reads a ggml kind; a type is
registered only when ggml has both functions for it; `kind_of(name)` is None for a type that is not.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KIND_BASE = 1000  # csrc/mm.h MT_KIND_GG
_MAX_TYPE = 64  # csrc/mm.h MT_GG_TYPES
# ggml_cpu_has_<name> -> the /proc/cpuinfo flag a build with it needs (x86)
_FEATURES = {
    "sse3": "pni", "ssse3": "ssse3", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi2": "bmi2",
    "avx_vnni": "avx_vnni", "avx512": "avx512f", "avx512_vbmi": "avx512vbmi", "avx512_vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16", "amx_int8": "amx_int8",
}  # fmt: skip
# types never registered: plain floats are the bf16 path's, and the rest have no CPU dot product of their own
_SKIP = {"F32", "F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K"}

_errors: dict[str, str] = {}
_quantizer: list[Any] = []  # ggml_quantize_chunk, once ggml is loaded


class _Traits(ctypes.Structure):
    """ggml-cpu.h `struct ggml_type_traits_cpu`."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


@functools.cache
def _ggml() -> ctypes.CDLL | None:
    """ggml-python's CPU library, loaded and initialised, or None (`_errors["load"]` says why)."""
    spec = importlib.util.find_spec("ggml")
    if spec is None or spec.origin is None:
        _errors["load"] = "ggml-python is not installed (pip install ggml-python)"
        return None
    libdir = Path(spec.origin).parent / "lib"
    try:
        base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"))
    except OSError as exc:
        _errors["load"] = f"cannot load ggml-python's CPU library from {libdir}: {exc}"
        return None
    flags = _cpu_flags()
    if flags is not None:  # Linux: check the build against this CPU (elsewhere ggml reports no x86 feature)
        missing = []
        for name, flag in _FEATURES.items():
            fn = getattr(cpu, f"ggml_cpu_has_{name}", None)
            if fn is not None and fn() and flag not in flags:
                missing.append(name)
        if missing:
            _errors["load"] = (
                f"ggml-python in {libdir.parent} was built for another CPU (it uses {', '.join(missing)}, which this "
                "CPU lacks); rebuild it here: pip install --force-reinstall --no-binary ggml-python --no-cache-dir "
                "ggml-python"
            )
            return None
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    q = base.ggml_quantize_chunk  # type, src, dst, start, nrows, n_per_row, imatrix -> bytes written
    q.restype = ctypes.c_size_t
    q.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]  # fmt: skip
    needs = base.ggml_quantize_requires_imatrix
    needs.restype, needs.argtypes = ctypes.c_bool, [ctypes.c_int]
    _quantizer.extend((q, needs))
    return cpu


def load_error() -> str | None:
    """Why ggml's dot products are not available (None when they are, or before anyone asked)."""
    return _errors.get("load")


def available() -> bool:
    return _ggml() is not None


def traits(type_name: str) -> tuple[int, int, int] | None:
    """(vec_dot, from_float of its vec_dot_type, vec_dot_type id) addresses for a GGUF type name, or None."""
    cpu = _ggml()
    if cpu is None or type_name in _SKIP or type_name not in GGMLQuantizationType.__members__:
        return None
    t = GGMLQuantizationType[type_name]
    if t.value >= _MAX_TYPE:
        return None
    tr = cpu.ggml_get_type_traits_cpu(t.value).contents
    if not tr.vec_dot:
        return None
    vt = tr.vec_dot_type
    if vt not in {m.value for m in GGMLQuantizationType} or GGMLQuantizationType(vt) not in GGML_QUANT_SIZES:
        return None
    vtr = cpu.ggml_get_type_traits_cpu(vt).contents
    if not vtr.from_float:
        return None
    return int(tr.vec_dot), int(vtr.from_float), vt


# registered kernel libraries: id(lib) -> type names registered in it
_registered: dict[int, frozenset[str]] = {}


def register(lib: ctypes.CDLL) -> frozenset[str]:
    """Register every GGUF type ggml computes in kernel library `lib` (once per library); the names registered
    (empty when ggml is not available)."""
    done = _registered.get(id(lib))
    if done is not None:
        return done
    names = []
    fn = lib.moetier_gg_register  # argument types set by kernels/native.py
    # quantised types first: they share few vec_dot types (Q8_0, Q8_1, Q8_K), then F16 / BF16
    order = sorted(GGMLQuantizationType.__members__, key=lambda n: (n in ("F16", "BF16"), n))
    for name in order:
        tr = traits(name)
        if tr is None:
            continue
        dot, frm, vt = tr
        blck, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        vblk, vsize = GGML_QUANT_SIZES[GGMLQuantizationType(vt)]
        if fn(GGMLQuantizationType[name].value, dot, blck, tsize, vt, frm, vblk, vsize) == 0:
            names.append(name)
    got = frozenset(names)
    _registered[id(lib)] = got
    return got


def kind_of(type_name: str, lib: ctypes.CDLL) -> int | None:
    """The kernel kind of GGUF type `type_name` in `lib` (registered), or None."""
    if type_name not in register(lib):
        return None
    return KIND_BASE + GGMLQuantizationType[type_name].value


def row_bytes(type_name: str, k: int) -> int:
    blck, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return k // blck * tsize


def type_name(kind: int) -> str | None:
    """The GGUF type name of kernel kind `kind`, or None."""
    t = kind - KIND_BASE
    return GGMLQuantizationType(t).name if t in {m.value for m in GGMLQuantizationType} else None


def block_of(type_name: str) -> int:
    """Values per block of a GGUF type."""
    return int(GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0])


def quantize(type_name: str, w: torch.Tensor, rows: int = 4096, threads: int | None = None) -> torch.Tensor | None:
    """w [N, K] (any float dtype) in GGUF type `type_name`'s blocks by ggml's own quantiser (`ggml_quantize_chunk`,
    what llama-quantize runs; no importance matrix), uint8 [N, row bytes]; None without ggml, for a type that needs
    an importance matrix, or K not a whole number of blocks. Rows go `rows` at a time (bounded fp32 temporaries),
    on `threads` threads (default torch's; ctypes releases the GIL, and every row is quantised on its own, so the
    bytes do not depend on it)."""
    if _ggml() is None or not _quantizer or type_name not in GGMLQuantizationType.__members__ or w.dim() != 2:
        return None
    n, k = w.shape
    t = GGMLQuantizationType[type_name].value
    if k % block_of(type_name) or _quantizer[1](t):
        return None
    out = torch.empty((n, row_bytes(type_name, k)), dtype=torch.uint8)

    def one(r: int) -> None:
        chunk = w[r : r + rows].float().contiguous()  # [rows, K]
        got = _quantizer[0](t, chunk.data_ptr(), out[r].data_ptr(), 0, chunk.shape[0], k, None)
        if got != chunk.shape[0] * out.shape[1]:
            raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes for {chunk.shape[0]} rows of {type_name}")

    starts = range(0, n, rows)
    workers = min(len(starts), threads or torch.get_num_threads())
    if workers <= 1:
        for r in starts:
            one(r)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="moetier-ggml-quantize") as pool:
            list(pool.map(one, starts))  # re-raises a worker's error
    return out
