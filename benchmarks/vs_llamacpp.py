"""Decode and prefill speed against llama.cpp, on the same CPU, checkpoint and thread count.

The benchmark makes its anchor itself, so anyone can rerun it (everything lands under
`--cache-dir`, default `.bench/`, git-ignored; each step is skipped when its output exists):

0. **Model**: the random Qwen3-MoE benchmark checkpoint of `benchmarks/_models.py`, in a folder
   named after its config (`qwen3moe-bench-v<vocab>-<digest>`: a checkpoint built from another
   config is never reused); `--vocab V` makes a variant with V embedding and output-head rows
   (default the config's 32000). Its `max_position_embeddings` (4096) must cover the deepest
   decode measurement (`max(--depths, --prompt-tokens) + --tokens`), checked before anything runs.
1. **llama.cpp**: `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION` (default
   0.3.36, the newest 0.3 release when this was written) into `.bench/llamacpp/`, unpacked; its
   vendored tree `vendor/llama.cpp` is built with cmake (Release, CPU only, `GGML_NATIVE=ON`, no
   OpenSSL/CURL, no GPU backend, static) into `.bench/llamacpp/build`: `llama-bench`,
   `llama-quantize`, `llama-perplexity`. (`llama-cli` needs the server and web-UI targets in this
   tree, so it is not built.) About 10 minutes on 2 cores; cmake comes from `pip install cmake`
   if absent. `--skip-build` never downloads or builds (llama.cpp must be built already).
2. **GGUF files**, one folder per model: `.bench/llamacpp/gguf/<model folder name>/`. A copy of
   the checkpoint (`src/`; the weights are hard-linked, or symlinked across file systems) gets
   the bundled model's tokenizer files (`models/tiny-shakespeare-moe/tokenizer.json`,
   `tokenizer_config.json`), then the vendored `convert_hf_to_gguf.py` writes a bf16 GGUF and
   `llama-quantize` makes the quantized types the candidates need (Q8_0, Q4_0, Q4_K_M). Made when
   missing, with or without `--skip-build`.
   - *Pre-tokenizer patch.* The converter names a BPE pre-tokenizer by hashing the token ids of
     a fixed text (`get_vocab_base_pre`, in `conversion/base.py` of this tree) and refuses hashes
     it does not know; a freshly trained byte-level BPE is not in its table. The script replaces
     the one line `res = None` of that function, idempotently, with
     `res = "gpt-2" if chkhsh == "<our hash>" else None  # moetier vs_llamacpp`: our tokenizer is a
     ByteLevel BPE with GPT-2's split regex, which is what llama.cpp's `gpt-2` pre-tokenizer does.
     The hash is computed here, the converter's way, from the tokenizer actually copied in.
   - *Vocabulary size.* The default model has 32000 embedding rows; the bundled tokenizer has
     4096 tokens. Nothing needs padding: the converter writes `vocab_size` (config.json) tokens
     and fills the ids the tokenizer lacks with `[PAD<id>]` tokens of type UNUSED, so the GGUF's
     vocabulary matches the embedding and output-head shapes. (It only asserts that every
     tokenizer id is below `vocab_size`.) Speed does not depend on the token ids: all candidates
     run random token ids below the vocabulary size.
   Each file's tensor types are printed per kind of weight (read with the vendored `gguf`
   package), which is how llama.cpp quantizes the non-expert weights of each file type.
3. **Candidates**, run interleaved: a warm-up round (not counted), then `--rounds` rounds, each
   running every candidate once, all with `--threads` threads (default 2). Default candidates
   (`--only`): llama.cpp bf16 / Q8_0 / Q4_0 and moetier efull-dfull / eint8-dint8 / eint4-dint4;
   `--only '*'` adds the transformers rows (minutes each), the mixed moetier precisions and
   Q4_K_M. Every engine does the same work, each measurement on its own:
   - *prefill*: a P-token prompt (P = `--prompt-tokens`, default 128) from an empty context:
     `llama-bench -p P -n 0`; moetier and transformers: P / time to the first token;
   - *decode at depth D* for each D of `--depths` (default 0,512,2048): N = `--tokens` tokens
     decoded after D tokens of context: `llama-bench -d D -p 0 -n N` (the depth is filled
     untimed; D = 0: decode from an empty context); moetier: `Engine.generate` of a prompt of
     D random ids (D = 0: one id) and N new tokens, decode tok/s over tokens 2..N
     (`GenerationResult.decode_tok_s`); transformers: the same with `generate`.
   Candidates:
   - `llamacpp-<type>`: `llama-bench -t T -r 1 -o json` per GGUF and measurement (llama-bench
     runs its own warm-up pass, then one timed repetition);
   - `transformers-eager`: bf16 `generate` as shipped; `transformers-compiled`: bf16 with
     `experts_implementation="batched_mm"` in `from_pretrained` and `torch.compile` of the
     forward over a static cache (`cache_implementation="static"`), compiled in the warm-up
     round (one graph set per prompt length) and reused;
   - `moetier-e<experts>-d<dense>`: the engine through its Python API, routed experts at full
     (bf16), int8 or int4 (`PrecisionConfig(mode=...)`, from the quantized tiers that
     `moetier quantize MODEL --precisions int8,int4` writes, run here if missing) and the
     non-expert weights at `RuntimeConfig(dense_precision="full"|"int8"|"int4")`, with
     `RuntimeConfig(max_seq_len=...)` the deepest measurement's length; `moetier-e<P>-d<P>-wide` (P full,
     int8, int4): the same on the native step's wide mode (`RuntimeConfig(residual="fp32")`, llama.cpp's
     numerics);
   - `moetier-gguf-<TYPE>` (Q8_0, Q4_0, Q4_K_M, IQ4_XS; in `--only '*'`, not the defaults): llama.cpp's own
     GGUF file of that type opened by moetier with the default configuration (precision "auto": the
     experts, attention projections and head computed as stored on ggml's dot products where they can be;
     residual "auto": the wide step), compared with `llamacpp-<TYPE>`: the same file in both engines;
     `moetier-gguf-<TYPE>-bf16step` runs it on the bf16 step.
   transformers and moetier run in this process: a fresh load per round (the compiled model
   excepted), one untimed generate of the P-token prompt and N new tokens, then the timed
   measurements, each after a `gc.collect()`. moetier loads experts on first use: outside
   `--disk` every expert is made resident first (`engine.store.preload()`), as llama.cpp's
   weights are, or the first decode steps of a sequence would read the experts its routing
   meets for the first time (a P-token random prompt meets about half of them). A candidate
   that fails becomes rows with its error; the others go on.
4. **Time per decode token**: ms/token = 1000 / decode tok/s. moetier rows also split it: the
   native step's kernel calls (`engine.decoder.fused.step`: `attn`, `moe`, `head`) are wrapped
   on the instance with `perf_counter` accumulators, which restart when the engine's first
   forward of each generate (the prompt) returns (`Engine.step` wrapped on the instance too), so
   they hold the decode phase's kernel time only: "kernel" = that over N - 1 decode steps,
   "outside" = the rest (Python, routing observers, expert pinning, sampling; the wrappers add
   2 `perf_counter` calls to each of the 2L + 1 kernel calls of a token). llama.cpp rows: the
   total only (no split). A moetier engine without the native step has no split either.
5. **Bandwidth floor**: memory-read bandwidth = the median of 5 torch sums of a 1 GiB fp32
   tensor with T threads, measured right before every decode measurement (each candidate and
   depth, every round), kept with that measurement: this VM's bandwidth drifts (about 32 to
   50 GB/s within minutes), so each measurement's floor share uses its own. Bytes read per decode
   token are the weights a token touches (attention, router, output head, norms, one embedding
   row and `k/E` of the experts, 8 of 64 here, at each candidate's precision; moetier: from its
   own slot size when the engine exposes it; llama.cpp: from the GGUF's tensor sizes) plus the
   KV cache at the mean context `D + N/2` (16-bit K and V, both engines). "floor" is the share of
   the bandwidth-bound speed (`bandwidth / bytes per token`) a measurement reaches; a row's floor
   is the median of its measurements' shares. The range of bandwidths seen is printed.
6. `--disk`: moetier rows (bf16, and int4 with int4 dense weights) with a host expert budget of
   25% of their expert bytes (`Budgets(host_expert_bytes=...)`), beside them llama.cpp bf16 with
   mmap (`-lm mmap --no-warmup`); the page cache is dropped before each measurement (prefill
   and each depth) when `/proc/sys/vm/drop_caches` is writable (root). A CPU-only llama.cpp
   cannot cap the memory its weights use: `--n-cpu-moe` / `-ot` only keep experts off a GPU, and
   this tree's lazy tensor reading (`-lzm on`) covers per-layer token embeddings, not experts,
   so after the first touch it reads experts from the page cache. Each row's note says whether
   the page cache was dropped. At a depth D > 0 the untimed context fill (D prompt tokens) reads
   most experts before the timed decode, in both engines: only the depth-0 rows decode cold.
7. `--kl`: quality on the same text, for moetier int4 experts + int4 dense against llama.cpp
   Q4_0, and int8 + int8 against Q8_0 (the "at no worse KL" check). The text: the first ~2100
   tokens (bundled tokenizer) of `data/shakespeare_heldout.txt`, cut at a token boundary, in
   the model's GGUF folder. moetier: `moetier eval GGUF/src --text FILE --precision P
   --dense-precision P --kl-ref full --max-tokens 2048 --window 512 --json` (the checkpoint copy
   that has the tokenizer; the tiers of `--quant-dir`); llama.cpp: `llama-perplexity -c 512
   --chunks 4` of the bf16 GGUF with `--kl-divergence-base FILE` (writes the base logits), then
   of each quantized GGUF with `--kl-divergence`: mean and median KLD, 99th percentile, same
   top-1 token share, PPL. The references differ: moetier's `full` is the checkpoint in fp32,
   llama.cpp's is the bf16 GGUF; and the scored tokens differ: moetier scores every token after
   the first of each 512-token window, llama-perplexity the second half of each window. The
   benchmark model is random, so the figures compare quantization error, not language quality.
   With `moetier-gguf-*` candidates, their files too: `moetier eval GGUF/src --precision full
   --save-logits` once, then `moetier eval FILE.gguf --kl-ref that --kl-other-checkpoint --kl-from 256`
   per file (each window's positions 256-511, llama-perplexity's second half: positions 256-510), beside
   llama-perplexity's KL of the same file.

Ratios: each row's decode (per depth) and prefill against the llama.cpp row of the same expert
precision at the same depth (bf16 vs bf16, int8 vs Q8_0, int4 vs Q4_0; the llama.cpp files also
quantize attention and the output head, see the printed tensor types). Prints the CPU and ISA
(from /proc/cpuinfo and torch), the GGUF tensor types, a table of medians per candidate and
depth, then one JSON line; every JSON row carries the CPU, its ISA flags and the engine's kernel
path (moetier: `engine.stats()["kernels"]`; llama.cpp: llama-bench's backend and build).

    python benchmarks/vs_llamacpp.py [--threads 2] [--rounds 3] [--tokens 64] [--prompt-tokens 128]
        [--depths 0,512,2048] [--only 'llamacpp-*,moetier-eint4-*'] [--vocab 4096] [--kl]
        [--skip-build] [--disk] [--cache-dir .bench]
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch

import moetier
from benchmarks._models import qwen3_bench_model
from benchmarks.decode import _Clock
from moetier.kernels import native
from moetier.kernels.decode import QDense

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_SRC = REPO / "models" / "tiny-shakespeare-moe"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HELDOUT = REPO / "data" / "shakespeare_heldout.txt"
LLAMACPP_VERSION = "0.3.36"  # newest llama-cpp-python 0.3.x on PyPI when this was written
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
GGUF_TYPES = ("bf16", "Q8_0", "Q4_0", "Q4_K_M", "IQ4_XS")
PATCH_MARK = "# moetier vs_llamacpp"
ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16")
DENSE_BYTES = {"full": 2.0, "int8": 34 / 32, "int4": 18 / 32}  # per weight: bf16, Q8_0, Q4_0 blocks of 32
MATCH = {"full": "llamacpp-bf16", "int8": "llamacpp-Q8_0", "int4": "llamacpp-Q4_0"}


def log(msg: str) -> None:
    print(f"[vs_llamacpp] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command; raise with the tail of its output when it fails."""
    log("$ " + " ".join(map(str, cmd)))
    proc = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {proc.returncode}):\n{tail}")
    return proc


# ---------------------------------------------------------------- 1. llama.cpp, built from the sdist


@dataclass
class LlamaCpp:
    version: str
    root: Path  # unpacked sdist
    build: Path
    notes: list[str] = field(default_factory=list)

    @property
    def tree(self) -> Path:
        return self.root / "vendor" / "llama.cpp"

    def tool(self, name: str) -> Path:
        return self.build / "bin" / name

    def built(self) -> bool:
        return all(self.tool(t).exists() for t in TOOLS)


def get_llamacpp(cache: Path, version: str, skip_build: bool) -> LlamaCpp:
    """Download, unpack and build llama.cpp (each step skipped when its output exists)."""
    base = cache / "llamacpp"
    lc = LlamaCpp(version, base / f"llama_cpp_python-{version}", base / "build")
    if skip_build or lc.built():
        if not lc.built():
            raise RuntimeError(f"--skip-build, but {lc.build / 'bin'} lacks {', '.join(TOOLS)}")
        return lc
    base.mkdir(parents=True, exist_ok=True)
    sdist = base / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={version}", "-d", str(base)])  # fmt: skip
    if not (lc.tree / "CMakeLists.txt").exists():
        log(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(base, filter="data")
    cmake = shutil.which("cmake")
    if cmake is None:
        run([sys.executable, "-m", "pip", "install", "cmake"])
        cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not (lc.build / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        run([cmake, "-S", str(lc.tree), "-B", str(lc.build), *gen, "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_APP=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF",
             "-DGGML_HIP=OFF", "-DGGML_SYCL=OFF", "-DGGML_OPENCL=OFF", "-DGGML_RPC=OFF"])  # fmt: skip
    log(f"building {', '.join(TOOLS)} (about 10 minutes on 2 cores)")
    t0 = time.perf_counter()
    run([cmake, "--build", str(lc.build), "--config", "Release", "-j", str(os.cpu_count() or 2),
         "--target", *TOOLS])  # fmt: skip
    lc.notes.append(f"built in {time.perf_counter() - t0:.0f} s")
    return lc


# ---------------------------------------------------------------- 2. GGUF files


def pretokenizer_hash(model_dir: Path, converter_src: str) -> str:
    """The converter's own identifier of a BPE pre-tokenizer: sha256 of str(token ids of chktxt)."""
    from transformers import AutoTokenizer

    m = re.search(r"^\s*chktxt = (['\"].*['\"])\s*$", converter_src, re.MULTILINE)
    if m is None:
        raise RuntimeError("convert_hf_to_gguf: chktxt not found in get_vocab_base_pre; the patch needs updating")
    import ast

    chktxt = ast.literal_eval(m.group(1))
    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(chktxt)
    return hashlib.sha256(str(ids).encode()).hexdigest()


def patch_pretokenizer(tree: Path, model_dir: Path) -> str:
    """Map our tokenizer's pre-tokenizer hash to llama.cpp's "gpt-2" (one line, idempotent)."""
    candidates = [tree / "conversion" / "base.py", tree / "convert_hf_to_gguf.py"]
    src_file = next((p for p in candidates if p.exists() and "def get_vocab_base_pre" in p.read_text()), None)
    if src_file is None:
        raise RuntimeError("get_vocab_base_pre not found in the vendored converter")
    src = src_file.read_text()
    chkhsh = pretokenizer_hash(model_dir, src)
    line = f'        res = "gpt-2" if chkhsh == "{chkhsh}" else None  {PATCH_MARK}\n'
    if line in src:
        return chkhsh
    if f'"{chkhsh}"' in src and PATCH_MARK not in src:
        return chkhsh  # upstream already knows this tokenizer
    lines = src.splitlines(keepends=True)
    start = next(i for i, s in enumerate(lines) if "def get_vocab_base_pre" in s)
    for i in range(start, len(lines)):
        if lines[i].strip() == "res = None" or lines[i].rstrip().endswith(PATCH_MARK):
            lines[i] = line
            break
    else:
        raise RuntimeError(f"`res = None` not found in get_vocab_base_pre of {src_file}")
    src_file.write_text("".join(lines))
    log(f"patched {src_file.relative_to(tree)}: pre-tokenizer {chkhsh} -> gpt-2")
    return chkhsh


def gguf_dir(cache: Path, model: Path) -> Path:
    """The model's GGUF folder: one per checkpoint folder (config and vocabulary), never shared."""
    return cache / "llamacpp" / "gguf" / model.name


def gguf_source(out: Path, model: Path) -> Path:
    """The checkpoint folder with the bundled tokenizer copied in (weights linked, not copied)."""
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        dst = src / f.name
        if f.is_dir() or dst.exists():
            continue
        if f.suffix == ".safetensors":
            try:
                os.link(f, dst)
            except OSError:
                dst.symlink_to(f.resolve())
        else:
            shutil.copy2(f, dst)
    for name in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_SRC / name, src / name)
    return src


def make_ggufs(cache: Path, lc: LlamaCpp, model: Path, types: list[str]) -> tuple[dict[str, Path], dict[str, Any]]:
    """bf16 GGUF from the converter, then `types` (Q8_0 / Q4_0 / Q4_K_M) from llama-quantize, where missing."""
    out = gguf_dir(cache, model)
    want = ["bf16", *(t for t in types if t != "bf16")]
    files = {t: out / f"qwen3moe-bench-{t}.gguf" for t in want}
    info: dict[str, Any] = {"dir": str(out), "quantize_s": {}}
    if all(p.exists() for p in files.values()):
        return files, info
    src = gguf_source(out, model)
    info["pretokenizer_hash"] = patch_pretokenizer(lc.tree, src)
    if not files["bf16"].exists():
        tmp = files["bf16"].with_suffix(".tmp")
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        t0 = time.perf_counter()
        run([sys.executable, str(lc.tree / "convert_hf_to_gguf.py"), str(src), "--outtype", "bf16",
             "--outfile", str(tmp)], env=env)  # fmt: skip
        tmp.rename(files["bf16"])
        info["convert_s"] = round(time.perf_counter() - t0, 1)
    for t in want[1:]:
        if files[t].exists():
            continue
        tmp = files[t].with_suffix(".tmp")
        t0 = time.perf_counter()
        run([str(lc.tool("llama-quantize")), str(files["bf16"]), str(tmp), t, "2"])
        tmp.rename(files[t])
        info["quantize_s"][t] = round(time.perf_counter() - t0, 1)
    return files, info


def gguf_module(lc: LlamaCpp) -> Any:
    """The vendored gguf-py (the one the converter used), imported from its tree."""
    path = str(lc.tree / "gguf-py")
    if path not in sys.path:
        sys.path.insert(1, path)
    import gguf

    return gguf


def weight_kind(name: str) -> str:
    """GGUF tensor name -> the kind of weight it is (layer index dropped)."""
    base = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
    if base.endswith("norm"):
        return "norms"
    return base


def gguf_summary(gguf: Any, path: Path, top_k: int, n_experts: int) -> dict[str, Any]:
    """Tensor types per kind of weight, and the bytes a decode token reads from this file."""
    reader = gguf.GGUFReader(str(path))
    kinds: dict[str, dict[str, int]] = {}
    per_token = experts = dense = 0.0
    for t in reader.tensors:
        kind = weight_kind(t.name)
        tname = t.tensor_type.name
        kinds.setdefault(kind, {})
        kinds[kind][tname] = kinds[kind].get(tname, 0) + 1
        nbytes = int(t.n_bytes)
        if kind == "token_embd":
            per_token += nbytes / int(t.shape[-1])  # one row per token
        elif "_exps" in kind:
            per_token += nbytes * top_k / n_experts
            experts += nbytes * top_k / n_experts
        else:
            per_token += nbytes
            if kind.startswith("attn_") or kind == "output":  # the projections and the head (not norms, router)
                dense += nbytes
    return {"types": kinds, "bytes_per_token": per_token, "file_bytes": path.stat().st_size,
            "expert_bytes_per_token": experts, "dense_bytes_per_token": dense}  # fmt: skip


def format_types(kinds: dict[str, dict[str, int]]) -> str:
    order = ["token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
             "ffn_up_exps", "ffn_down_exps", "output", "norms"]  # fmt: skip
    parts = []
    for k in sorted(kinds, key=lambda k: order.index(k) if k in order else len(order)):
        parts.append(f"{k} " + "+".join(f"{t}x{n}" if len(kinds[k]) > 1 else t for t, n in sorted(kinds[k].items())))
    return ", ".join(parts)


# ---------------------------------------------------------------- 3. the machine


def cpu_isa() -> dict[str, Any]:
    model, listed = native.cpu_info()
    flags = set(listed)
    have = [f for f in ISA_FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx"))
    return {"cpu": model, "flags": have, "torch_capability": torch.backends.cpu.get_cpu_capability()}


class Bandwidth:
    """Memory-read bandwidth (bytes/s): the median of `reps` torch sums of one `gib` GiB fp32 tensor (allocated
    once and kept, so no measurement pays its page faults), T threads; every measurement is kept (`seen`)."""

    def __init__(self, threads: int, gib: float = 1.0, reps: int = 5) -> None:
        self.threads, self.gib, self.reps = threads, gib, reps
        self.x: torch.Tensor | None = None
        self.seen: list[float] = []

    def measure(self) -> float:
        torch.set_num_threads(self.threads)
        if self.x is None:
            self.x = torch.ones(int(self.gib * 2**30) // 4, dtype=torch.float32)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            self.x.sum()
            times.append(time.perf_counter() - t0)
        bw = self.x.numel() * 4 / statistics.median(times)
        self.seen.append(bw)
        return bw


def drop_page_cache() -> str | None:
    """Drop the page cache (needs root); None when done, else why not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return None
    except OSError as e:
        return f"page cache not dropped ({e.strerror or e})"


def checkpoint_params(model: Path) -> dict[str, int]:
    """Parameter counts per kind of weight, read from the safetensors headers."""
    counts = {"attention": 0, "router": 0, "experts": 0, "head": 0, "norms": 0, "embedding": 0, "other": 0}
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in meta["shape"]:
                n *= d
            if ".mlp.experts." in name:
                kind = "experts"
            elif ".mlp.gate." in name:
                kind = "router"
            elif "self_attn." in name and not name.endswith("norm.weight"):
                kind = "attention"
            elif name.startswith("lm_head"):
                kind = "head"
            elif "embed_tokens" in name:
                kind = "embedding"
            elif "norm" in name:
                kind = "norms"
            else:
                kind = "other"
            counts[kind] += n
    return counts


def expert_bytes_per_param(precision: str, k_in: tuple[int, int]) -> float:
    """moetier's stored bytes per expert weight (formats/quant.py): int8 per row, int4 groups of 128,
    scale and zero bf16; `k_in` = input sizes of (gate/up, down), whose weights count 2:1."""
    if precision == "full":
        return 2.0
    if precision == "int8":
        return sum(w * (1 + 4 / k) for w, k in zip((2, 1), k_in, strict=True)) / 3
    return 0.5 + 4 / 128


# ---------------------------------------------------------------- 4. candidates


@dataclass
class Setup:
    model: Path
    threads: int
    prompt: list[int]  # the prefill prompt: P random ids
    context: list[int]  # random ids; depth D's prompt is the first max(D, 1) of them
    depths: list[int]
    tokens: int
    params: dict[str, int]
    config: dict[str, Any]
    ggufs: dict[str, Path]
    gguf_info: dict[str, dict[str, Any]]
    lc: LlamaCpp | None
    bandwidth: Bandwidth
    max_seq_len: int  # moetier's KV cache: the deepest measurement
    quant_dir: str | None = None
    cached: dict[str, Any] = field(default_factory=dict)
    gguf_rows: list[str] = field(default_factory=list)  # GGUF types of the moetier-gguf-* candidates run

    def depth_prompt(self, depth: int) -> list[int]:
        """Depth D's prompt: D random ids, or one for D = 0 (decode from a near-empty context)."""
        return self.context[: max(depth, 1)]


Measure = dict[str, Any]  # one decode measurement: tok_s; kernel_s (s per decode token, None: no split); bandwidth
Result = dict[str, Any]  # one run: prefill (tok/s), decode {depth: Measure}, bytes_per_token (weights), kernels, note


def llamacpp_row(s: Setup, gtype: str, cold: bool = False) -> Result:
    if s.lc is None or gtype not in s.ggufs:
        raise RuntimeError("llama.cpp or its GGUF file is missing (build or conversion failed, see setup errors)")
    cmd = [str(s.lc.tool("llama-bench")), "-m", str(s.ggufs[gtype]), "-t", str(s.threads), "-r", "1", "-o", "json"]
    if cold:  # weights mmapped, no warm-up pass; each test right after dropping the page cache
        cmd += ["-lm", "mmap", "--no-warmup"]
    why = drop_page_cache() if cold else None
    pp = llama_bench_one([*cmd, "-p", str(len(s.prompt)), "-n", "0"])
    decode: dict[int, Measure] = {}
    for d in s.depths:
        bw = s.bandwidth.measure()
        if cold:
            why = why or drop_page_cache()
        tg = llama_bench_one([*cmd, "-d", str(d), "-p", "0", "-n", str(s.tokens)])
        if int(tg.get("n_depth", d)) != d or int(tg["n_gen"]) != s.tokens:
            raise RuntimeError(
                f"llama-bench ran depth {tg.get('n_depth')} / {tg['n_gen']} tokens, asked {d} / {s.tokens}"
            )
        decode[d] = {"tok_s": float(tg["avg_ts"]), "kernel_s": None, "bandwidth": bw}
    kernels = (f"llama.cpp {pp.get('backends')} backend (build {pp.get('build_commit')}, repack {pp.get('repack')}, "
               f"flash_attn {pp.get('flash_attn')}, KV {pp.get('type_k')}/{pp.get('type_v')})")  # fmt: skip
    note = "no split" + ("; " + (why or "page cache dropped before each test") if cold else "")
    return {"prefill": float(pp["avg_ts"]), "decode": decode, "bytes_per_token": s.gguf_info[gtype]["bytes_per_token"],
            "kernels": kernels, "note": note}  # fmt: skip


def llama_bench(cmd: list[str]) -> list[dict[str, Any]]:
    """The tests of a llama-bench run (-o json); benchmarks/stored_formats.py uses it too."""
    out = run(cmd).stdout
    return list(json.loads(out[out.index("[") :]))


def llama_bench_one(cmd: list[str]) -> dict[str, Any]:
    """The one test of a llama-bench run of one test."""
    rows = llama_bench(cmd)
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench printed {len(rows)} tests, expected 1")
    return dict(rows[0])


def bf16_bytes_per_token(s: Setup) -> float:
    return moetier_bytes_per_token(s, "full", "full", None)


def kv_bytes_per_position(config: dict[str, Any]) -> float:
    """KV cache bytes a decode token reads per position of context: K and V of every layer, 16-bit."""
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2


def hf_generate(model: Any, prompt: list[int], n: int, **kw: Any) -> _Clock:
    clock = _Clock()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=clock, pad_token_id=0, **kw)
    return clock


def transformers_row(s: Setup, compiled: bool) -> Result:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(s.threads)
    kw: dict[str, Any] = {}
    if compiled:
        kw = {"cache_implementation": "static"}
        model = s.cached.get("hf_compiled")
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                str(s.model), dtype=torch.bfloat16, experts_implementation="batched_mm"
            ).eval()
            model.forward = torch.compile(model.forward, dynamic=False)  # graphs per shape, made in the warm-up round
            s.cached["hf_compiled"] = model
    else:
        model = AutoModelForCausalLM.from_pretrained(str(s.model), dtype=torch.bfloat16).eval()
    hf_generate(model, s.prompt, s.tokens, **kw)  # untimed warm-up: prefill and decode
    gc.collect()
    clock = hf_generate(model, s.prompt, 1, **kw)
    prefill = len(s.prompt) / (clock.times[1] - clock.times[0])
    decode: dict[int, Measure] = {}
    for d in s.depths:
        bw = s.bandwidth.measure()
        gc.collect()
        new = hf_generate(model, s.depth_prompt(d), s.tokens, **kw).times[1:]
        decode[d] = {"tok_s": (len(new) - 1) / (new[-1] - new[0]), "kernel_s": None, "bandwidth": bw}
    note = "no split" + ("; compiled in the warm-up round (graphs per prompt length)" if compiled else "")
    return {"prefill": prefill, "decode": decode, "bytes_per_token": bf16_bytes_per_token(s),
            "kernels": f"torch ({torch.backends.cpu.get_cpu_capability()})", "note": note}  # fmt: skip


def moetier_bytes_per_token(s: Setup, experts: str, dense: str, slot_bytes: int | None,
                            head_bytes: int | None = None) -> float:  # fmt: skip
    p, c = s.params, s.config
    k, n_exp, layers = c["num_experts_per_tok"], c["num_experts"], c["num_hidden_layers"]
    if slot_bytes is not None:
        expert = slot_bytes * k * layers
    else:
        k_in = (c["hidden_size"], c["moe_intermediate_size"])
        expert = p["experts"] * k / n_exp * expert_bytes_per_param(experts, k_in)
    # moetier quantizes attention per dense precision, keeps the router bf16, the head at Q6_K (or Q8_0 without
    # ggml) under int4: `head_bytes`, the engine's own, where it says
    head = head_bytes if head_bytes is not None else p["head"] * DENSE_BYTES["int8" if dense == "int4" else dense]
    dense_b = p["attention"] * DENSE_BYTES[dense] + p["router"] * 2 + head
    rest = p["norms"] * 2 + p["embedding"] / c["vocab_size"] * 2 + p["other"] * 2
    return expert + dense_b + rest


def moetier_config(s: Setup, experts: str, dense: str, budget: int | None = None,
                   residual: str = "auto") -> moetier.EngineConfig:  # fmt: skip
    return moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget),
        precision=moetier.PrecisionConfig(mode=experts, quant_dir=s.quant_dir),
        runtime=moetier.RuntimeConfig(device="cpu", dtype="bf16", dense_precision=dense, max_seq_len=s.max_seq_len,
                                      residual=residual),
    )


def expert_pool_bytes(engine: Any) -> tuple[int | None, int | None]:
    """(slot bytes, bytes of every expert at one slot each) when the engine's store exposes them."""
    store = getattr(engine, "store", None)
    slot = getattr(store, "slot_bytes", None)
    keys = getattr(store, "keys", None)
    if not isinstance(slot, int):
        return None, None
    return slot, slot * len(keys) if keys is not None else None


class DecodeSplit:
    """Seconds inside the native step's kernel calls during the decode phase of each `Engine.generate`: the
    step's `attn`, `moe` and `head` (`engine.decoder.fused.step`) are wrapped on the instance with a perf_counter
    accumulator, and so is `engine.step`, whose first call of a generate (the prompt's forward) restarts the sum
    when it returns. `native` is False (and nothing is wrapped) when the engine has no native step."""

    KERNELS = ("attn", "moe", "head")

    def __init__(self, engine: Any) -> None:
        self.kernel_s, self.kernel_calls, self.forwards = 0.0, 0, 0
        fused = getattr(getattr(engine, "decoder", None), "fused", None)
        self.native = fused is not None
        if fused is None:
            return
        for name in self.KERNELS:
            setattr(fused.step, name, self._timed(getattr(fused.step, name)))
        forward = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            self.forwards += 1
            if self.forwards == 1:  # the prompt's forward: its kernel time is prefill's
                self.kernel_s, self.kernel_calls = 0.0, 0
            return out

        engine.step = step

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = fn(*args, **kwargs)
            self.kernel_s += clock() - t0
            self.kernel_calls += 1
            return out

        return timed

    def start(self) -> None:
        """Before a generate: its first forward will be the prompt's."""
        self.kernel_s, self.kernel_calls, self.forwards = 0.0, 0, 0


def moetier_row(s: Setup, experts: str, dense: str, disk: bool = False, gguf: str | None = None,
                residual: str = "auto") -> Result:  # fmt: skip
    """One moetier candidate: the benchmark checkpoint at `experts` / `dense` precision, or (`gguf`) llama.cpp's own
    GGUF file of that type, opened with the default precision ("auto": computed as stored where the native kernels
    can) and dense weights as the engine holds them by default; `residual` as RuntimeConfig.residual: "auto" (the
    default: the wide step for the GGUF files, the bf16 step for the checkpoint), "fp32" (the `-wide` rows), "bf16"
    (the GGUF files' `-bf16step` rows)."""
    torch.set_num_threads(s.threads)
    if gguf is not None and gguf not in s.ggufs:
        raise RuntimeError(f"no {gguf} GGUF file (conversion failed, see setup errors)")
    model = str(s.ggufs[gguf]) if gguf is not None else str(s.model)
    budget = None
    note = []
    if disk:
        key = f"expert_bytes_{experts}"
        if key not in s.cached:
            with moetier.load(model, moetier_config(s, experts, dense, residual=residual)) as info:
                s.cached[key] = expert_pool_bytes(info)[1]
        if s.cached[key] is None:
            raise RuntimeError("the engine's store exposes no slot_bytes/keys: cannot size a 25% budget")
        budget = s.cached[key] // 4
        note.append(f"host budget {budget / 2**20:.0f} MiB")
    with moetier.load(model, moetier_config(s, experts, dense, budget, residual)) as engine:
        slot, _ = expert_pool_bytes(engine)
        head = getattr(getattr(engine, "decoder", None), "lm_head", None)
        head_bytes = head.nbytes if isinstance(head, QDense) else None  # a quantised head: its real bytes
        preload = getattr(engine.store, "preload", None)
        if not disk:  # every expert resident, as llama.cpp's are: no first-touch read in a timed decode
            if callable(preload):
                preload()
            else:
                note.append("the store has no preload(): experts load on first use, in the timed runs")
        engine.generate(s.prompt, max_new_tokens=s.tokens, stop_at_eos=False)  # untimed warm-up: prefill and decode
        split = DecodeSplit(engine)
        why = drop_page_cache() if disk else None
        gc.collect()
        prefill = len(s.prompt) / engine.generate(s.prompt, max_new_tokens=1, stop_at_eos=False).ttft_s
        decode: dict[int, Measure] = {}
        for d in s.depths:
            bw = s.bandwidth.measure()
            if disk:
                why = why or drop_page_cache()
            gc.collect()
            split.start()
            res = engine.generate(s.depth_prompt(d), max_new_tokens=s.tokens, stop_at_eos=False)
            if len(res.token_ids) != s.tokens:
                raise RuntimeError(f"generated {len(res.token_ids)} tokens, asked {s.tokens}")
            if split.native and split.forwards != s.tokens:
                raise RuntimeError(f"{split.forwards} forwards for {s.tokens} tokens: cannot tell the prompt's apart")
            steps = s.tokens - 1  # decode tok/s counts tokens 2..N: N - 1 forwards after the prompt's
            decode[d] = {"tok_s": res.decode_tok_s, "bandwidth": bw,
                         "kernel_s": split.kernel_s / steps if split.native else None,
                         "kernel_calls": split.kernel_calls / steps if split.native else None}  # fmt: skip
        stats = engine.stats()
    if disk:
        note.append(why or "page cache dropped before each test")
        note.append(f"hits {stats.get('hits')}, misses {stats.get('misses')}, "
                    f"disk {stats.get('disk_bytes', 0) / 2**20:.0f} MiB")  # fmt: skip
    if not split.native:
        note.append("no native step: no split")
    torch_moe = (stats.get("native_step") or {}).get("torch_moe_calls")
    if torch_moe:
        note.append(f"{torch_moe} MoE halves ran in torch (their time counts as outside)")
    if gguf is not None:
        held = sorted((stats.get("precision") or {}).keys())
        note.append(f"experts held as {', '.join(held)}; {stats.get('dense_stored', 0)} dense weights as stored")
    if dense != "full" and not re.search(r"dense_(precision|bits)", json.dumps(stats, default=str)):
        note.append("engine stats do not report the dense precision")
    if gguf is not None:  # the file's own bytes where the engine computes them as stored
        bpt = gguf_bytes_per_token(s, gguf, slot, stats)
    else:
        bpt = moetier_bytes_per_token(s, experts, dense, slot if not disk else None, head_bytes)
    return {"prefill": prefill, "decode": decode, "bytes_per_token": bpt,
            "kernels": stats.get("kernels"), "note": "; ".join(note)}  # fmt: skip


def gguf_bytes_per_token(s: Setup, gtype: str, slot: int | None, stats: dict[str, Any]) -> float:
    """Weights a token reads from a GGUF file as the engine holds it: the file's per-token bytes (llama.cpp's
    figure) with the experts' part replaced by the engine's slots and, unless it computes them as stored, the
    dense weights' part by bf16."""
    info, c, p = s.gguf_info[gtype], s.config, s.params
    k, layers = c["num_experts_per_tok"], c["num_hidden_layers"]
    total = float(info["bytes_per_token"])
    file_experts = float(info.get("expert_bytes_per_token", 0.0))
    if slot is not None and file_experts:
        total += slot * k * layers - file_experts
    if not stats.get("dense_stored") and "dense_bytes_per_token" in info:  # dense weights decoded to bf16
        total += (p["attention"] + p["head"]) * 2 - float(info["dense_bytes_per_token"])
    return total


def candidates(disk: bool) -> dict[str, Callable[[Setup], Result]]:
    out: dict[str, Callable[[Setup], Result]] = {}
    for t in GGUF_TYPES:
        out[f"llamacpp-{t}"] = partial(llamacpp_row, gtype=t)
    out["transformers-eager"] = partial(transformers_row, compiled=False)
    out["transformers-compiled"] = partial(transformers_row, compiled=True)
    for e in ("full", "int8", "int4"):
        for d in ("full", "int8", "int4"):
            out[f"moetier-e{e}-d{d}"] = partial(moetier_row, experts=e, dense=d)
    for e in ("full", "int8", "int4"):  # the wide step (--residual fp32) of the rows matched to llama.cpp's files
        out[f"moetier-e{e}-d{e}-wide"] = partial(moetier_row, experts=e, dense=e, residual="fp32")
    for t in GGUF_TYPES[1:]:
        out[f"moetier-gguf-{t}"] = partial(moetier_row, experts="auto", dense="full", gguf=t)
        out[f"moetier-gguf-{t}-bf16step"] = partial(moetier_row, experts="auto", dense="full", gguf=t, residual="bf16")
    if disk:
        out["llamacpp-bf16-cold-mmap"] = partial(llamacpp_row, gtype="bf16", cold=True)
        out["moetier-efull-dfull-disk25"] = partial(moetier_row, experts="full", dense="full", disk=True)
        out["moetier-eint4-dint4-disk25"] = partial(moetier_row, experts="int4", dense="int4", disk=True)
    return out


def ensure_tiers(model: Path, precisions: list[str], quant_dir: str | None, method: str) -> None:
    """Write the quantized expert tiers the int8 / int4 candidates read (resumable), if missing."""
    root = Path(quant_dir) if quant_dir else model / "moetier-quant"

    def complete(prec: str) -> bool:
        for m in root.glob(f"{prec}-g*/manifest.json"):
            if not m.parent.name.endswith("-rows") and json.loads(m.read_text()).get("complete") is True:
                return True
        return False

    missing = [p for p in precisions if not complete(p)]
    if missing:
        log(f"writing moetier tiers {','.join(missing)} (minutes)")
        run([sys.executable, "-c", "import sys; from moetier.cli.app import main; sys.argv[0] = 'moetier'; main()",
             "quantize", str(model), "--precisions", ",".join(missing), "--method", method,
             *(["--out", quant_dir] if quant_dir else [])])  # fmt: skip


# ---------------------------------------------------------------- 6. quality (--kl)

KL_TOKENS = 2048  # tokens scored by both engines' windows
KL_WINDOW = 512  # moetier --window, llama-perplexity -c
KL_PAIRS = (("int4", "Q4_0"), ("int8", "Q8_0"))  # moetier experts = dense precision, llama.cpp file type
CLI = "import sys; from moetier.cli.app import main; sys.argv[0] = 'moetier'; main()"
LLAMA_KL = {"kl_mean": r"Mean\s+KLD:\s+(\S+)", "kl_stderr": r"Mean\s+KLD:\s+\S+\s+±\s+(\S+)",
            "kl_median": r"Median\s+KLD:\s+(\S+)", "kl_p99": r"99\.0%\s+KLD:\s+(\S+)",
            "top1_pct": r"Same top p:\s+(\S+)", "ppl": r"Mean PPL\(Q\)\s+:\s+(\S+)",
            "ref_ppl": r"Mean PPL\(base\)\s+:\s+(\S+)"}  # fmt: skip


def kl_text(out: Path, src: Path) -> tuple[Path, int]:
    """The first KL_TOKENS + 64 tokens (bundled tokenizer) of the held-out text, cut at a token boundary."""
    from transformers import AutoTokenizer

    text = HELDOUT.read_text(encoding="utf-8")[:60_000]  # ~15k tokens: plenty
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.model_max_length = len(text)  # the whole text at once: no "longer than the maximum" warning
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    n = KL_TOKENS + 64  # slack for llama.cpp's own tokenization and BOS
    if len(enc["input_ids"]) < n:
        raise RuntimeError(f"{HELDOUT} has {len(enc['input_ids'])} tokens, fewer than {n}")
    dst = out / "kl_text.txt"
    dst.write_text(text[: enc["offset_mapping"][n - 1][1]], encoding="utf-8")
    return dst, n


def moetier_kl(src: Path, text: Path, precision: str, quant_dir: str, threads: int) -> dict[str, Any]:
    """`moetier eval --kl-ref full` of int4 / int8 experts and dense weights: its JSON line's quality figures."""
    t0 = time.perf_counter()
    proc = run([sys.executable, "-c", CLI, "eval", str(src), "--text", str(text), "--precision", precision,
                "--dense-precision", precision, "--kl-ref", "full", "--max-tokens", str(KL_TOKENS),
                "--window", str(KL_WINDOW), "--quant-dir", quant_dir, "--device", "cpu", "--json"],
               env=dict(os.environ, OMP_NUM_THREADS=str(threads)))  # fmt: skip
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ("kl_mean", "kl_stderr", "kl_median", "kl_p99", "top1_pct", "ppl", "ref_ppl", "kl_tokens", "window")
    return {k: payload.get(k) for k in keys} | {"seconds": round(time.perf_counter() - t0, 1)}


def moetier_gguf_kl(src: Path, ggufs: dict[str, Path], text: Path, out: Path, types: list[str],
                    threads: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """moetier on llama.cpp's own GGUF files (default precision: computed as stored) against moetier's bf16 model
    on the same text: the reference's log-probabilities saved once (`moetier eval --save-logits`), then each
    file's `moetier eval FILE --kl-ref` (the GGUF's tokenizer is the bundled one, converted)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    base = out / "kl_base_moetier_bf16.npz"
    common = ["--text", str(text), "--max-tokens", str(KL_TOKENS), "--window", str(KL_WINDOW), "--device", "cpu"]
    base.unlink(missing_ok=True)
    run([sys.executable, "-c", CLI, "eval", str(src), "--precision", "full", *common, "--save-logits", str(base)],
        env=env)  # fmt: skip
    res: dict[str, dict[str, Any]] = {}
    keys = ("kl_mean", "kl_stderr", "kl_median", "kl_p99", "top1_pct", "ppl", "ref_ppl", "kl_tokens", "window")
    for t in types:
        t0 = time.perf_counter()
        proc = run([sys.executable, "-c", CLI, "eval", str(ggufs[t]), *common, "--kl-ref", str(base),
                    "--kl-other-checkpoint", "--kl-from", str(KL_WINDOW // 2), "--json"], env=env)  # fmt: skip
        payload = json.loads(proc.stdout.strip().splitlines()[-1])
        res[t] = {k: payload.get(k) for k in keys} | {"seconds": round(time.perf_counter() - t0, 1)}
    return res


def llamacpp_kl(lc: LlamaCpp, ggufs: dict[str, Path], text: Path, out: Path, types: list[str],
                threads: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """llama-perplexity: the bf16 GGUF's logits saved (--kl-divergence-base), then each type's KL against them."""
    tool = str(lc.tool("llama-perplexity"))
    base = out / "kl_base_bf16.kld"
    common = ["-f", str(text), "-c", str(KL_WINDOW), "-b", str(KL_WINDOW), "--chunks", str(KL_TOKENS // KL_WINDOW),
              "-t", str(threads), "--kl-divergence-base", str(base)]  # fmt: skip
    base.unlink(missing_ok=True)
    run([tool, "-m", str(ggufs["bf16"]), *common])
    res: dict[str, dict[str, Any]] = {}
    for t in types:
        t0 = time.perf_counter()
        proc = run([tool, "-m", str(ggufs[t]), *common, "--kl-divergence"])
        log_text = proc.stdout + proc.stderr
        row: dict[str, Any] = {}
        for k, pat in LLAMA_KL.items():
            m = re.search(pat, log_text)
            row[k] = float(m.group(1)) if m else None
        row["kl_tokens"] = (KL_TOKENS // KL_WINDOW) * (KL_WINDOW - KL_WINDOW // 2 - 1)  # second half, less the last
        row["chunks"] = KL_TOKENS // KL_WINDOW
        row["seconds"] = round(time.perf_counter() - t0, 1)
        if row["kl_mean"] is None:
            raise RuntimeError(f"llama-perplexity {t}: no 'Mean    KLD' line in its output:\n{log_text[-1500:]}")
        res[t] = row
    return res


def run_kl(s: Setup, cache: Path, lc: LlamaCpp | None) -> dict[str, Any]:
    """Both engines' quality on the same text (module docstring, 7)."""
    out = gguf_dir(cache, s.model)
    src = gguf_source(out, s.model)
    text, n = kl_text(out, src)
    quant_dir = s.quant_dir or str(s.model / "moetier-quant")
    res: dict[str, Any] = {"text": str(text), "text_tokens": n, "window": KL_WINDOW, "tokens": KL_TOKENS,
                           "moetier": {}, "llamacpp": {}, "errors": {}}  # fmt: skip
    for prec, _ in KL_PAIRS:
        try:
            res["moetier"][prec] = moetier_kl(src, text, prec, quant_dir, s.threads)
        except Exception as e:
            res["errors"][f"moetier-{prec}"] = f"{type(e).__name__}: {e}"[-1500:]
            log(traceback.format_exc())
    gguf_types = [t for t in s.gguf_rows if t in s.ggufs]
    if gguf_types:
        try:
            res["moetier_gguf"] = moetier_gguf_kl(src, s.ggufs, text, out, gguf_types, s.threads)
        except Exception as e:
            res["errors"]["moetier-gguf"] = f"{type(e).__name__}: {e}"[-1500:]
            log(traceback.format_exc())
    try:
        if lc is None:
            raise RuntimeError("llama.cpp is not built")
        types = list(dict.fromkeys([*(t for _, t in KL_PAIRS), *gguf_types]))
        res["llamacpp"] = llamacpp_kl(lc, s.ggufs, text, out, types, s.threads)
    except Exception as e:
        res["errors"]["llamacpp"] = f"{type(e).__name__}: {e}"[-1500:]
        log(traceback.format_exc())
    return res


def print_kl_pair(left: tuple[str, dict[str, Any] | None], right: tuple[str, dict[str, Any] | None],
                  label: str) -> None:  # fmt: skip
    """Two engines' KL rows, then how the first compares with the second."""
    for name, r in (left, right):
        if r is None:
            print(f"  {name:<26}  -")
            continue
        print(f"  {name:<26}{fmt(r.get('kl_tokens'), 'd'):>7}{fmt(r['kl_mean'], '.5f'):>10}"
              f"{fmt(r.get('kl_stderr'), '.5f'):>9}{fmt(r.get('kl_median'), '.5f'):>9}"
              f"{fmt(r.get('kl_p99'), '.4f'):>9}{fmt(r.get('top1_pct'), '.2f'):>9}{fmt(r.get('ppl'), '.2f'):>10}"
              f"{fmt(r.get('ref_ppl'), '.2f'):>10}")  # fmt: skip
    m, c = left[1], right[1]
    if m and c and m.get("kl_mean") is not None and c.get("kl_mean"):
        print(f"  {label}: moetier KL {'<=' if m['kl_mean'] <= c['kl_mean'] else '>'} llama.cpp KL "
              f"({m['kl_mean'] / c['kl_mean']:.2f}x)")  # fmt: skip


def print_kl(kl: dict[str, Any]) -> None:
    print(f"KL on {kl['text']} ({kl['text_tokens']} tokens of the bundled tokenizer), windows of {kl['window']}:")
    print(
        "  references differ: moetier's `full` is the checkpoint in fp32; llama.cpp's is the bf16 GGUF. moetier "
        "scores every token after the first of each window, llama-perplexity the second half of each window"
    )
    print(f"  {'engine':<26}{'tokens':>7}{'KL mean':>10}{'± se':>9}{'median':>9}{'p99':>9}{'top-1 %':>9}"
          f"{'PPL':>10}{'ref PPL':>10}")  # fmt: skip
    for prec, gtype in KL_PAIRS:
        print_kl_pair((f"moetier-e{prec}-d{prec}", kl["moetier"].get(prec)),
                      (f"llamacpp-{gtype}", kl["llamacpp"].get(gtype)), f"{prec} vs {gtype}")  # fmt: skip
    for gtype, m in (kl.get("moetier_gguf") or {}).items():
        print_kl_pair((f"moetier-gguf-{gtype}", m), (f"llamacpp-{gtype}", kl["llamacpp"].get(gtype)),
                      f"{gtype} (same file)")  # fmt: skip
    for k, v in kl["errors"].items():
        print(f"  KL error ({k}): {v.splitlines()[-1] if v else v}")


# ---------------------------------------------------------------- 5. report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


DEFAULT_ONLY = ("llamacpp-bf16", "llamacpp-Q8_0", "llamacpp-Q4_0", "moetier-efull-dfull", "moetier-eint8-dint8",
                "moetier-eint4-dint4")  # fmt: skip
DISK_ONLY = ("llamacpp-bf16-cold-mmap", "moetier-*-disk25")


def parse_depths(text: str) -> list[int]:
    try:
        depths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--depths {text!r}: comma-separated token counts, e.g. 0,512,2048") from None
    if not depths or depths[0] < 0:
        raise SystemExit(f"--depths {text!r}: at least one depth, none negative")
    return depths


def anchor_of(name: str) -> str | None:
    """The llama.cpp row a candidate is compared with: the same expert precision."""
    if name.startswith("moetier-gguf-"):
        return "llamacpp-" + name.removeprefix("moetier-gguf-").removesuffix("-bf16step")
    m = re.match(r"moetier-e(\w+?)-d", name)
    anchor = MATCH.get(m.group(1)) if m else ("llamacpp-bf16" if name.startswith("transformers") else None)
    if anchor and "disk25" in name and "efull" in name:
        anchor = "llamacpp-bf16-cold-mmap"
    return anchor


def make_rows(names: list[str], runs: dict[str, list[Result]], errors: dict[str, str], s: Setup,
              isa: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (candidate, depth): medians over the timed rounds, the time split, the floor share."""
    kv = kv_bytes_per_position(s.config)
    rows: list[dict[str, Any]] = []
    for n in names:
        rs = runs[n]
        for i, d in enumerate(s.depths):
            row: dict[str, Any] = {"candidate": n, "depth": d, "error": errors.get(n), "cpu": isa["cpu"],
                                   "isa_flags": isa["flags"], "torch_capability": isa["torch_capability"],
                                   "kernels": rs[-1]["kernels"] if rs else None}  # fmt: skip
            if rs:
                ms = [r["decode"][d] for r in rs]
                row["decode"] = statistics.median(m["tok_s"] for m in ms)
                row["decode_runs"] = [round(m["tok_s"], 2) for m in ms]
                if i == 0:  # prefill is per candidate (a P-token prompt from an empty context): on its first row
                    row["prefill"] = statistics.median(r["prefill"] for r in rs)
                    row["prefill_runs"] = [round(r["prefill"], 1) for r in rs]
                total = 1000 / row["decode"]
                row["ms_per_token"] = total
                kern = [m["kernel_s"] for m in ms]
                if all(k is not None for k in kern):
                    row["kernel_ms_per_token"] = 1000 * statistics.median(kern)
                    row["outside_ms_per_token"] = total - row["kernel_ms_per_token"]
                    row["outside_pct"] = 100 * row["outside_ms_per_token"] / total
                    row["kernel_calls_per_token"] = ms[-1].get("kernel_calls")
                weights = rs[-1].get("bytes_per_token")
                if weights:
                    bpt = weights + kv * (d + s.tokens / 2)
                    shares = [m["tok_s"] * bpt / m["bandwidth"] for m in ms]
                    row.update(
                        bytes_per_token=bpt,
                        weight_bytes_per_token=weights,
                        floor_share=statistics.median(shares),
                        floor_share_runs=[round(x, 3) for x in shares],
                    )
                row["bandwidth_runs"] = [round(m["bandwidth"] / 1e9, 2) for m in ms]
                row["note"] = rs[-1].get("note", "")
            rows.append(row)
    by = {(r["candidate"], r["depth"]): r for r in rows}
    for row in rows:
        anchor = anchor_of(row["candidate"])
        a = by.get((anchor or "", row["depth"]), {})
        row["anchor"] = anchor
        row["x_decode"] = ratio(row.get("decode"), a.get("decode"))
        a0 = by.get((anchor or "", s.depths[0]), {})
        row["x_prefill"] = ratio(row.get("prefill"), a0.get("prefill"))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'candidate':<28}{'depth':>6}{'decode':>8}{'prefill':>8}{'x dec':>6}{'x pre':>6}{'ms/tok':>8}"
          f"{'kernel':>8}{'outside':>8}{'out%':>5}{'MB/tok':>7}{'floor':>6}  vs / decode runs / note")  # fmt: skip
    for row in rows:
        n = row["candidate"]
        if "decode" not in row:
            print(f"{n:<28}{row['depth']:>6}  ERROR {row['error']}")
            continue
        bpt = row.get("bytes_per_token")
        share = row.get("floor_share")
        extra = f"  vs {row['anchor'] or '-'}; decode {', '.join(f'{x:.1f}' for x in row['decode_runs'])}"
        extra += f"; {row['note']}" if row["note"] else ""
        print(f"{n:<28}{row['depth']:>6}{row['decode']:>8.1f}{fmt(row.get('prefill'), '.1f'):>8}"
              f"{fmt(row['x_decode'], '.2f'):>6}{fmt(row['x_prefill'], '.2f'):>6}{row['ms_per_token']:>8.2f}"
              f"{fmt(row.get('kernel_ms_per_token'), '.2f'):>8}{fmt(row.get('outside_ms_per_token'), '.2f'):>8}"
              f"{fmt(row.get('outside_pct'), '.0f'):>5}{fmt(bpt and bpt / 1e6, '.0f'):>7}"
              f"{fmt(share and 100 * share, '.0f'):>5}%{extra}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens N (llama-bench -n), at least 2")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prefill tokens P (llama-bench -p)")
    ap.add_argument("--depths", default="0,512,2048", help="decode depths D (llama-bench -d), comma-separated")
    ap.add_argument("--only", default="", help="comma-separated candidate names or globs, e.g. 'llamacpp-*'; "
                    f"default {','.join(DEFAULT_ONLY)} (and the --disk rows); '*' = all")  # fmt: skip
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary of the benchmark model (default 32000)")
    ap.add_argument("--kl", action="store_true", help="also KL of int4/int8 moetier vs Q4_0/Q8_0 on the same text")
    ap.add_argument("--skip-build", action="store_true", help="never download or build llama.cpp (GGUF files and "
                    "moetier tiers are still made when missing)")  # fmt: skip
    ap.add_argument("--disk", action="store_true", help="add the 25%%-host-budget and cold-mmap rows")
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--llamacpp-version", default=LLAMACPP_VERSION)
    ap.add_argument("--quant-dir", default=None, help="moetier tier root (default MODEL/moetier-quant)")
    ap.add_argument("--quant-method", default="hqq", help="fit for tiers written here: hqq (default) or rtn")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1 (round 0, the warm-up, is not counted)")
    if args.tokens < 2:
        raise SystemExit("--tokens must be at least 2 (decode tok/s counts tokens 2..N)")
    depths = parse_depths(args.depths)
    cache = Path(args.cache_dir).resolve()
    torch.set_num_threads(args.threads)
    all_cands = candidates(args.disk)
    pats = [p.strip() for p in args.only.split(",") if p.strip()] or [*DEFAULT_ONLY, *(DISK_ONLY if args.disk else ())]
    names = [n for n in all_cands if any(fnmatch.fnmatch(n, p) for p in pats)]
    if not names:
        raise SystemExit(f"--only {args.only!r} matches none of: {', '.join(all_cands)}")
    model = qwen3_bench_model(cache, args.vocab).resolve()
    config = json.loads((model / "config.json").read_text())
    config.setdefault("num_experts", config.get("num_local_experts"))  # transformers 5 saves num_local_experts
    max_seq_len = max(depths[-1], args.prompt_tokens) + args.tokens
    if max_seq_len > config["max_position_embeddings"]:
        raise SystemExit(f"the deepest measurement needs {max_seq_len} positions, the model has "
                         f"{config['max_position_embeddings']}: raise BENCH_CONFIG's max_position_embeddings "
                         "(benchmarks/_models.py) or lower --depths / --tokens / --prompt-tokens")  # fmt: skip
    setup_errors: dict[str, str] = {}

    # 1-2. llama.cpp and its GGUF files
    lc: LlamaCpp | None = None
    ggufs: dict[str, Path] = {}
    gguf_info: dict[str, dict[str, Any]] = {}
    make_info: dict[str, Any] = {}
    gtypes = sorted({n.split("-")[1] for n in names if n.startswith("llamacpp")}
                    | ({t for _, t in KL_PAIRS} if args.kl else set()))  # fmt: skip
    if gtypes:
        try:
            lc = get_llamacpp(cache, args.llamacpp_version, args.skip_build)
            ggufs, make_info = make_ggufs(cache, lc, model, gtypes)
            gg = gguf_module(lc)
            for t, p in ggufs.items():
                gguf_info[t] = gguf_summary(gg, p, config["num_experts_per_tok"], config["num_experts"])
        except Exception as e:
            setup_errors["llamacpp"] = f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
    needed = sorted({p for p in ("int8", "int4") if any(f"-e{p}-" in n for n in names)}
                    | ({p for p, _ in KL_PAIRS} if args.kl else set()))  # fmt: skip
    if needed:
        try:
            ensure_tiers(model, needed, args.quant_dir, args.quant_method)
        except Exception as e:
            setup_errors["moetier_tiers"] = f"{type(e).__name__}: {e}"
            log(str(e))

    isa = cpu_isa()
    vocab = config["vocab_size"]
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    context = torch.randint(3, vocab, (max(depths[-1], 1),), generator=torch.Generator().manual_seed(1)).tolist()
    bandwidth = Bandwidth(args.threads)
    s = Setup(model, args.threads, prompt, context, depths, args.tokens, checkpoint_params(model), config, ggufs,
              gguf_info, lc, bandwidth, max_seq_len,
              str(Path(args.quant_dir).resolve()) if args.quant_dir else None,
              gguf_rows=[n.removeprefix("moetier-gguf-") for n in names if n.startswith("moetier-gguf-")])  # fmt: skip

    # 3-5. interleaved rounds; round 0 is the warm-up; bandwidth is measured before each decode measurement
    runs: dict[str, list[Result]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    for rnd in range(args.rounds + 1):
        for n in names:
            if n in errors:
                continue
            log(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: {n}")
            try:
                r = all_cands[n](s)
            except Exception as e:
                msg = f"{type(e).__name__}: {e}".strip().splitlines()
                errors[n] = " | ".join(msg[-3:])[:400]
                log(traceback.format_exc())
                continue
            if rnd > 0:
                runs[n].append(r)
    kl = run_kl(s, cache, lc) if args.kl else None

    # report
    print(f"cpu: {isa['cpu']}; ISA flags: {' '.join(isa['flags']) or '-'}; torch capability: "
          f"{isa['torch_capability']}; torch {torch.__version__}; threads {args.threads}")  # fmt: skip
    print(f"model: {model.name} (vocab {vocab}, max positions {config['max_position_embeddings']}); "
          f"prefill P={args.prompt_tokens}, decode N={args.tokens} at depths {','.join(map(str, depths))}; "
          f"moetier max_seq_len {max_seq_len}")  # fmt: skip
    print(f"llama.cpp: llama-cpp-python {args.llamacpp_version} (vendored tree)"
          + (f"; {'; '.join(lc.notes)}" if lc and lc.notes else "")
          + (f"; GGUF files in {make_info['dir']}" if make_info.get("dir") else ""))  # fmt: skip
    seen = bandwidth.seen
    if seen:
        print(f"read bandwidth: {min(seen) / 1e9:.1f} to {max(seen) / 1e9:.1f} GB/s (median "
              f"{statistics.median(seen) / 1e9:.1f}) over {len(seen)} measurements, each the median of 5 sums of a "
              f"1 GiB fp32 tensor with {args.threads} threads, taken right before each decode measurement "
              "(warm-up round included)")  # fmt: skip
    for t, inf in gguf_info.items():
        print(f"GGUF {t:<7} {inf['file_bytes'] / 1e6:>7.0f} MB, {inf['bytes_per_token'] / 1e6:.0f} MB/token: "
              f"{format_types(inf['types'])}")  # fmt: skip
    for k, v in setup_errors.items():
        print(f"setup error ({k}): {v}")
    rows = make_rows(names, runs, errors, s, isa)
    print_table(rows)
    print("decode / prefill: tok/s medians (prefill: a P-token prompt from an empty context, on a candidate's first "
          "row); x dec / x pre: against the llama.cpp row of the same expert precision at the same depth; ms/tok = "
          "1000 / decode; kernel / outside: ms per decode token inside / outside moetier's native step calls "
          "(llama.cpp: no split); MB/tok: weights a token reads plus the KV cache at depth + N/2; floor: median over "
          "runs of decode x bytes per token / the read bandwidth measured right before that run")  # fmt: skip
    if kl is not None:
        print_kl(kl)
    print(json.dumps({
        "benchmark": "vs_llamacpp", "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "depths": depths, "model": model.name, "vocab": vocab,
        "max_seq_len": max_seq_len, "llamacpp_version": args.llamacpp_version, "isa": isa,
        "torch": torch.__version__, "bandwidth_seen": seen,
        "gguf": {t: {"types": v["types"], "bytes_per_token": v["bytes_per_token"], "file_bytes": v["file_bytes"]}
                 for t, v in gguf_info.items()},
        "gguf_make": make_info, "setup_errors": setup_errors, "rows": rows, "kl": kl,
    }, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
