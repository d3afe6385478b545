"""Builds and loads the project's C kernels (csrc/sparse_swiglu.c, csrc/mm.c, csrc/step.c) with the system compiler.

Why C of our own: no library has a CPU kernel that gathers the rows of active neurons of several
experts and fuses gate, mask, up, down and the weighted combine into one call; composed from torch
ops the same math costs a dozen dispatches per expert (~5 us each), more than the skipped rows save
at decode. The decode kernels (kernels/decode.py, kernels/step.py) run a layer's attention half and
its MoE half in one call each, on our own pool slots (docs/engine.md says why no library was taken).
The sources are C with AVX-512 (BF16 + VNNI) and AVX2 (+ VNNI) paths chosen at compile time
(csrc/mm.h); they are built with -march=native into one library once per source, compiler (path
and version), flags and CPU into the cache folder (`cache_dir(root)`: ROOT/kernels, ROOT =
RuntimeConfig.kernel_cache, default ~/.cache/moetier) and loaded with ctypes, so no Python headers
are needed. Compilers are tried in order (cc, gcc, clang); a failed build leaves a `.failed` note
with its error, so later starts skip that compiler at once. Where none works, `load()` returns None
with the reasons in `load_error()` and callers fall back to torch ops.

`isa` builds a lower path than the CPU's best for tests ("avx2", "avx2-novnni", "c": csrc/mm.h's
MT_FORCE_* macros; "novbmi": the best without AVX512-VBMI), so every path a CPU can run is checked against the
float64 reference on it.

Invariants: every switch is an argument (`enabled` = RuntimeConfig.native_kernels, `cache_dir` =
RuntimeConfig.kernel_cache, `isa`); nothing here reads the environment. `load` is cached per argument
triple, so one process builds or opens a library once per cache folder and path; a build is written to
a temp file and renamed, so a concurrent reader never sees half a library.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "sparse_swiglu.c", _CSRC / "mm.c", _CSRC / "step.c")
HEADERS = (_CSRC / "bf16.h", _CSRC / "mm.h", _CSRC / "step.h")  # included by the sources: part of the build key
ABI = 5  # csrc/sparse_swiglu.c
# csrc/step.c (5: kind 9, fp8 e4m3fn rows; 6: expert biases, the GPT-OSS activation; 7: sinks, window; 8: MT_FP4;
# 9: id -1 skips a pair; 10: mt_w.rows, bf16 down rows [I, H] in slot descriptors, MT_ROWS; 11: MT_FP4's scales are
# the blocks' e8m0 exponent bytes uint8 [N, K / 32], widened in the kernels, not bf16 scales; group 32 only; 12:
# mt_step.xw, the wide (fp32) residual stream, and moetier_head's xw / fp32 logits arguments)
DECODE_ABI = 12
LIB_PREFIX = "moetier-kernels-"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS: dict[str, tuple[str, ...]] = {  # csrc/mm.h: the path each build compiles
    "native": (),  # the best the CPU has
    "avx2": ("-DMT_FORCE_AVX2",),  # AVX2 (+ 256-bit VNNI where the CPU has it)
    "avx2-novnni": ("-DMT_FORCE_AVX2", "-DMT_NO_VNNI"),
    "c": ("-DMT_FORCE_C",),
    "novbmi": ("-mno-avx512vbmi",),  # the CPU's best without AVX512-VBMI (fp8 rows by word tables, Cooper Lake)
}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = [
    _P, _I64, _I64, _I64, _I64, ctypes.c_float,  # x, n_tok, H, I, block, thr
    _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.POINTER(ctypes.c_int32),  # n_exp, wptr, start, tok
    ctypes.POINTER(ctypes.c_float),  # rw
    _P, ctypes.c_int, _P,  # out, accumulate, mask_out
    _P, _P, _P, _P, ctypes.c_int,  # xs, act, flat, ys, nthreads
]  # fmt: skip
_QUANT_ARGTYPES: list[Any] = [
    _P, ctypes.c_int, _I64, _I64, _I64, _I64, ctypes.c_float,  # x, x_bf16, n_tok, H, I, block, thr
    _I64, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64),  # bits, g, n_exp, wptr (6 per expert), start
    ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float),  # tok, rw
    _P, ctypes.c_int, _P,  # out, accumulate, mask_out
    _P, _P, _P, _P, _P, _P, ctypes.c_int,  # xs, act, flat, ys, wbuf, qbuf (int4 integer path), nthreads
]  # fmt: skip
_I = ctypes.c_int
_DECODE_ARGTYPES: dict[str, list[Any]] = {
    "moetier_decode_abi": [],
    "moetier_decode_isa": [],
    "moetier_gemv_scratch_bytes": [_I64, _I64, _I],  # M, K, kind
    "moetier_moe_scratch_bytes": [_I64, _I64, _I64, _I64],  # T, H, I, P
    # x, M, K, N, kind, q, scale, zero, group, y, scratch, nthreads
    "moetier_gemv": [_P, _I64, _I64, _I64, _I, _P, _P, _P, _I64, _P, _P, _I],
    "moetier_rms_norm": [_P, _P, _I64, _I64, ctypes.c_float, _P],  # x, w, M, H, eps, y
    "moetier_f16_roundtrip": [_P, _I64, _P, _P],  # x fp32, n, h fp16, back fp32 (tests)
    # x, T, H, I, n_exp, desc, start, tok, rw, out, accumulate, scratch, nthreads
    "moetier_moe": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I, _P, _I],
    # the decode step (csrc/step.h; structs by pointer, kernels/step.py)
    "moetier_isa_name": [],
    "moetier_attn_scratch_bytes": [_P, _I64, _I64, _I64],  # layer, T, max_len, nthreads
    "moetier_attn_half": [_P, _P],  # layer, step
    "moetier_moe_half_scratch_bytes": [_P, _I64],  # moe, T
    "moetier_moe_half": [_P, _P, _P, _I64],  # moe, step, desc pointers [E], mode
    "moetier_head_scratch_bytes": [_P, _I64],  # head, T
    "moetier_head": [_P, _P, _P, _I64, _P, _P, _P, _I64, _I64],  # head, x, xw, T, logits, logits_w, scratch, ...
    # ggml's block types (csrc/mm.h, kernels/ggml.py): type, vec_dot, blck, tsize, vec_dot_type, from_float, vblk, vsize
    "moetier_gg_register": [_I64, _P, _I64, _I64, _I64, _P, _I64, _I64],
}
_RESTYPES: dict[str, Any] = {
    "moetier_rms_norm": None, "moetier_f16_roundtrip": None, "moetier_isa_name": ctypes.c_char_p,
}  # fmt: skip
_errors: dict[tuple[bool, Path, str], str] = {}  # (enabled, root, isa) -> why load() returned None


def cache_root(root: Path | str | None = None) -> Path:
    """The cache folder: `root` (RuntimeConfig.kernel_cache) or, when None, ~/.cache/moetier."""
    return Path(root) if root is not None else Path.home() / ".cache" / "moetier"


def cache_dir(root: Path | str | None = None) -> Path:
    """Where kernel builds live: ROOT/kernels (see `cache_root`)."""
    return cache_root(root) / "kernels"


def _compilers() -> list[str]:
    """Paths of the compilers to try, in order, without duplicates."""
    out: list[str] = []
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in out}:
            out.append(path)
    return out


def _version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=20)
        return done.stdout.splitlines()[0] if done.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_info() -> tuple[str, list[str]]:
    """(model name, ISA flags) of the first CPU listed in /proc/cpuinfo; ("", []) where it cannot be read. The one
    reader of the CPU's model and flags for profiles and benchmarks (`_cpu_id` keeps its raw lines for cache keys)."""
    model, flags = "", None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return model, flags or []


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _key(source: bytes, cc: str, flags: tuple[str, ...]) -> str:
    parts = [source, os.path.realpath(cc).encode(), _version(cc).encode(), " ".join(flags).encode(),
             _cpu_id().encode(), platform.machine().encode()]  # fmt: skip
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(cc: str, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, *(str(src) for src in SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent build or reader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.moetier_sparse_abi() != ABI:
        raise RuntimeError(f"{path}: kernel ABI {lib.moetier_sparse_abi()}, expected {ABI}")
    if lib.moetier_decode_abi() != DECODE_ABI:
        raise RuntimeError(f"{path}: decode kernel ABI {lib.moetier_decode_abi()}, expected {DECODE_ABI}")
    for name in ("moetier_sparse_moe_bf16", "moetier_sparse_moe_f32"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int64, _ARGTYPES
    lib.moetier_sparse_moe_quant.restype, lib.moetier_sparse_moe_quant.argtypes = ctypes.c_int64, _QUANT_ARGTYPES
    qbytes = lib.moetier_sparse_quant_qbytes  # x_bf16, H, I, bits, group, n_tok, pairs, nthreads
    qbytes.restype, qbytes.argtypes = ctypes.c_int64, [ctypes.c_int, *[_I64] * 7]
    for name, argtypes in _DECODE_ARGTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _RESTYPES.get(name, ctypes.c_int64), argtypes
    return lib


def load(enabled: bool = True, cache_dir: Path | str | None = None, isa: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use into `cache_dir`/kernels, see `cache_root`), or
    None when it cannot be had or `enabled` is False (RuntimeConfig.native_kernels). `isa`: see ISA_FLAGS."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown kernel path {isa!r}; one of {sorted(ISA_FLAGS)}")
    return _load(bool(enabled), cache_root(cache_dir), isa)


@functools.cache
def _load(enabled: bool, root: Path, isa: str) -> ctypes.CDLL | None:
    key = (enabled, root, isa)
    flags = (*FLAGS, *ISA_FLAGS[isa])
    if not enabled:
        _errors[key] = "turned off (native_kernels = False, --no-native)"
        return None
    compilers = _compilers()
    if not compilers:
        _errors[key] = "no C compiler found (install cc, gcc or clang)"
        return None
    torch.zeros(1).add_(1)  # torch's libgomp is loaded before ours binds to it
    errors = []
    try:
        source = b"\0".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    except OSError as exc:
        _errors[key] = f"kernel source missing: {exc}"
        return None
    for cc in compilers:
        target = root / "kernels" / f"{LIB_PREFIX}{_key(source, cc, flags)}.so"
        failed = target.with_suffix(".failed")
        try:
            if not target.exists():
                if failed.exists():
                    raise RuntimeError(failed.read_text().strip() + f" (remembered in {failed}; delete it to retry)")
                try:
                    _build(cc, target, flags)
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    with contextlib.suppress(OSError):
                        failed.write_text(str(exc) + "\n")
                    raise
            lib = _open(target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{cc}: {exc}")
            continue
        _errors.pop(key, None)
        return lib
    _errors[key] = "; ".join(errors)
    return None


def clear_cache() -> None:
    """Forget loaded libraries and errors (tests; a later `load` opens or builds again)."""
    _load.cache_clear()
    _errors.clear()


def load_error(enabled: bool = True, cache_dir: Path | str | None = None, isa: str = "native") -> str | None:
    """Why `load(enabled, cache_dir, isa)` returned None (None if it has not failed)."""
    return _errors.get((bool(enabled), cache_root(cache_dir), isa))


def build_key_of(lib: ctypes.CDLL) -> str:
    """The key of a loaded kernel build (source, compiler, flags, CPU), read from its file name."""
    return Path(lib._name).stem.removeprefix(LIB_PREFIX)


def build_key(enabled: bool = True, cache_dir: Path | str | None = None) -> str:
    """The key of the kernel build `load(enabled, cache_dir)` gives, or "none"."""
    lib = load(enabled, cache_dir)
    return build_key_of(lib) if lib is not None else "none"
