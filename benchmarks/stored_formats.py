"""Stored expert formats of the benchmark checkpoint: bytes per expert, decode speed warm and cold at a 25% host
budget, and KL divergence to the bf16 model (issue 16, "What to measure").

The benchmark checkpoint (`benchmarks/_models.py`, `.bench/qwen3moe-bench`, bf16 safetensors, Qwen3-MoE shape)
is stored in each format below; every format runs through the engine's Python API with
`PrecisionConfig(mode="stored")` (pool slots hold the stored bytes, dequantised per call) and with mode "full"
(dequantised into bf16 slots when read):

- `bf16`: the checkpoint itself, mode full only: the anchor.
- `fp8`: FP8 e4m3, block 128x128, `weight_scale_inv` fp32 per block (scale = block amax / 448, round to
  nearest e4m3), `quantization_config = {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
  activation_scheme: dynamic}`; every linear weight of the experts and of attention is quantised, as DeepSeek-V3
  and Qwen3-FP8 do; norms, the router gate, the embeddings and lm_head stay bf16.
- `gptq`: GPTQ int4, group 128, v1 (`checkpoint_format: gptq`), symmetric, no act-order; `awq`: AWQ int4 GEMM,
  group 128, zero point. Both are round-to-nearest (min/max per group, no calibration data, no Hessian); the
  quantisers are the reference ones of tests/formats/quant_ref.py (`gptq_quantise`, `awq_quantise`), which
  the stored-precision tests load; the same tensors as fp8 are quantised.
  The three are written once under `--cache-dir`/stored/ (git-ignored), one tensor at a time (data to a
  temporary file, then the safetensors header, then the data), and skipped when present.
- `gguf-q8_0`, `gguf-q4_k_m` (and `gguf-bf16`, not in the default list): the GGUF files that
  benchmarks/vs_llamacpp.py makes in `--cache-dir`/llamacpp/gguf/ (run it first); moetier opens a .gguf path.
  llama.cpp quantizes attention and the output head as well (see vs_llamacpp's tensor-type table).
Dense (non-expert) weights are dequantised to bf16 once at load in every format; so the formats differ in their
experts only, except for the KL, which also sees the quantised attention (and lm_head for GGUF).

Measured, per candidate `FORMAT/MODE`:
1. **Bytes per expert**: on disk (the expert tensors of the checkpoint file(s), scales and zeros included,
   over layers x experts) and in a pool slot (`engine.store.slot_bytes`), each against bf16's.
2. **KL divergence** to the same model in bf16: the reference is `moetier eval --kl-ref full`'s
   (runtime/quality.py `reference_config`: the bf16 checkpoint computed in fp32, every expert resident),
   recorded once with `collect`, and each candidate is scored with `compare` over the same windows
   (mean KL with its standard error, p99, top-1 agreement). Text: data/shakespeare_heldout.txt tokenized with
   the bundled model's tokenizer (ids < 4096 of the 32000-token vocabulary), `--kl-tokens` tokens in windows of
   `--kl-window`. Candidates run at their default runtime (bf16, native kernels when they load), all experts
   resident. The `bf16/full` row is the bf16 arithmetic's own distance to the fp32 reference.
3. **Decode tok/s**, page cache warm and cold, at a host expert budget of `--budget` (default 0.25) of the bf16
   expert bytes (`Budgets(host_expert_bytes=...)`, the same number of bytes for every candidate; the budget counts
   slot bytes, so a format with smaller slots keeps more experts resident). Each run is a fresh load, an untimed
   2-token generate, then the page cache set, then a timed generate of `--prompt-tokens` prompt tokens and
   `--tokens` new tokens (decode tok/s over new tokens 2..N, the engine's own `decode_tok_s`). Warm: every file
   of the candidate's checkpoint read through once just before. Cold: every such file evicted with
   `os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)` (after `os.sync()`), and `/proc/sys/vm/drop_caches` written
   too when that is allowed (root outside a container); moetier reads experts with pread (no mmap), so nothing
   it holds pins those pages. The share of the files still resident after the drop is measured with mincore(2)
   and printed (it is the check that the drop worked). Non-expert weights are in memory by then in both states.
   A warm-up round (not counted), then `--rounds` rounds, each running every candidate warm and cold,
   interleaved; medians are reported, with hits, misses and the expert bytes read from disk per token.
4. `--llamacpp`: decode tok/s of moetier on qwen3moe-bench-Q4_K_M.gguf (modes stored and full, all experts
   resident, a 1-token prompt then `--tokens` new tokens) beside `llama-bench -m FILE -t T -p 0 -n N -r 1`
   (llama.cpp built by benchmarks/vs_llamacpp.py in `--cache-dir`/llamacpp/build), `--llamacpp-rounds` rounds
   (default 1), interleaved. llama-bench times all N tokens from an empty context after its own warm-up pass;
   moetier's number is over tokens 2..N after a 2-token warm-up generate.

Prints the CPU, its ISA flags (AMX present or not) and the decode kernels' ISA (kernels/decode.py `isa()`, via
the engine's `kernels` stat), the conversion times, a table, then one JSON line.

    python benchmarks/stored_formats.py [--formats bf16,fp8,gptq,awq,gguf-q8_0,gguf-q4_k_m] [--modes stored,full]
        [--rounds 3] [--tokens 64] [--prompt-tokens 16] [--kl-tokens 512] [--kl-window 256] [--budget 0.25]
        [--threads 2] [--no-speed] [--no-quality] [--llamacpp] [--llamacpp-rounds 1] [--cache-dir .bench]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks.*` from any cwd
sys.path.insert(1, str(REPO / "tests" / "formats"))  # the reference quantisers (quant_ref.py)

import torch  # noqa: E402

import moetier  # noqa: E402
from benchmarks._models import qwen3_bench_model  # noqa: E402
from benchmarks.vs_llamacpp import (  # noqa: E402
    cpu_isa,
    get_llamacpp,
    gguf_dir,
    llama_bench,
)

TOKENIZER = REPO / "models" / "tiny-shakespeare-moe"
TEXT = REPO / "data" / "shakespeare_heldout.txt"
DEFAULT_FORMATS = "bf16,fp8,gptq,awq,gguf-q8_0,gguf-q4_k_m"
GGUF_FILES = {"gguf-q8_0": "Q8_0", "gguf-q4_k_m": "Q4_K_M", "gguf-bf16": "bf16"}
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
             torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}  # fmt: skip
ST_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F8_E4M3": 1, "U8": 1, "I8": 1, "F8_E5M2": 1}


def log(msg: str) -> None:
    print(f"[stored_formats] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. converted checkpoints


def fp8_block_quantise(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N/b), ceil(K/b)]), W ~ q * scale of its block.
    quant_ref.fp8_quantise's rule (scale = block amax / 448, round to nearest), vectorised."""
    n, k = w.shape
    gn, gk = -(-n // b), -(-k // b)
    wp = torch.zeros(gn * b, gk * b, dtype=torch.float32)
    wp[:n, :k] = w.float()
    blocks = wp.view(gn, b, gk, b)  # [gn, b, gk, b]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [gn, gk]
    q = (blocks / scale[:, None, :, None]).view(gn * b, gk * b)[:n, :k].to(torch.float8_e4m3fn)  # [N, K]
    return q.contiguous(), scale


def encode_tensor(method: str, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One checkpoint tensor -> the tensors the quantised checkpoint stores for it."""
    from quant_ref import awq_quantise, gptq_quantise, quantisable

    if not quantisable(name, t):
        return {name: t}
    if method == "fp8":
        q, s = fp8_block_quantise(t, 128)
        return {name: q, name + "_scale_inv": s}
    base = name.removesuffix(".weight")
    parts = gptq_quantise(t, 128, sym=True, v1=True, act_order=False) if method == "gptq" else awq_quantise(t, 128)
    return {f"{base}.{k}": v for k, v in parts.items()}


QCONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            "modules_to_not_convert": ["lm_head"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}  # fmt: skip


def convert(src: Path, out: Path, method: str) -> float | None:
    """Write `out` (safetensors + config.json with quantization_config) from `src`, one tensor at a time; None
    when it exists already, else the seconds it took. config.json is written last: it marks a finished folder."""
    if (out / "config.json").exists():
        return None
    from safetensors import safe_open

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    with tempfile.TemporaryFile(dir=out) as data:
        for f in sorted(src.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    for oname, ot in encode_tensor(method, name, st.get_tensor(name)).items():
                        raw = ot.contiguous().view(torch.uint8).numpy().tobytes() if ot.numel() else b""
                        header[oname] = {"dtype": ST_DTYPES[ot.dtype], "shape": list(ot.shape),
                                         "data_offsets": [pos, pos + len(raw)]}  # fmt: skip
                        data.write(raw)
                        pos += len(raw)
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        tmp = out / "model.safetensors.tmp"
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(head)) + head)
            data.seek(0)
            shutil.copyfileobj(data, fh, 16 << 20)
        tmp.rename(out / "model.safetensors")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": QCONFIGS[method]}, indent=1))
    return time.perf_counter() - t0


# ---------------------------------------------------------------- 2. formats, files, bytes


@dataclass
class Fmt:
    name: str
    path: Path  # what moetier.load opens: a folder or a .gguf file
    modes: tuple[str, ...]
    convert_s: float | None = None

    @property
    def files(self) -> list[Path]:
        return [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))


def safetensors_expert_bytes(folder: Path) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__" and ".mlp.experts." in name:
                total += meta["data_offsets"][1] - meta["data_offsets"][0]
    return total


def gguf_expert_bytes(path: Path) -> int:
    from moetier.formats.gguf import read_gguf_model

    _, _, tensors = read_gguf_model(path)
    return sum(t.nbytes for name, t in tensors.items() if "_exps" in name)


def disk_bytes_per_expert(fmt: Fmt, n_experts: int) -> float:
    total = gguf_expert_bytes(fmt.path) if fmt.path.suffix == ".gguf" else safetensors_expert_bytes(fmt.path)
    return total / n_experts


def formats(names: list[str], model: Path, cache: Path) -> dict[str, Fmt]:
    out: dict[str, Fmt] = {}
    for n in names:
        if n == "bf16":
            out[n] = Fmt(n, model, ("full",))
        elif n in QCONFIGS:
            dst = cache / "stored" / f"{model.name}-{n}"
            log(f"{n}: {dst} ({'present' if (dst / 'config.json').exists() else 'converting'})")
            secs = convert(model, dst, n)
            out[n] = Fmt(n, dst, ("stored", "full"), secs)
            if secs is not None:
                log(f"{n}: converted in {secs:.0f} s")
        elif n in GGUF_FILES:
            p = gguf_dir(cache, model) / f"qwen3moe-bench-{GGUF_FILES[n]}.gguf"
            if not p.exists():
                raise SystemExit(f"{p} is missing: run benchmarks/vs_llamacpp.py first (it writes the GGUF files)")
            out[n] = Fmt(n, p, ("stored", "full"))
        else:
            raise SystemExit(f"unknown format {n!r}; known: bf16, {', '.join(QCONFIGS)}, {', '.join(GGUF_FILES)}")
    return out


# ---------------------------------------------------------------- 3. the page cache


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_share(files: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore(2) over a PROT_READ mapping, which faults nothing in)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for p in files:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = -(-size // page)
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec))
                total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def drop_files(files: list[Path]) -> str:
    """Evict the files from the page cache; says how."""
    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "fadvise DONTNEED + drop_caches"
    except OSError:
        return "fadvise DONTNEED"


def warm_files(files: list[Path]) -> None:
    """Read the files through once, so their pages are in the page cache."""
    buf = bytearray(16 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# ---------------------------------------------------------------- 4. runs


@dataclass
class Setup:
    threads: int
    prompt: list[int]
    tokens: int
    budget: int  # host expert bytes for the speed runs
    bf16_expert_bytes: float  # per expert
    n_experts: int  # layers x experts
    cached: dict[str, Any] = field(default_factory=dict)
    dense: str = "full"  # --dense-precision of the quantised formats (the bf16 anchor stays full)


def engine_config(mode: str, budget: int | None, dense: str = "full") -> moetier.EngineConfig:
    return moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget),
        precision=moetier.PrecisionConfig(mode=mode),
        runtime=moetier.RuntimeConfig(device="cpu", dtype="bf16", dense_precision=dense),
    )


def dense_of(s: Setup, fmt: Fmt) -> str:
    """The dense precision a candidate runs at: --dense-precision for the quantised formats, full for bf16."""
    return "full" if fmt.name == "bf16" else s.dense


def speed_run(s: Setup, fmt: Fmt, mode: str, state: str) -> dict[str, Any]:
    """One fresh load at the budget, a warm-up, the page cache set to `state`, one timed generate."""
    torch.set_num_threads(s.threads)
    with moetier.load(str(fmt.path), engine_config(mode, s.budget, dense_of(s, fmt))) as engine:
        engine.generate(s.prompt[:4], max_new_tokens=2, stop_at_eos=False)  # untimed warm-up
        if state == "warm":
            warm_files(fmt.files)
            how = "files read through"
        else:
            how = drop_files(fmt.files)
        resident = resident_share(fmt.files)
        before = engine.stats()
        res = engine.generate(s.prompt, max_new_tokens=s.tokens, stop_at_eos=False)
        after = res.stats
        slot = getattr(engine.store, "slot_bytes", None)
        n_keys = len(getattr(engine.store, "keys", ()) or ())
    if len(res.token_ids) != s.tokens:
        raise RuntimeError(f"generated {len(res.token_ids)} tokens, asked {s.tokens}")
    n = max(s.tokens, 1)
    return {
        "decode": res.decode_tok_s, "ttft_s": res.ttft_s, "resident_after": resident, "cache": how,
        "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
        "disk_bytes_per_token": (after["disk_bytes"] - before["disk_bytes"]) / n,
        "slot_bytes": slot, "keys": n_keys, "kernels": after.get("kernels"), "precision": after.get("precision"),
        "peak_host_expert_bytes": after.get("peak_host_expert_bytes"),
    }  # fmt: skip


def quality_run(fmt: Fmt, mode: str, ids: list[int], window: int, ref: Any, threads: int,
                dense: str = "full") -> dict[str, Any]:  # fmt: skip
    from moetier.runtime.quality import compare

    torch.set_num_threads(threads)
    with moetier.load(str(fmt.path), engine_config(mode, None, dense)) as engine:
        q = compare(engine, ids, window, ref, f"{fmt.name}/{mode}").summary
        slot = getattr(engine.store, "slot_bytes", None)
        kernels = engine.stats().get("kernels")
    return {**q.as_dict(), "ppl": q.ppl, "slot_bytes": slot, "kernels": kernels}


def llamacpp_part(s: Setup, cache: Path, model: Path, tokens: int, rounds: int) -> dict[str, Any]:
    """moetier (stored, full; all experts resident) and llama-bench on the Q4_K_M GGUF, interleaved."""
    path = gguf_dir(cache, model) / "qwen3moe-bench-Q4_K_M.gguf"
    runs: dict[str, list[float]] = {"llamacpp": [], "moetier-stored": [], "moetier-full": []}
    errors: dict[str, str] = {}
    notes: dict[str, Any] = {}
    for rnd in range(rounds):
        for name in runs:
            if name in errors:
                continue
            log(f"llamacpp part, round {rnd + 1}: {name}")
            try:
                if name == "llamacpp":
                    lc = get_llamacpp(cache, "0.3.36", skip_build=True)
                    cmd = [str(lc.tool("llama-bench")), "-m", str(path), "-t", str(s.threads), "-r", "1",
                           "-o", "json", "-p", "0", "-n", str(tokens)]  # fmt: skip
                    row = next(r for r in llama_bench(cmd) if r["n_gen"] > 0)
                    runs[name].append(float(row["avg_ts"]))
                    notes["llamacpp_build"] = row.get("build_commit")
                else:
                    torch.set_num_threads(s.threads)
                    mode = name.removeprefix("moetier-")
                    with moetier.load(str(path), engine_config(mode, None)) as engine:
                        # warm-up long enough that the experts the timed run routes to are resident (they are
                        # read on first use; llama.cpp's mmap of a page-cached file has them all)
                        engine.generate(s.prompt, max_new_tokens=max(64, tokens), stop_at_eos=False)
                        res = engine.generate(s.prompt, max_new_tokens=tokens, stop_at_eos=False)
                        notes[f"{name}_kernels"] = res.stats.get("kernels")
                    runs[name].append(res.decode_tok_s)
            except Exception as e:
                errors[name] = " | ".join(f"{type(e).__name__}: {e}".strip().splitlines()[-3:])[:400]
                log(traceback.format_exc())
    med = {n: statistics.median(v) for n, v in runs.items() if v}
    return {"file": str(path), "tokens": tokens, "rounds": rounds, "runs": runs, "decode": med, "errors": errors,
            "notes": notes}  # fmt: skip


# ---------------------------------------------------------------- 5. report


def fmt_num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated; default {DEFAULT_FORMATS}")
    ap.add_argument("--modes", default="stored,full", help="precision modes to run where a format has them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dense-precision", default="full", choices=("full", "int8", "int4"),
                    help="dense precision of the quantised formats' runs (weights the file keeps in bf16; the "
                         "bf16 anchor stays full)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per timed generate")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="host expert budget, share of the bf16 expert bytes")
    ap.add_argument("--kl-tokens", type=int, default=512, help="tokens scored for KL (0: no quality pass)")
    ap.add_argument("--kl-window", type=int, default=256)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--llamacpp", action="store_true", help="add moetier vs llama-bench on the Q4_K_M GGUF")
    ap.add_argument("--llamacpp-rounds", type=int, default=1)
    ap.add_argument("--cache-dir", default=".bench")
    args = ap.parse_args()
    cache = Path(args.cache_dir).resolve()
    torch.set_num_threads(args.threads)
    model = qwen3_bench_model(cache).resolve()
    config = json.loads((model / "config.json").read_text())
    n_experts = config["num_hidden_layers"] * config.get("num_local_experts", config.get("num_experts"))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    t0 = time.perf_counter()
    with_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # conversions: one thread, so they stay modest beside other work
    fmts = formats([f.strip() for f in args.formats.split(",") if f.strip()], model, cache)
    torch.set_num_threads(with_threads)
    log(f"formats ready in {time.perf_counter() - t0:.0f} s")
    cands = [(f, m) for f in fmts.values() for m in f.modes if m in modes]

    bf16_total = safetensors_expert_bytes(model)
    bf16_per_expert = bf16_total / n_experts
    budget = int(bf16_total * args.budget)
    from transformers import AutoTokenizer

    text_ids = list(AutoTokenizer.from_pretrained(str(TOKENIZER)).encode(TEXT.read_text(), add_special_tokens=False))
    s = Setup(args.threads, text_ids[: args.prompt_tokens], args.tokens, budget, bf16_per_expert, n_experts,
              dense=args.dense_precision)  # fmt: skip
    isa = cpu_isa()
    rows: dict[str, dict[str, Any]] = {}
    for f, m in cands:
        rows[f"{f.name}/{m}"] = {"disk_bytes_per_expert": disk_bytes_per_expert(f, n_experts), "errors": {}}

    # quality: the fp32 reference of the bf16 checkpoint once, then each candidate over the same windows
    ref_info: dict[str, Any] = {}
    if not args.no_quality and args.kl_tokens > 0:
        from moetier.runtime.quality import collect, reference_config

        ids = text_ids[: args.kl_tokens + 1]
        window = min(args.kl_window, len(ids) - 1)
        t1 = time.perf_counter()
        with moetier.load(str(model), reference_config(engine_config("full", None))) as ref_engine:
            ref = collect(ref_engine, ids, window, {"model": str(model), "text": str(TEXT)})
        ref_info = {"ref": "bf16 checkpoint, fp32 compute, all experts resident (reference_config)",
                    "tokens": ref.tokens, "window": window, "ref_ppl": math.exp(ref.nll_sum / ref.tokens),
                    "ref_s": round(time.perf_counter() - t1, 1)}  # fmt: skip
        for f, m in cands:
            name = f"{f.name}/{m}"
            log(f"quality: {name}")
            try:
                rows[name]["quality"] = quality_run(f, m, ids, window, ref, args.threads, dense_of(s, f))
            except Exception as e:
                rows[name]["errors"]["quality"] = " | ".join(f"{type(e).__name__}: {e}".splitlines()[-3:])[:400]
                log(traceback.format_exc())
        del ref

    # speed: warm-up round 0, then interleaved rounds; each candidate warm then cold
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"warm": [], "cold": []} for n in rows}
    if not args.no_speed:
        for rnd in range(args.rounds + 1):
            for f, m in cands:
                name = f"{f.name}/{m}"
                for state in ("warm", "cold"):
                    if f"speed_{state}" in rows[name]["errors"]:
                        continue
                    log(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: {name} {state}")
                    try:
                        r = speed_run(s, f, m, state)
                    except Exception as e:
                        msg = " | ".join(f"{type(e).__name__}: {e}".strip().splitlines()[-3:])[:400]
                        rows[name]["errors"][f"speed_{state}"] = msg
                        log(traceback.format_exc())
                        continue
                    if rnd > 0:
                        runs[name][state].append(r)
    for name, row in rows.items():
        slot = next((r["slot_bytes"] for st in ("warm", "cold") for r in runs[name][st]), None)
        slot = slot or row.get("quality", {}).get("slot_bytes")
        row["slot_bytes"] = slot
        row["x_bf16_disk"] = row["disk_bytes_per_expert"] / bf16_per_expert
        row["x_bf16_slot"] = slot / bf16_per_expert if slot else None
        row["resident_share_at_budget"] = min(1.0, (budget // slot) / n_experts) if slot else None
        for st in ("warm", "cold"):
            rs = runs[name][st]
            if not rs:
                continue
            row[st] = {
                "decode": statistics.median(r["decode"] for r in rs),
                "decode_runs": [round(r["decode"], 2) for r in rs],
                "disk_bytes_per_token": statistics.median(r["disk_bytes_per_token"] for r in rs),
                "hit_rate": sum(r["hits"] for r in rs) / max(1, sum(r["hits"] + r["misses"] for r in rs)),
                "resident_after": [None if r["resident_after"] is None else round(r["resident_after"], 4) for r in rs],
                "cache": rs[-1]["cache"], "kernels": rs[-1]["kernels"], "precision": rs[-1]["precision"],
            }  # fmt: skip
    kernels = next((v for row in rows.values() for st in ("warm", "cold", "quality")
                    if (v := (row.get(st) or {}).get("kernels"))), None)  # fmt: skip
    lc = llamacpp_part(s, cache, model, args.tokens, args.llamacpp_rounds) if args.llamacpp else None

    # report
    amx = [f for f in isa["flags"] if f.startswith("amx")]
    print(f"cpu: {isa['cpu']}; ISA flags: {' '.join(isa['flags']) or '-'}; AMX: {'yes' if amx else 'no'}; "
          f"torch capability {isa['torch_capability']}; decode kernels: {kernels}; torch {torch.__version__}; "
          f"threads {args.threads}")  # fmt: skip
    print(f"bf16 expert: {bf16_per_expert / 2**20:.2f} MiB, {n_experts} experts; host budget {budget / 2**20:.0f} MiB "
          f"= {args.budget:.0%} of the bf16 expert bytes; {args.rounds} rounds x {args.tokens} tokens after a "
          f"{args.prompt_tokens}-token prompt; dense precision of the quantised formats: "
          f"{args.dense_precision}")  # fmt: skip
    for f in fmts.values():
        if f.convert_s is not None:
            print(f"converted {f.name} in {f.convert_s:.0f} s -> {f.path}")
    if ref_info:
        print(f"KL reference: {ref_info['ref']}; {ref_info['tokens']} tokens of {TEXT.name}, window "
              f"{ref_info['window']}; reference ppl {ref_info['ref_ppl']:.2f}")  # fmt: skip
    print(f"{'candidate':<22}{'disk/exp':>10}{'x bf16':>8}{'slot/exp':>10}{'x bf16':>8}{'resid':>7}{'warm':>8}"
          f"{'cold':>8}{'c/w':>6}{'MiB/tok':>9}{'KL mean':>10}{'± se':>9}{'top-1':>8}  notes")  # fmt: skip
    for name, row in rows.items():
        w, c, q = row.get("warm") or {}, row.get("cold") or {}, row.get("quality") or {}
        cw = c["decode"] / w["decode"] if c.get("decode") and w.get("decode") else None
        notes = []
        if c:
            notes.append(f"cold {c['cache']}, resident after drop {c['resident_after']}, hit {c['hit_rate']:.0%}")
        notes += [f"{k}: {v}" for k, v in row["errors"].items()]
        print(f"{name:<22}{row['disk_bytes_per_expert'] / 2**10:>9.0f}K{row['x_bf16_disk']:>8.3f}"
              f"{fmt_num(row['slot_bytes'] and row['slot_bytes'] / 2**10, '.0f'):>9}K"
              f"{fmt_num(row['x_bf16_slot'], '.3f'):>8}"
              f"{fmt_num(row['resident_share_at_budget'] and 100 * row['resident_share_at_budget'], '.0f'):>6}%"
              f"{fmt_num(w.get('decode'), '.2f'):>8}{fmt_num(c.get('decode'), '.2f'):>8}{fmt_num(cw, '.2f'):>6}"
              f"{fmt_num(c.get('disk_bytes_per_token') and c['disk_bytes_per_token'] / 2**20, '.1f'):>9}"
              f"{fmt_num(q.get('kl_mean'), '.5f'):>10}{fmt_num(q.get('kl_stderr'), '.1e'):>9}"
              f"{fmt_num(q.get('top1_pct'), '.2f'):>7}%  {'; '.join(notes)}")  # fmt: skip
    print("disk/exp: expert tensors on disk per expert (scales, zeros included); slot/exp: pool slot bytes; resid: "
          "share of experts the budget holds; warm/cold: decode tok/s medians; MiB/tok: expert bytes read from disk "
          "per token, cold; KL: nats/token vs the fp32 reference of the bf16 checkpoint")  # fmt: skip
    if lc is not None:
        print(f"llama.cpp part ({Path(lc['file']).name}, {lc['tokens']} tokens, {args.threads} threads, "
              f"{lc['rounds']} round(s)):")  # fmt: skip
        for n, v in lc["runs"].items():
            print(f"  {n:<16}{fmt_num(lc['decode'].get(n), '.2f'):>8} tok/s  runs {v}  {lc['errors'].get(n, '')}")
    print(json.dumps({
        "benchmark": "stored_formats", "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "budget_share": args.budget, "budget_bytes": budget,
        "bf16_bytes_per_expert": bf16_per_expert, "n_experts": n_experts, "isa": isa, "amx": bool(amx),
        "kernels": kernels, "torch": torch.__version__, "reference": ref_info,
        "convert_s": {f.name: f.convert_s for f in fmts.values() if f.convert_s is not None},
        "rows": rows, "llamacpp": lc,
    }, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
