"""Decode and prefill speed against llama.cpp, on the same CPU, checkpoint and thread count.

The benchmark makes its anchor itself, so anyone can rerun it (everything lands under
`--cache-dir`, default `.bench/`, git-ignored; each step is skipped when its output exists):

1. **llama.cpp**: `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION` (default
   0.3.36, the newest 0.3 release when this was written) into `.bench/llamacpp/`, unpacked; its
   vendored tree `vendor/llama.cpp` is built with cmake (Release, CPU only, `GGML_NATIVE=ON`, no
   OpenSSL/CURL, no GPU backend, static) into `.bench/llamacpp/build`: `llama-bench`,
   `llama-quantize`, `llama-perplexity`. (`llama-cli` needs the server and web-UI targets in this
   tree, so it is not built.) About 10 minutes on 2 cores; cmake comes from `pip install cmake`
   if absent.
2. **GGUF files**: a copy of the benchmark checkpoint (`benchmarks/_models.py`; the weights are
   hard-linked, or symlinked across file systems) gets the bundled model's tokenizer files
   (`models/tiny-shakespeare-moe/tokenizer.json`, `tokenizer_config.json`), then the vendored
   `convert_hf_to_gguf.py` writes a bf16 GGUF and `llama-quantize` makes Q8_0, Q4_0 and Q4_K_M.
   - *Pre-tokenizer patch.* The converter names a BPE pre-tokenizer by hashing the token ids of
     a fixed text (`get_vocab_base_pre`, in `conversion/base.py` of this tree) and refuses hashes
     it does not know; a freshly trained byte-level BPE is not in its table. The script replaces
     the one line `res = None` of that function, idempotently, with
     `res = "gpt-2" if chkhsh == "<our hash>" else None  # moetier vs_llamacpp`: our tokenizer is a
     ByteLevel BPE with GPT-2's split regex, which is what llama.cpp's `gpt-2` pre-tokenizer does.
     The hash is computed here, the converter's way, from the tokenizer actually copied in.
   - *Vocabulary size.* The benchmark model has 32000 embedding rows; the bundled tokenizer has
     4096 tokens. Nothing needs padding: the converter writes `vocab_size` (config.json) tokens
     and fills the ids the tokenizer lacks with `[PAD<id>]` tokens of type UNUSED, so the GGUF's
     vocabulary matches the embedding and output-head shapes. (It only asserts that every
     tokenizer id is below `vocab_size`.) Speed does not depend on the token ids: all candidates
     run random token ids below 32000.
   Each file's tensor types are printed per kind of weight (read with the vendored `gguf`
   package), which is how llama.cpp quantizes the non-expert weights of each file type.
3. **Candidates**, run interleaved: a warm-up round (not counted), then `--rounds` rounds, each
   running every candidate once, all with `--threads` threads (default 2):
   - `llamacpp-<type>`: `llama-bench -t T -p P -n N -r 1 -o json` per GGUF (llama-bench runs its
     own warm-up pass, then one timed repetition; decode from an empty context);
   - `transformers-eager`: bf16 `generate` as shipped; `transformers-compiled`: bf16 with
     `experts_implementation="batched_mm"` in `from_pretrained` and `torch.compile` of the
     forward over a static cache (`cache_implementation="static"`), compiled once in the
     warm-up round and reused;
   - `moetier-e<experts>-d<dense>`: the engine through its Python API, routed experts at full
     (bf16), int8 or int4 (`PrecisionConfig(mode=...)`, from the quantized tiers that
     `moetier quantize MODEL --precisions int8,int4` writes, run here if missing) and the
     non-expert weights at `RuntimeConfig(dense_precision="full"|"int8"|"int4")`.
   transformers and moetier run in this process: a fresh load per round (the compiled model
   excepted), one short untimed generate, then the timed one: a P-token prompt (prefill tok/s
   = P / time to the first token) and N new tokens (decode tok/s over tokens 2..N).
   A candidate that fails becomes a row with its error; the others go on.
4. **Bandwidth floor**: the best of several sums of a 512 MiB fp32 tensor with T torch threads,
   measured in the same run. Bytes read per decode token are the weights a token touches:
   attention, router, output head, norms, one embedding row and `k/E` of the experts (8 of 64
   here) at each candidate's precision (moetier: from its own slot size when the engine exposes
   it; llama.cpp: from the GGUF's tensor sizes). "floor" is the share of the bandwidth-bound
   speed (`bandwidth / bytes per token`) a candidate reaches.
5. `--disk`: moetier rows (bf16, and int4 with int4 dense weights) with a host expert budget of
   25% of their expert bytes (`Budgets(host_expert_bytes=...)`), the page cache dropped after
   the warm-up generate when `/proc/sys/vm/drop_caches` is writable (root); beside them
   llama.cpp bf16 with mmap (`-lm mmap --no-warmup`), the page cache dropped the same way
   before its decode test and again before its prefill test. A CPU-only llama.cpp cannot cap
   the memory its weights use: `--n-cpu-moe` / `-ot` only keep experts off a GPU, and this
   tree's lazy tensor reading (`-lzm on`) covers per-layer token embeddings, not experts, so
   after the first touch it reads experts from the page cache. Each row's note says whether
   the page cache was dropped.

Ratios: each row's decode and prefill against the llama.cpp row of the same expert precision
(bf16 vs bf16, int8 vs Q8_0, int4 vs Q4_0; the llama.cpp files also quantize attention and the
output head, see the printed tensor types). Prints the ISA (from /proc/cpuinfo and torch), the
GGUF tensor types, a table of medians, then one JSON line.

    python benchmarks/vs_llamacpp.py [--threads 2] [--rounds 3] [--tokens 64] [--prompt-tokens 128]
        [--only 'llamacpp-*,moetier-eint4-*'] [--skip-build] [--disk] [--cache-dir .bench]
"""

from __future__ import annotations

import argparse
import fnmatch
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

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_SRC = REPO / "models" / "tiny-shakespeare-moe"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LLAMACPP_VERSION = "0.3.36"  # newest llama-cpp-python 0.3.x on PyPI when this was written
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
GGUF_TYPES = ("bf16", "Q8_0", "Q4_0", "Q4_K_M")
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


def gguf_source(cache: Path, model: Path) -> Path:
    """The checkpoint folder with the bundled tokenizer copied in (weights linked, not copied)."""
    src = cache / "llamacpp" / "gguf" / "src"
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


def make_ggufs(cache: Path, lc: LlamaCpp, model: Path, skip_build: bool) -> tuple[dict[str, Path], dict[str, Any]]:
    """bf16 GGUF from the converter, then Q8_0 / Q4_0 / Q4_K_M from llama-quantize."""
    out = cache / "llamacpp" / "gguf"
    files = {t: out / f"qwen3moe-bench-{t}.gguf" for t in GGUF_TYPES}
    info: dict[str, Any] = {"quantize_s": {}}
    if skip_build:
        return {t: p for t, p in files.items() if p.exists()}, info
    src = gguf_source(cache, model)
    info["pretokenizer_hash"] = patch_pretokenizer(lc.tree, src)
    if not files["bf16"].exists():
        tmp = files["bf16"].with_suffix(".tmp")
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        t0 = time.perf_counter()
        run([sys.executable, str(lc.tree / "convert_hf_to_gguf.py"), str(src), "--outtype", "bf16",
             "--outfile", str(tmp)], env=env)  # fmt: skip
        tmp.rename(files["bf16"])
        info["convert_s"] = round(time.perf_counter() - t0, 1)
    for t in GGUF_TYPES[1:]:
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
    per_token = 0.0
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
        else:
            per_token += nbytes
    return {"types": kinds, "bytes_per_token": per_token, "file_bytes": path.stat().st_size}


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


def bandwidth_floor(threads: int, mib: int = 512, reps: int = 7) -> float:
    """Memory-read bandwidth (bytes/s): best of `reps` sums of a `mib` MiB fp32 tensor, T threads."""
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


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
    prompt: list[int]
    tokens: int
    params: dict[str, int]
    config: dict[str, Any]
    ggufs: dict[str, Path]
    gguf_info: dict[str, dict[str, Any]]
    lc: LlamaCpp | None
    quant_dir: str | None = None
    cached: dict[str, Any] = field(default_factory=dict)


Result = dict[str, Any]  # decode / prefill tok/s, optional bytes_per_token, note


def llamacpp_row(s: Setup, gtype: str, cold: bool = False) -> Result:
    if s.lc is None or gtype not in s.ggufs:
        raise RuntimeError("llama.cpp or its GGUF file is missing (build step failed or --skip-build)")
    cmd = [str(s.lc.tool("llama-bench")), "-m", str(s.ggufs[gtype]), "-t", str(s.threads), "-r", "1", "-o", "json"]
    if not cold:
        rows = llama_bench([*cmd, "-p", str(len(s.prompt)), "-n", str(s.tokens)])
        note = ""
    else:  # each test on its own, right after dropping the page cache; weights mmapped, no warm-up pass
        cmd += ["-lm", "mmap", "--no-warmup"]
        why = drop_page_cache()
        rows = llama_bench([*cmd, "-p", "0", "-n", str(s.tokens)])
        why = why or drop_page_cache()
        rows += llama_bench([*cmd, "-p", str(len(s.prompt)), "-n", "0"])
        note = why or "page cache dropped before each test"
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"decode": float(tg["avg_ts"]), "prefill": float(pp["avg_ts"]),
            "bytes_per_token": s.gguf_info[gtype]["bytes_per_token"], "note": note}  # fmt: skip


def llama_bench(cmd: list[str]) -> list[dict[str, Any]]:
    out = run(cmd).stdout
    return list(json.loads(out[out.index("[") :]))


def bf16_bytes_per_token(s: Setup) -> float:
    return moetier_bytes_per_token(s, "full", "full", None)


def hf_generate(model: Any, s: Setup, n: int, prompt: list[int], **kw: Any) -> _Clock:
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
            model.forward = torch.compile(model.forward, dynamic=False)
            t0 = time.perf_counter()
            hf_generate(model, s, s.tokens, s.prompt, **kw)  # compiles prefill and decode graphs
            s.cached["hf_compiled"] = model
            s.cached["hf_compile_s"] = time.perf_counter() - t0
    else:
        model = AutoModelForCausalLM.from_pretrained(str(s.model), dtype=torch.bfloat16).eval()
        hf_generate(model, s, 2, s.prompt[:8], **kw)  # untimed warm-up
    clock = hf_generate(model, s, s.tokens, s.prompt, **kw)
    new = clock.times[1:]
    note = f"compiled in {s.cached['hf_compile_s']:.0f} s" if compiled else ""
    return {"decode": (len(new) - 1) / (new[-1] - new[0]), "prefill": len(s.prompt) / (new[0] - clock.times[0]),
            "bytes_per_token": bf16_bytes_per_token(s), "note": note}  # fmt: skip


def moetier_bytes_per_token(s: Setup, experts: str, dense: str, slot_bytes: int | None) -> float:
    p, c = s.params, s.config
    k, n_exp, layers = c["num_experts_per_tok"], c["num_experts"], c["num_hidden_layers"]
    if slot_bytes is not None:
        expert = slot_bytes * k * layers
    else:
        k_in = (c["hidden_size"], c["moe_intermediate_size"])
        expert = p["experts"] * k / n_exp * expert_bytes_per_param(experts, k_in)
    # moetier quantizes attention per dense precision, keeps the router bf16, the head at Q8_0 under int4
    head_b = DENSE_BYTES["int8" if dense == "int4" else dense]
    dense_b = p["attention"] * DENSE_BYTES[dense] + p["router"] * 2 + p["head"] * head_b
    rest = p["norms"] * 2 + p["embedding"] / c["vocab_size"] * 2 + p["other"] * 2
    return expert + dense_b + rest


def moetier_config(s: Setup, experts: str, dense: str, budget: int | None = None) -> moetier.EngineConfig:
    return moetier.EngineConfig(
        budgets=moetier.Budgets(host_expert_bytes=budget),
        precision=moetier.PrecisionConfig(mode=experts, quant_dir=s.quant_dir),
        runtime=moetier.RuntimeConfig(device="cpu", dtype="bf16", dense_precision=dense),
    )


def expert_pool_bytes(engine: Any) -> tuple[int | None, int | None]:
    """(slot bytes, bytes of every expert at one slot each) when the engine's store exposes them."""
    store = getattr(engine, "store", None)
    slot = getattr(store, "slot_bytes", None)
    keys = getattr(store, "keys", None)
    if not isinstance(slot, int):
        return None, None
    return slot, slot * len(keys) if keys is not None else None


def moetier_row(s: Setup, experts: str, dense: str, disk: bool = False) -> Result:
    torch.set_num_threads(s.threads)
    budget = None
    note = []
    if disk:
        key = f"expert_bytes_{experts}"
        if key not in s.cached:
            with moetier.load(str(s.model), moetier_config(s, experts, dense)) as info:
                s.cached[key] = expert_pool_bytes(info)[1]
        if s.cached[key] is None:
            raise RuntimeError("the engine's store exposes no slot_bytes/keys: cannot size a 25% budget")
        budget = s.cached[key] // 4
        note.append(f"host budget {budget / 2**20:.0f} MiB")
    with moetier.load(str(s.model), moetier_config(s, experts, dense, budget)) as engine:
        slot, _ = expert_pool_bytes(engine)
        engine.generate(s.prompt[:8], max_new_tokens=2, stop_at_eos=False)  # untimed warm-up
        if disk:
            note.append(drop_page_cache() or "page cache dropped after the warm-up")
        res = engine.generate(s.prompt, max_new_tokens=s.tokens, stop_at_eos=False)
        stats = res.stats
    if len(res.token_ids) != s.tokens:
        raise RuntimeError(f"generated {len(res.token_ids)} tokens, asked {s.tokens}")
    if disk:
        note.append(f"hits {stats.get('hits')}, misses {stats.get('misses')}, "
                    f"disk {stats.get('disk_bytes', 0) / 2**20:.0f} MiB")  # fmt: skip
    if dense != "full" and not re.search(r"dense_(precision|bits)", json.dumps(stats, default=str)):
        note.append("engine stats do not report the dense precision")
    return {"decode": res.decode_tok_s, "prefill": len(s.prompt) / res.ttft_s,
            "bytes_per_token": moetier_bytes_per_token(s, experts, dense, slot if not disk else None),
            "note": "; ".join(note)}  # fmt: skip


def candidates(disk: bool) -> dict[str, Callable[[Setup], Result]]:
    out: dict[str, Callable[[Setup], Result]] = {}
    for t in GGUF_TYPES:
        out[f"llamacpp-{t}"] = partial(llamacpp_row, gtype=t)
    out["transformers-eager"] = partial(transformers_row, compiled=False)
    out["transformers-compiled"] = partial(transformers_row, compiled=True)
    for e in ("full", "int8", "int4"):
        for d in ("full", "int8", "int4"):
            out[f"moetier-e{e}-d{d}"] = partial(moetier_row, experts=e, dense=d)
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


# ---------------------------------------------------------------- 5. report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens (llama-bench -n)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prefill tokens (llama-bench -p)")
    ap.add_argument("--only", default="", help="comma-separated candidate names or globs, e.g. 'llamacpp-*'")
    ap.add_argument("--skip-build", action="store_true", help="no download/build/convert: use what is cached")
    ap.add_argument("--disk", action="store_true", help="add the 25%%-host-budget and cold-mmap rows")
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--llamacpp-version", default=LLAMACPP_VERSION)
    ap.add_argument("--quant-dir", default=None, help="moetier tier root (default MODEL/moetier-quant)")
    ap.add_argument("--quant-method", default="hqq", help="fit for tiers written here: hqq (default) or rtn")
    args = ap.parse_args()
    cache = Path(args.cache_dir).resolve()
    torch.set_num_threads(args.threads)
    all_cands = candidates(args.disk)
    pats = [p.strip() for p in args.only.split(",") if p.strip()]
    names = [n for n in all_cands if not pats or any(fnmatch.fnmatch(n, p) for p in pats)]
    if not names:
        raise SystemExit(f"--only {args.only!r} matches none of: {', '.join(all_cands)}")
    model = qwen3_bench_model(cache).resolve()
    config = json.loads((model / "config.json").read_text())
    config.setdefault("num_experts", config.get("num_local_experts"))  # transformers 5 saves num_local_experts
    setup_errors: dict[str, str] = {}

    # 1-2. llama.cpp and its GGUF files
    lc: LlamaCpp | None = None
    ggufs: dict[str, Path] = {}
    gguf_info: dict[str, dict[str, Any]] = {}
    make_info: dict[str, Any] = {}
    if any(n.startswith("llamacpp") for n in names):
        try:
            lc = get_llamacpp(cache, args.llamacpp_version, args.skip_build)
            ggufs, make_info = make_ggufs(cache, lc, model, args.skip_build)
            gg = gguf_module(lc)
            for t, p in ggufs.items():
                gguf_info[t] = gguf_summary(gg, p, config["num_experts_per_tok"], config["num_experts"])
        except Exception as e:
            setup_errors["llamacpp"] = f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
    if any(n.startswith("moetier-eint") for n in names):
        try:
            needed = sorted({p for p in ("int8", "int4") if any(f"-e{p}-" in n for n in names)})
            ensure_tiers(model, needed, args.quant_dir, args.quant_method)
        except Exception as e:
            setup_errors["moetier_tiers"] = f"{type(e).__name__}: {e}"
            log(str(e))

    isa = cpu_isa()
    prompt = torch.randint(3, config["vocab_size"], (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    s = Setup(model, args.threads, prompt, args.tokens, checkpoint_params(model), config, ggufs, gguf_info, lc,
              str(Path(args.quant_dir).resolve()) if args.quant_dir else None)  # fmt: skip

    # 3-4. interleaved rounds; round 0 is the warm-up; the bandwidth floor is measured each round
    runs: dict[str, list[Result]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    bw: list[float] = []
    for rnd in range(args.rounds + 1):
        bw.append(bandwidth_floor(args.threads))
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
    floor = statistics.median(bw[1:] if len(bw) > 1 else bw)

    # report
    print(f"cpu: {isa['cpu']}; ISA flags: {' '.join(isa['flags']) or '-'}; torch capability: "
          f"{isa['torch_capability']}; torch {torch.__version__}; threads {args.threads}")  # fmt: skip
    print(f"llama.cpp: llama-cpp-python {args.llamacpp_version} (vendored tree)"
          + (f"; {'; '.join(lc.notes)}" if lc and lc.notes else ""))  # fmt: skip
    print(f"read bandwidth floor: {floor / 1e9:.1f} GB/s (median of {len(bw) - 1 or 1} measurements, "
          f"best of 7 sums of 512 MiB each)")  # fmt: skip
    for t, inf in gguf_info.items():
        print(f"GGUF {t:<7} {inf['file_bytes'] / 1e6:>7.0f} MB, {inf['bytes_per_token'] / 1e6:.0f} MB/token: "
              f"{format_types(inf['types'])}")  # fmt: skip
    for k, v in setup_errors.items():
        print(f"setup error ({k}): {v}")
    rows: dict[str, dict[str, Any]] = {}
    for n in names:
        rs = runs[n]
        row: dict[str, Any] = {"error": errors.get(n)}
        if rs:
            row["decode"] = statistics.median(r["decode"] for r in rs)
            row["prefill"] = statistics.median(r["prefill"] for r in rs)
            row["decode_runs"] = [round(r["decode"], 2) for r in rs]
            row["prefill_runs"] = [round(r["prefill"], 1) for r in rs]
            row["bytes_per_token"] = rs[-1].get("bytes_per_token")
            row["note"] = rs[-1].get("note", "")
            bpt = row["bytes_per_token"]
            row["floor_share"] = row["decode"] * bpt / floor if bpt else None
        rows[n] = row
    for n, row in rows.items():
        m = re.match(r"moetier-e(\w+?)-d", n)
        anchor = MATCH.get(m.group(1)) if m else ("llamacpp-bf16" if n.startswith("transformers") else None)
        if anchor and "disk25" in n:
            anchor = "llamacpp-bf16-cold-mmap" if "efull" in n else anchor
        a = rows.get(anchor or "", {})
        row["anchor"] = anchor
        row["x_decode"] = ratio(row.get("decode"), a.get("decode"))
        row["x_prefill"] = ratio(row.get("prefill"), a.get("prefill"))
    print(f"{'candidate':<28}{'decode':>9}{'prefill':>9}{'x dec':>7}{'x pre':>7}{'MB/tok':>8}{'floor':>7}"
          "  vs / decode runs / note")  # fmt: skip
    for n, row in rows.items():
        if "decode" not in row:
            print(f"{n:<28}{'-':>9}{'-':>9}{'-':>7}{'-':>7}{'-':>8}{'-':>7}  ERROR {row['error']}")
            continue
        bpt = row["bytes_per_token"]
        extra = f"  vs {row['anchor'] or '-'}; decode {', '.join(f'{x:.1f}' for x in row['decode_runs'])}"
        extra += f"; {row['note']}" if row["note"] else ""
        print(f"{n:<28}{row['decode']:>9.1f}{row['prefill']:>9.1f}{fmt(row['x_decode'], '.2f'):>7}"
              f"{fmt(row['x_prefill'], '.2f'):>7}{fmt(bpt and bpt / 1e6, '.0f'):>8}"
              f"{fmt(row['floor_share'] and 100 * row['floor_share'], '.0f'):>6}%{extra}")  # fmt: skip
    print("decode/prefill: tok/s medians; x dec / x pre: against the llama.cpp row of the same expert precision; "
          "floor: decode x bytes per token / read bandwidth")  # fmt: skip
    print(json.dumps({
        "benchmark": "vs_llamacpp", "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "llamacpp_version": args.llamacpp_version, "isa": isa,
        "torch": torch.__version__, "bandwidth_bytes_s": floor, "bandwidth_runs": bw,
        "gguf": {t: {"types": v["types"], "bytes_per_token": v["bytes_per_token"], "file_bytes": v["file_bytes"]}
                 for t, v in gguf_info.items()},
        "gguf_make": make_info, "setup_errors": setup_errors, "rows": rows,
    }, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
