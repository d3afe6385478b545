"""The quality side of issue 29's quality-speed frontier: KL to the full model, and expert bytes read per token,
of every llama.cpp file type and of moetier's configurations, on the bundled trained model.

The speed side (decode tok/s at equal bytes per token) is measured on a large random checkpoint by
`benchmarks/bigger_than_memory.py`; this script gives each point the figure that places it there: the expert
bytes a decode token reads at a 100% miss rate. Everything it makes lands under `--cache-dir` (default
`.bench/quality_frontier/`, git-ignored); each step is skipped when its output exists (`--force` reruns the
points).

1. **Model and text.** `models/tiny-shakespeare-moe` (Qwen3-MoE, 4 MoE layers of 32 experts, top-4, trained on
   Shakespeare). Text: the first 2048 + 64 tokens of `data/shakespeare_heldout.txt` (`vs_llamacpp.kl_text`), scored
   over its first `--tokens` (2048) tokens in non-overlapping windows of `--window` (256, the model's training
   window; `train_window` in its moetier.json).
2. **GGUF files.** `vs_llamacpp.make_ggufs` (the pre-tokenizer patch included): the checkpoint with the bundled
   tokenizer copied in, llama.cpp's `convert_hf_to_gguf.py` to bf16, then `llama-quantize` to Q8_0, Q6_K, Q4_K_M,
   Q3_K_M, Q2_K and Q4_0, under `CACHE/llamacpp/gguf/tiny-shakespeare-moe/` (the files keep make_ggufs'
   `qwen3moe-bench-<type>.gguf` names). llama.cpp itself is the one `vs_llamacpp.py` built under
   `--llamacpp-cache` (default `.bench`; never built here). The K-quants need rows of 256 weights; the experts'
   down projections have 128 (the moe intermediate size), so llama-quantize falls back to another type for
   them (printed per file: the tensor types of each kind of weight).
3. **One reference, one set of positions.** The reference is the checkpoint in fp32 (`moetier eval --dtype fp32
   --save-logits REF`, the record `--kl-ref full` builds). Its log-probabilities are also written as a
   llama-perplexity `--kl-divergence-base` file (`llama_base`: the same header, token ids and 16-bit rows that
   llama-perplexity writes), so llama.cpp's KL is against the same fp32 model, not against its bf16 GGUF, and on
   the token ids written in that file (moetier's: llama-perplexity --kl-divergence reads them from it). A GGUF whose
   `tokenizer.ggml.add_bos_token` is true is refused (llama-perplexity would put BOS over each window's first
   token); the converted bundled tokenizer leaves it unset, and llama.cpp adds no BOS for it. llama-perplexity
   scores positions window/2 .. window-2 of each window (127 per window of 256); moetier's `--kl-from window/2`
   positions window/2 .. window-1 (128; the last predicts the next window's first token, and the text's last
   window has one token less): 1023 positions against 1016, the same windows and context.
4. **Points.** llama.cpp: `llama-perplexity -m FILE -c W -b W --chunks N --kl-divergence-base BASE
   --kl-divergence` for the bf16 file and each quantized one. moetier: `moetier eval MODEL --kl-ref REF --kl-from
   W/2 --window W --max-tokens T --json` with
   - `--precision full` (bf16 experts), `int8`, `int4`, `int2` (HQQ tiers written by `moetier quantize` into
     `CACHE/quant`), with `--dense-precision full`, and int8 / int4 with the matching `--dense-precision` (as
     Q8_0 / Q4_0 hold attention and head), int2 with int4 dense weights;
   - `--precision dynamic --hi full --lo int4`, `--hi int8 --lo int4` and `--hi int4 --lo int2` (the one between
     the 2- and 4-bit files) with 25%, 50% and 75% of the 128 experts hot: the budget is the engine's own
     minimum for every expert at lo (read from its refusal of a 1-byte budget) plus n_hot * (hi slot - lo slot);
     warmup on the held-out text from character 150,000 on
     (disjoint from the scored text), `--sync-switches`; and `DYNAMIC_EXTRA`: int4/int2 with 12.5% hot (beside
     Q2_K), and the points that land beside a llama.cpp file again with their dense weights quantised
     (`--dense-precision int4` / `int8`), as the files' are;
   - `--sparsity 0.5` and `0.85` on bf16 experts (the shipped threshold table), with `--sparsity-dense masked` so
     prefill windows are sparse too (as `benchmarks/sparsity.py` scores quality; the default runs calls of more
     tokens than the tipping point dense and exact);
   - fewer active experts: `--max-experts-per-token 3` and `2`, `--expert-threshold 0.15` and `0.25` (bf16);
   - the GGUF files opened by moetier (`moetier eval FILE.gguf --kl-other-checkpoint`, precision auto: the
     experts and, where it can, the dense weights computed as stored);
   - diagnostic, not frontier points: bf16 / int8 / int4 experts with `--dtype fp32` (no bf16 rounding of
     activations: how much of a point's KL is the weights' and how much the bf16 compute's).
5. **Expert bytes per token** (read at a 100% miss rate): bytes of one expert at the point's precision x the
   experts a token computes x MoE layers. Static precisions: the engine's resident bytes per expert
   (`precision` in its stats). Dynamic: hi and lo bytes weighted by the share of routed expert calls that
   went to the n_hot most-routed experts of their layer (`hot_call_share`, from the run's `--trace`): an upper
   bound on the share the online hot set served at hi, so the bytes are, if anything, too high. Sparsity: the whole
   slot is read on a miss (the touched bytes, gate + (1 - achieved sparsity) x (up + down), are reported
   beside it). Fewer experts: the mean experts computed per token and layer, from the engine's stats. GGUF
   files: the file's `*_exps` tensor bytes x top-k / experts (`vs_llamacpp.gguf_summary`). Dense weights
   (attention, head) are per-token bytes too, listed apart: the speed side's checkpoint is dominated by experts.

Prints the CPU and ISA, the GGUF tensor types, a table (configuration, bits per expert weight, bytes per expert,
expert bytes per token, dense bytes per token, KL mean and standard error, p99, top-1 agreement, PPL), for each
llama.cpp file the moetier points at least as good at no more expert bytes per token, then one JSON line;
`--plot FILE` draws KL against expert bytes per token.

    python benchmarks/quality_frontier.py [--threads 2] [--tokens 2048] [--window 256] [--only 'moetier-int*']
        [--plot docs/img/quality_frontier.png] [--force] [--cache-dir .bench/quality_frontier]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks.*` from any cwd

import numpy as np

from benchmarks.vs_llamacpp import (
    CLI,
    HELDOUT,
    LLAMA_KL,
    LLAMACPP_VERSION,
    LlamaCpp,
    cpu_isa,
    ensure_tiers,
    format_types,
    get_llamacpp,
    gguf_module,
    gguf_summary,
    kl_text,
    make_ggufs,
)
from moetier.plotting import pyplot, save_figure
from moetier.runtime.quality import RefLogprobs

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-shakespeare-moe"
GGUF_TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0")
HOT_SHARES = (0.25, 0.5, 0.75)
DYNAMIC = (("full", "int4"), ("int8", "int4"), ("int4", "int2"))  # (hi, lo)
# (hi, lo, hot share, dense precision): the points beside llama.cpp files, with their dense weights quantised too
# (the files quantise attention and head, which costs KL), and int4/int2 with fewer hot experts, beside Q2_K
DYNAMIC_EXTRA = (
    ("int4", "int2", 0.125, "full"),
    ("int4", "int2", 0.125, "int4"),
    ("int4", "int2", 0.5, "int4"),
    ("int4", "int2", 0.75, "int4"),
    ("int8", "int4", 0.25, "int8"),
    ("int8", "int4", 0.25, "int4"),
)
WARMUP_FROM = 150_000  # characters: the held-out text from here on (Twelfth Night) seeds dynamic's hotness
QUANT_METHOD = "hqq"
KEYS = ("kl_mean", "kl_stderr", "kl_median", "kl_p99", "kl_max", "top1_pct", "ppl", "ref_ppl", "kl_tokens")


def log(msg: str) -> None:
    print(f"[quality_frontier] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    log("$ " + " ".join(map(str, cmd)))
    proc = subprocess.run(cmd, text=True, capture_output=True, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


# ---------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class Shape:
    layers: int  # MoE layers
    experts: int  # routed experts per layer
    top_k: int
    hidden: int
    inter: int  # moe intermediate size
    vocab: int
    attn_params: int  # attention projections, all layers (the weights --dense-precision quantises)
    head_params: int  # the output head (Q8_0 under --dense-precision int8 and int4)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.inter  # gate, up, down

    @classmethod
    def read(cls, model: Path) -> Shape:
        c = json.loads((model / "config.json").read_text())
        h, heads, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
        return cls(c["num_hidden_layers"], c["num_local_experts"], c["num_experts_per_tok"], h,
                   c["moe_intermediate_size"], c["vocab_size"], attn * c["num_hidden_layers"],
                   h * c["vocab_size"])  # fmt: skip

    def dense_bytes(self, dense: str) -> float:
        """Attention projections and output head bytes a token reads at `--dense-precision dense`."""
        head = 2.0 if dense == "full" else DENSE_BYTES_PER_WEIGHT["int8"]
        return self.attn_params * DENSE_BYTES_PER_WEIGHT[dense] + self.head_params * head


DENSE_BYTES_PER_WEIGHT = {"full": 2.0, "int8": 34 / 32, "int4": 18 / 32}  # bf16, Q8_0, Q4_0 blocks of 32


# ---------------------------------------------------------------- the reference, as llama-perplexity reads it


def llama_base(ref: RefLogprobs, ids: list[int], window: int, path: Path) -> int:
    """Write REF's log-probabilities as a llama-perplexity `--kl-divergence-base` file (tools/perplexity: "_logits_",
    n_ctx u32, n_vocab i32, n_chunk i32, the chunks' token ids i32, then per chunk and scored position
    first = n_ctx/2 .. n_ctx-2 one row of nv = 2*ceil(V/2) + 4 u16: scale f32, min log-prob f32, V 16-bit codes),
    encoded as llama-perplexity encodes its own logits (log_softmax with a 16-nat floor). Returns the chunks."""
    n_chunk = len(ids) // window
    first = window // 2
    vocab = ref.vocab
    nv = 2 * ((vocab + 1) // 2) + 4
    starts = ref.starts.tolist()
    if starts[:n_chunk] != [c * window for c in range(n_chunk)]:
        raise RuntimeError(f"reference windows start at {starts[:4]}..., not every {window} tokens")
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([window], dtype=np.uint32).tobytes())
        f.write(np.array([vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(np.asarray(ids[: n_chunk * window], dtype=np.int32).tobytes())
        for c in range(n_chunk):
            row0 = c * window  # every window before the last holds `window` scored rows
            lp = ref.rows(row0 + first, row0 + window - 1).double().numpy()  # [window - 1 - first, V]
            mx = lp.max(axis=1)
            mn = np.maximum(lp.min(axis=1), mx - 16)
            lse = np.log(np.exp(lp - mx[:, None]).sum(axis=1))
            min_lp = (mn - mx - lse).astype(np.float32)
            scale = ((mx - mn) / 65535.0).astype(np.float32)
            q = np.where(lp > mn[:, None], np.rint((lp - mn[:, None]) / np.where(scale > 0, scale, 1)[:, None]), 0)
            rows = np.zeros((lp.shape[0], nv), dtype=np.uint16)
            head = np.stack([scale, min_lp], axis=1).astype(np.float32)  # [T, 2]
            rows[:, :4] = head.view(np.uint16).reshape(lp.shape[0], 4)
            rows[:, 4 : 4 + vocab] = np.clip(q, 0, 65535).astype(np.uint16)
            f.write(rows.tobytes())
    return n_chunk


def add_bos(lc: LlamaCpp, gguf: Path) -> bool | None:
    """The GGUF's tokenizer.ggml.add_bos_token (None: not set, llama.cpp's default for the vocabulary type)."""
    reader = gguf_module(lc).GGUFReader(str(gguf))
    f = reader.fields.get("tokenizer.ggml.add_bos_token")
    return None if f is None else bool(f.parts[f.data[0]][0])


# ---------------------------------------------------------------- points


@dataclass
class Point:
    name: str
    engine: str  # "llama.cpp" | "moetier"
    family: str  # for the plot: llama.cpp, static, dynamic, sparsity, fewer experts, gguf
    args: list[str] = field(default_factory=list)  # moetier eval flags
    model: Path | None = None  # moetier: the checkpoint or GGUF file (default MODEL)
    gguf: str | None = None  # the GGUF type this point runs (llama.cpp or moetier on the file)
    precision: str = "full"  # expert precision (static), or "hi/lo"
    dense: str = "full"
    hot: float = 0.0  # dynamic: the share of the experts given hi slots


def moetier_points(ggufs: dict[str, Path]) -> list[Point]:
    pts = [Point("moetier-full", "moetier", "static", ["--precision", "full"], precision="full")]
    for p in ("int8", "int4", "int2"):
        pts.append(Point(f"moetier-{p}", "moetier", "static", ["--precision", p], precision=p))
    for p, d in (("int8", "int8"), ("int4", "int4"), ("int4", "int8"), ("int2", "int4")):
        pts.append(Point(f"moetier-{p}-d{d}", "moetier", "static", ["--precision", p, "--dense-precision", d],
                         precision=p, dense=d))  # fmt: skip
    dyn = [(hi, lo, share, "full") for hi, lo in DYNAMIC for share in HOT_SHARES] + list(DYNAMIC_EXTRA)
    for hi, lo, share, dense in dyn:
        flags = ["--precision", "dynamic", "--hi", hi, "--lo", lo, "--dense-precision", dense]
        name = f"moetier-dyn-{hi}-{lo}-hot{share * 100:g}" + ("" if dense == "full" else f"-d{dense}")
        pts.append(Point(name, "moetier", "dynamic", flags, precision=f"{hi}/{lo}", dense=dense, hot=share))
    for s in (0.5, 0.85):
        pts.append(Point(f"moetier-full-sparsity{s}", "moetier", "sparsity", ["--precision", "full", "--sparsity",
                         str(s), "--sparsity-dense", "masked"]))  # fmt: skip
    for n in (3, 2):
        pts.append(Point(f"moetier-full-max{n}experts", "moetier", "fewer experts",
                         ["--precision", "full", "--max-experts-per-token", str(n)]))  # fmt: skip
    for thr in (0.15, 0.25):
        pts.append(Point(f"moetier-full-threshold{thr}", "moetier", "fewer experts",
                         ["--precision", "full", "--expert-threshold", str(thr)]))  # fmt: skip
    for p, d in (("full", "full"), ("int8", "int8"), ("int4", "int8"), ("int4", "int4")):  # llama.cpp's numerics
        name = "moetier-full-wide" if p == "full" else f"moetier-{p}-d{d}-wide"
        pts.append(Point(name, "moetier", "wide", ["--precision", p, "--dense-precision", d, "--residual", "fp32"],
                         precision=p, dense=d))  # fmt: skip
    for prec in ("full", "int8", "int4"):  # diagnostic: the weights' own error without bf16 activations
        pts.append(Point(f"moetier-{prec}-fp32", "moetier", "fp32 compute", ["--precision", prec, "--dtype", "fp32"],
                         precision=prec))  # fmt: skip
    for t in ("bf16", *GGUF_TYPES):
        pts.append(Point(f"moetier-gguf-{t}", "moetier", "gguf", ["--kl-other-checkpoint"], model=ggufs[t], gguf=t,
                         precision="stored", dense="stored"))  # fmt: skip
    return pts


def llamacpp_points() -> list[Point]:
    types = ("bf16", *GGUF_TYPES)
    return [Point(f"llamacpp-{t}", "llama.cpp", "llama.cpp", gguf=t, precision=t, dense=t) for t in types]


@dataclass
class Setup:
    cache: Path
    lc: LlamaCpp
    ggufs: dict[str, Path]
    gguf_info: dict[str, dict[str, Any]]
    text: Path
    warmup: Path
    ref: Path
    base: Path
    quant_dir: Path
    tokens: int
    window: int
    chunks: int
    threads: int
    shape: Shape
    slot: dict[str, int] = field(default_factory=dict)  # bytes per expert per precision, from the static runs

    def env(self) -> dict[str, str]:
        return dict(os.environ, OMP_NUM_THREADS=str(self.threads), HF_HUB_OFFLINE="1")

    def common(self) -> list[str]:
        return ["--text", str(self.text), "--max-tokens", str(self.tokens), "--window", str(self.window),
                "--device", "cpu"]  # fmt: skip


def run_llamacpp(s: Setup, pt: Point) -> dict[str, Any]:
    assert pt.gguf is not None
    cmd = [str(s.lc.tool("llama-perplexity")), "-m", str(s.ggufs[pt.gguf]), "-f", str(s.text), "-c", str(s.window),
           "-b", str(s.window), "--chunks", str(s.chunks), "-t", str(s.threads), "--kl-divergence-base", str(s.base),
           "--kl-divergence"]  # fmt: skip
    t0 = time.perf_counter()
    row: dict[str, Any] = {}
    for _ in range(3):  # its summary lines are sometimes missing from a pipe (exit racing its log thread): rerun
        proc = run(cmd)
        out = proc.stdout + proc.stderr
        for k, pat in LLAMA_KL.items():
            m = re.search(pat, out)
            row[k] = float(m.group(1)) if m else None
        if row["kl_mean"] is not None:
            break
    if row["kl_mean"] is None:
        raise RuntimeError(f"llama-perplexity {pt.gguf}: no 'Mean    KLD' line:\n{out[-1500:]}")
    row["kl_tokens"] = s.chunks * (s.window - s.window // 2 - 1)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def min_dynamic_budget(s: Setup, hi: str, lo: str) -> int:
    """The engine's minimum budget for every expert at `lo` (plus its staging and spare slots): the number its
    refusal of a 1-byte budget names."""
    proc = run([sys.executable, "-c", CLI, "eval", str(MODEL), *s.common(), "--precision", "dynamic", "--hi", hi,
                "--lo", lo, "--quant-dir", str(s.quant_dir), "--host-expert-mem", "1"],
               env=s.env(), check=False)  # fmt: skip
    said = proc.stdout + proc.stderr
    m = re.search(r"minimum(?: budget)?(?: is)? (\d[\d,]*) ?B", said)
    if m is None:
        raise RuntimeError(f"dynamic {hi}/{lo}: no minimum budget in the refusal:\n{said[-1500:]}")
    return int(m.group(1).replace(",", ""))


def run_moetier(s: Setup, pt: Point) -> dict[str, Any]:
    model = pt.model or MODEL
    args = list(pt.args)
    extra: dict[str, Any] = {}
    if pt.family == "dynamic":
        hi, lo = args[args.index("--hi") + 1], args[args.index("--lo") + 1]
        n_hot = round(pt.hot * s.shape.layers * s.shape.experts)
        floor = min_dynamic_budget(s, hi, lo)
        budget = floor + n_hot * (s.slot[hi] - s.slot[lo])
        extra = {"budget": budget, "min_budget": floor, "target_hot": n_hot}
        trace = s.cache / "points" / f"{pt.name}.parquet"
        args += ["--host-expert-mem", str(budget), "--warmup", str(s.warmup), "--sync-switches", "--trace", str(trace)]
        extra["trace"] = str(trace)
    if pt.precision not in ("full", "stored") or pt.family == "dynamic":
        args += ["--quant-dir", str(s.quant_dir)]
    t0 = time.perf_counter()
    proc = run([sys.executable, "-c", CLI, "eval", str(model), *s.common(), *args, "--kl-ref", str(s.ref),
                "--kl-from", str(s.window // 2), "--json"], env=s.env())  # fmt: skip
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    row = {k: payload.get(k) for k in KEYS} | extra | {"seconds": round(time.perf_counter() - t0, 1)}
    row["stats"] = {k: payload.get(k) for k in ("precision", "switching", "sparsity", "experts", "routing",
                                                 "dense_precision", "dense_stored", "kernels", "promotions",
                                                 "demotions", "hits", "misses", "tiers")}  # fmt: skip
    row["stats_keys"] = sorted(payload)
    if pt.family == "dynamic":
        n_hot = int((row["stats"].get("switching") or {}).get("n_hot", extra["target_hot"]))
        row["hot_call_share"] = hot_call_share(Path(extra["trace"]), n_hot // s.shape.layers)
    return row


def hot_call_share(trace: Path, n_hot_per_layer: int) -> float:
    """Share of the routed expert calls in `trace` that went to the n_hot most-routed experts of their layer: an
    upper bound on the share dynamic precision served at hi (its hot set is chosen online, from hotness)."""
    import pyarrow.parquet as pq

    t = pq.read_table(trace, columns=["layer", "experts"]).to_pydict()
    counts: dict[int, dict[int, int]] = {}
    for layer, experts in zip(t["layer"], t["experts"], strict=True):
        c = counts.setdefault(int(layer), {})
        for e in experts:
            if e is not None and e >= 0:
                c[int(e)] = c.get(int(e), 0) + 1
    total = sum(sum(c.values()) for c in counts.values())
    hot = sum(sum(sorted(c.values(), reverse=True)[:n_hot_per_layer]) for c in counts.values())
    return hot / total if total else 0.0


# ---------------------------------------------------------------- bytes per token


def per_expert_bytes(stats: dict[str, Any]) -> dict[str, float]:
    """Resident bytes per expert at each precision the run held (its `precision` statistics)."""
    out = {}
    for p, v in (stats.get("precision") or {}).items():
        if v.get("experts"):
            out[p] = v["bytes"] / v["experts"]
    return out


def experts_per_token(row: dict[str, Any], shape: Shape) -> tuple[float, str]:
    """Experts a token computes per MoE layer: top-k, or fewer where the run's statistics say so."""
    v = row["stats"].get("routing")  # runtime/route_override.py: kept (token, expert) pairs per routed row
    if isinstance(v, dict) and isinstance(v.get("experts_per_token"), int | float) and v.get("tokens"):
        return float(v["experts_per_token"]), "routing.experts_per_token"
    return float(shape.top_k), "top-k"


def place(s: Setup, pt: Point, row: dict[str, Any]) -> dict[str, Any]:
    """Bytes per expert, bits per expert weight, expert and dense bytes per token of a measured point."""
    sh = s.shape
    out: dict[str, Any] = {}
    if pt.gguf is not None:
        info = s.gguf_info[pt.gguf]
        ept = float(info["expert_bytes_per_token"])
        out["bytes_per_expert"] = ept / (sh.top_k * sh.layers)
        out["expert_bytes_per_token"] = ept
        out["dense_bytes_per_token"] = float(info["dense_bytes_per_token"])
        if pt.engine == "moetier" and not (row.get("stats") or {}).get("dense_stored"):
            out["dense_bytes_per_token"] = sh.dense_bytes("full")  # dense weights decoded to bf16
        out["how"] = "file's *_exps bytes x k / E"
    else:
        per = per_expert_bytes(row["stats"])
        k_eff, k_src = experts_per_token(row, sh)
        if pt.family == "dynamic":
            hi, lo = pt.precision.split("/")
            sw = row["stats"].get("switching") or {}
            hot = sw.get("n_hot", row.get("target_hot"))
            share = row.get("hot_call_share")
            how = "hi share = routed calls on the n_hot most-routed experts per layer (upper bound)"
            if share is None:
                share = (hot or 0) / (sh.layers * sh.experts)
                how = "hi share = hot share of experts (routing-weighted share not measured)"
            b_hi, b_lo = per.get(hi, s.slot[hi]), per.get(lo, s.slot[lo])
            bpe = share * b_hi + (1 - share) * b_lo
            out["hot_experts"], out["hot_share"] = hot, share
            out["how"] = how
        else:
            p = pt.precision
            bpe = per.get(p, s.slot.get(p, 0.0))
            out["how"] = f"slot x {k_src}"
        out["bytes_per_expert"] = bpe
        out["experts_per_token"] = k_eff
        out["expert_bytes_per_token"] = bpe * k_eff * sh.layers
        out["dense_bytes_per_token"] = sh.dense_bytes(pt.dense)
        sp = row["stats"].get("sparsity")
        if isinstance(sp, dict) and sp.get("achieved") is not None:
            ach = float(sp["achieved"]["overall"] if isinstance(sp["achieved"], dict) else sp["achieved"])
            out["sparsity_achieved"] = ach
            out["touched_expert_bytes_per_token"] = out["expert_bytes_per_token"] * (1 + 2 * (1 - ach)) / 3
    out["bits_per_weight"] = out["bytes_per_expert"] * 8 / sh.expert_params
    return out


# ---------------------------------------------------------------- report


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'configuration':<34}{'bits/w':>7}{'B/expert':>10}{'expert B/tok':>13}{'dense B/tok':>12}"
          f"{'KL mean':>11}{'± se':>9}{'p99':>8}{'top-1 %':>9}{'PPL':>9}{'tokens':>7}")  # fmt: skip
    for r in rows:
        if r.get("error"):
            print(f"{r['name']:<34}  error: {r['error'].splitlines()[-1][:120]}")
            continue
        print(f"{r['name']:<34}{fmt(r.get('bits_per_weight'), '.2f'):>7}{fmt(r.get('bytes_per_expert'), ',.0f'):>10}"
              f"{fmt(r.get('expert_bytes_per_token'), ',.0f'):>13}{fmt(r.get('dense_bytes_per_token'), ',.0f'):>12}"
              f"{fmt(r.get('kl_mean'), '.6f'):>11}{fmt(r.get('kl_stderr'), '.6f'):>9}{fmt(r.get('kl_p99'), '.4f'):>8}"
              f"{fmt(r.get('top1_pct'), '.2f'):>9}{fmt(r.get('ppl'), '.3f'):>9}"
              f"{fmt(r.get('kl_tokens'), 'd'):>7}")  # fmt: skip


def dominance(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """For each llama.cpp file: the moetier points (not GGUF files) with KL <= its KL at no more expert bytes per
    token ("experts"), and those of them also at no more dense bytes per token ("experts_and_dense"), best KL
    first."""
    ok = [r for r in rows if not r.get("error") and r.get("kl_mean") is not None]
    mt = [r for r in ok if r["engine"] == "moetier" and r["family"] not in ("gguf", "fp32 compute")]
    out = {}
    for c in (r for r in ok if r["engine"] == "llama.cpp"):
        cap, kl = c["expert_bytes_per_token"], c["kl_mean"]
        wins = sorted((m for m in mt if m["expert_bytes_per_token"] <= cap and m["kl_mean"] <= kl),
                      key=lambda m: m["kl_mean"])  # fmt: skip
        both = [m for m in wins if m["dense_bytes_per_token"] <= c["dense_bytes_per_token"]]
        out[c["name"]] = {"experts": [m["name"] for m in wins], "experts_and_dense": [m["name"] for m in both]}
    return out


def short_label(r: dict[str, Any]) -> str:
    """A point's name on the plot: 'int4/int2 50% d4' for moetier-dyn-int4-int2-hot50-dint4, and so on."""
    name = r["name"]
    if r["engine"] == "llama.cpp":
        return name.removeprefix("llamacpp-")
    m = re.match(r"moetier-dyn-(\w+)-(\w+)-hot([\d.]+)(?:-d(\w+))?$", name)
    if m:
        return f"{m[1]}/{m[2]} {m[3]}%" + (f" d{m[4][3:]}" if m[4] else "")
    m = re.match(r"moetier-(\w+)-d(int\d)(-wide)?$", name)
    if m:
        return f"{m[1]} d{m[2][3:]}" + (" wide" if m[3] else "")
    short = name.removeprefix("moetier-").replace("full", "bf16")
    short = re.sub(r"max(\d)experts", r"top-\1", short).replace("threshold", "thr ").replace("sparsity", "s")
    return short.replace("-", " ")


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 7.5))
    styles = {"llama.cpp": ("s", "tab:red"), "static": ("o", "tab:blue"), "wide": ("P", "tab:cyan"),
              "dynamic": ("^", "tab:green"),
              "sparsity": ("D", "tab:purple"), "fewer experts": ("v", "tab:orange"),
              "gguf": ("x", "tab:gray"), "fp32 compute": ("o", "none")}  # fmt: skip
    labels = {"llama.cpp": "llama.cpp files", "static": "moetier static precision",
              "wide": "moetier static, wide step (--residual fp32)",
              "dynamic": "moetier dynamic precision", "sparsity": "moetier sparsity (bf16)",
              "fewer experts": "moetier fewer experts (bf16)",
              "gguf": "moetier on the GGUF files", "fp32 compute": "moetier, fp32 compute (diagnostic)"}  # fmt: skip
    ok = [r for r in rows if not r.get("error") and (r.get("kl_mean") or 0) >= 1e-6]  # fp32 full: ~1e-9, off scale
    for fam, (marker, color) in styles.items():
        pts = [r for r in ok if r["family"] == fam]
        if not pts:
            continue
        xs, ys = [r["expert_bytes_per_token"] / 1e6 for r in pts], [r["kl_mean"] for r in pts]
        if color == "none":  # hollow
            ax.scatter(xs, ys, marker=marker, facecolors="none", edgecolors="black", label=labels[fam], s=40, zorder=3)
        elif marker == "x":  # unfilled: no edge colours
            ax.scatter(xs, ys, marker=marker, color=color, label=labels[fam], s=40, zorder=3)
        else:
            edge = [("black" if r["engine"] == "moetier" and r["dense"] in ("int8", "int4") else color) for r in pts]
            ax.scatter(
                xs, ys, marker=marker, c=color, edgecolors=edge, linewidths=1.2, label=labels[fam], s=40, zorder=3
            )
        for r in pts:
            if fam == "gguf":
                continue
            llama = fam == "llama.cpp"
            ax.annotate(short_label(r), (r["expert_bytes_per_token"] / 1e6, r["kl_mean"]), fontsize=8 if llama else 6.5,
                        color="tab:red" if llama else "black", fontweight="bold" if llama else "normal",
                        xytext=(4, -3 if llama else 3), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("expert bytes read per token at 100% miss (MB)")
    ax.set_ylabel("mean KL to the fp32 model (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="black edge: moetier with --dense-precision int8 / int4 (dN)", title_fontsize=7)
    save_figure(fig, path)


# ---------------------------------------------------------------- main


def common_args(ap: argparse.ArgumentParser, only_help: str) -> None:
    """The flags benchmarks/paired_kl.py shares with this script: it reads this script's cache (the reference
    logits named by --tokens and --window, the text, the GGUF files), so their defaults must be the same."""
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".bench" / "quality_frontier")
    ap.add_argument("--llamacpp-cache", type=Path, default=REPO / ".bench", help="where vs_llamacpp.py built llama.cpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--only", default="*", help=only_help)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, "comma-separated globs of point names")
    ap.add_argument("--force", action="store_true", help="rerun points whose results are cached")
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    cache = a.cache_dir.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if a.tokens % a.window or a.tokens // a.window < 2:
        raise SystemExit("--tokens must be a multiple of --window, at least two windows")
    isa = cpu_isa()
    log(f"CPU: {isa['cpu']}; {' '.join(isa['flags'])}; torch {isa['torch_capability']}")

    lc = get_llamacpp(a.llamacpp_cache.resolve(), LLAMACPP_VERSION, skip_build=True)
    ggufs, ginfo = make_ggufs(cache, lc, MODEL, list(GGUF_TYPES))
    shape = Shape.read(MODEL)
    gg = gguf_module(lc)
    gguf_info = {t: gguf_summary(gg, p, shape.top_k, shape.experts) for t, p in ggufs.items()}
    bos = add_bos(lc, ggufs["bf16"])
    if bos:
        raise SystemExit("the GGUF adds BOS: llama-perplexity's windows would not match moetier's")

    text, _ = kl_text(cache, MODEL)  # writes CACHE/kl_text.txt
    if a.tokens > 2048:
        raise SystemExit("vs_llamacpp.kl_text cuts 2048 + 64 tokens: --tokens at most 2048")
    warmup = cache / "warmup.txt"
    if not warmup.exists():
        warmup.write_text(HELDOUT.read_text(encoding="utf-8")[WARMUP_FROM:], encoding="utf-8")
    quant_dir = cache / "quant"
    ensure_tiers(MODEL, ["int8", "int4", "int2"], str(quant_dir), QUANT_METHOD)

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1")
    ref = cache / f"ref-fp32-{a.tokens}-w{a.window}.safetensors"
    if not ref.exists():
        run([sys.executable, "-c", CLI, "eval", str(MODEL), "--text", str(text), "--max-tokens", str(a.tokens),
             "--window", str(a.window), "--device", "cpu", "--dtype", "fp32", "--save-logits", str(ref)],
            env=env)  # fmt: skip
    rec = RefLogprobs.load(ref)
    from transformers import AutoTokenizer  # heavy; only here

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    tok.model_max_length = 10**9
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][: a.tokens]
    if rec.targets.tolist() != ids[1:]:
        raise SystemExit("the reference record's tokens are not the text's")
    base = cache / f"ref-fp32-{a.tokens}-w{a.window}.kld"
    chunks = llama_base(rec, ids, a.window, base)

    s = Setup(cache, lc, ggufs, gguf_info, text, warmup, ref, base, quant_dir, a.tokens, a.window, chunks, a.threads,
              shape)  # fmt: skip
    for t, info in gguf_info.items():
        log(f"{t}: {format_types(info['types'])}")

    only = [g.strip() for g in a.only.split(",") if g.strip()]
    points = llamacpp_points() + moetier_points(ggufs)
    results_dir = cache / "points"
    results_dir.mkdir(exist_ok=True)
    # the static runs first: dynamic budgets need their bytes per expert
    order = sorted(points, key=lambda p: (p.family == "dynamic",))
    rows: list[dict[str, Any]] = []
    for pt in order:
        f = results_dir / f"{pt.name}-{a.tokens}-w{a.window}.json"
        selected = any(fnmatch.fnmatch(pt.name, g) for g in only)
        row: dict[str, Any] | None = None
        if f.exists() and not (a.force and selected):
            row = json.loads(f.read_text())
        elif selected:
            try:
                row = run_llamacpp(s, pt) if pt.engine == "llama.cpp" else run_moetier(s, pt)
                f.write_text(json.dumps(row))
            except Exception as e:
                log(traceback.format_exc())
                row = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        if row is None:
            continue
        if pt.family == "static" and pt.dense == "full" and not row.get("error"):
            for p, b in per_expert_bytes(row["stats"]).items():
                s.slot.setdefault(p, round(b))
        if not s.slot.get("full"):
            s.slot["full"] = shape.expert_params * 2
        base_row = {"name": pt.name, "engine": pt.engine, "family": pt.family, "precision": pt.precision,
                    "dense": pt.dense, **row}  # fmt: skip
        if not row.get("error"):
            try:
                base_row |= place(s, pt, row)
            except Exception as e:
                base_row["error"] = f"placing: {type(e).__name__}: {e}"
        rows.append(base_row)
    rows.sort(key=lambda r: [p.name for p in points].index(r["name"]))

    print(f"CPU: {isa['cpu']} ({' '.join(isa['flags'])}; torch {isa['torch_capability']}), {a.threads} threads")
    print(f"model {MODEL.relative_to(REPO)}: {shape.layers} MoE layers x {shape.experts} experts, top-{shape.top_k}, "
          f"{shape.expert_params:,} weights per expert; text {text} ({a.tokens} tokens, {chunks} windows of "
          f"{a.window}); reference: the checkpoint in fp32 ({ref.name}, "
          f"PPL {math.exp(rec.nll_sum / rec.tokens):.3f})")  # fmt: skip
    for t, info in gguf_info.items():
        print(f"  {t}: {format_types(info['types'])}")
    print_table(rows)
    dom = dominance(rows)
    for name, d in dom.items():
        print(f"{name}: moetier points with KL <= its KL at no more expert bytes/token: "
              f"{', '.join(d['experts']) or 'none'}; also at no more dense bytes/token: "
              f"{', '.join(d['experts_and_dense']) or 'none'}")  # fmt: skip
    if a.plot:
        plot(rows, a.plot, f"{MODEL.name}: KL to fp32 vs expert bytes/token ({a.tokens} tokens, windows of {a.window})")
        log(f"plot: {a.plot}")
    out = {"cpu": isa, "threads": a.threads, "model": str(MODEL.relative_to(REPO)), "text": str(text),
           "tokens": a.tokens, "window": a.window, "gguf": {"dir": ginfo.get("dir"), "add_bos": bos,
           "files": {t: {k: v for k, v in i.items()} for t, i in gguf_info.items()}},
           "rows": [{k: v for k, v in r.items() if k not in ("stats", "stats_keys")} for r in rows],
           "dominance": dom}  # fmt: skip
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
