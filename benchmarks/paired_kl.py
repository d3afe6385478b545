"""Paired KL: llama.cpp's files and moetier's configurations scored token by token on the same positions of the
same text against the same fp32 model, so "no worse than llama.cpp" is a paired difference with its standard
error, not two means whose standard errors overlap.

Why: on the bundled model the KL of llama.cpp's bf16 and Q8_0 files (0.000034 and 0.000107 nats) and of moetier's
best configurations differ by less than either mean's standard error (1.3e-5 to 4e-5, from a few heavy tokens),
so `benchmarks/quality_frontier.py`'s side-by-side means cannot say which is closer. Per-token differences on the
same positions cancel what both engines share (the text's hard tokens) and leave the engines' own error.

Inputs are `benchmarks/quality_frontier.py`'s (run it first; its `--cache-dir`, default `.bench/quality_frontier`):
the fp32 reference record `ref-fp32-T-wW.safetensors` (`moetier eval --dtype fp32 --save-logits`), the text, the
GGUF files made by llama.cpp's own converter and `llama-quantize`, and moetier's quantized expert tiers.

1. **llama.cpp**: `llama-perplexity -m FILE -f TEXT -c W -b W --chunks T/W --kl-divergence-base DUMP` writes the
   file's own log-probabilities (uint16 rows with a scale and minimum, the format gguf_vs_llamacpp.py reads) for
   positions W/2 .. W-2 of each window; its token ids are checked against moetier's. KL(fp32 || file) per position
   is computed here, in float64, from the reference record's rows (exact top 32, 16-bit tail) and the dump.
2. **moetier**: each configuration loaded in this process, `runtime/quality.compare` (what `moetier eval --kl-ref
   REF --kl-from W/2` reports) gives KL per position W/2 .. W-1 of each window.
3. **Pairs**: each moetier configuration against the llama.cpp file it is set beside, on the positions both
   scored (llama.cpp's 127 a window): both means, the mean difference moetier - llama.cpp with its paired standard
   error (std of the differences / sqrt(n)), a 95% interval (1.96 s.e.), and the verdict: "lower" or "higher" when
   the interval excludes 0, else "tie". Top-1 agreement with the fp32 model, both sides.

    python benchmarks/paired_kl.py [--cache-dir .bench/quality_frontier] [--threads 2] [--only 'wide-*']

Prints the CPU, a table and one JSON line. KL evaluations, not timings: a busy machine does not change them.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moetier
from benchmarks.gguf_vs_llamacpp import read_logits_dump
from benchmarks.quality_frontier import common_args
from benchmarks.vs_llamacpp import LLAMACPP_VERSION, cpu_isa, get_llamacpp, log, run
from moetier.runtime.quality import RefLogprobs, compare

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-shakespeare-moe"
GGUF_DIR = Path("llamacpp/gguf/tiny-shakespeare-moe")  # under the cache dir (quality_frontier's make_ggufs)


@dataclass(frozen=True)
class Config:
    """One moetier configuration and the llama.cpp file type it is set beside."""

    name: str
    anchor: str  # llama.cpp file type
    precision: str = "full"  # experts: full, int8, int4 (tiers under quant/) or auto (a GGUF file: as stored)
    dense: str = "full"
    residual: str = "bf16"
    gguf: str | None = None  # run llama.cpp's own file of this type instead of the checkpoint folder
    groups: tuple[tuple[str, int], ...] = field(default=())
    quant: str = "quant"  # the tier root under the cache dir


CONFIGS = (
    Config("bf16", "bf16"),
    Config("wide-bf16", "bf16", residual="fp32"),
    Config("gguf-bf16", "bf16", precision="auto", residual="auto", gguf="bf16"),  # a GGUF file's default: wide
    Config("wide-bf16-vs-Q8_0", "Q8_0", residual="fp32"),  # bf16 experts at Q8_0's memory limits (bigger_than_memory)
    Config("int8-dint8", "Q8_0", "int8", "int8"),
    Config("wide-int8-dint8", "Q8_0", "int8", "int8", "fp32"),
    Config("wide-int8g32-dint8", "Q8_0", "int8", "int8", "fp32", groups=(("int8", 32),), quant="quant-g32"),
    Config("gguf-Q8_0-bf16", "Q8_0", precision="auto", residual="bf16", gguf="Q8_0"),
    Config("gguf-Q8_0", "Q8_0", precision="auto", residual="auto", gguf="Q8_0"),
    Config("wide-int4-dint8", "Q4_K_M", "int4", "int8", "fp32"),
    Config("gguf-Q4_K_M", "Q4_K_M", precision="auto", residual="auto", gguf="Q4_K_M"),
    Config("wide-int4-dint4", "Q2_K", "int4", "int4", "fp32"),
    Config("gguf-Q6_K", "Q6_K", precision="auto", residual="auto", gguf="Q6_K"),  # the rest of the files, same-file
    Config("gguf-Q4_0", "Q4_0", precision="auto", residual="auto", gguf="Q4_0"),
    Config("gguf-Q3_K_M", "Q3_K_M", precision="auto", residual="auto", gguf="Q3_K_M"),
    Config("gguf-Q2_K", "Q2_K", precision="auto", residual="auto", gguf="Q2_K"),
)


def gguf_path(cache: Path, t: str) -> Path:
    return cache / GGUF_DIR / f"qwen3moe-bench-{t}.gguf"


def positions(rec: RefLogprobs) -> list[tuple[int, int, int]]:
    """(window start, scored tokens, offset of its first in the record) per window."""
    starts, out, off = rec.starts.tolist(), [], 0
    n = rec.tokens
    for i, s in enumerate(starts):
        t = (starts[i + 1] - s) if i + 1 < len(starts) else n - off
        out.append((s, t, off))
        off += t
    return out


def llama_kl(cache: Path, lc: Any, t: str, text: Path, window: int, chunks: int, threads: int,
             rec: RefLogprobs, ids: list[int]) -> dict[int, tuple[float, bool]]:  # fmt: skip
    """{position: (KL(fp32 || the file), top-1 agreement)} for the positions llama-perplexity dumps."""
    dump = cache / "paired" / f"llama-{t}-c{window}x{chunks}.kld"
    dump.parent.mkdir(exist_ok=True)
    if not dump.exists():
        run([str(lc.tool("llama-perplexity")), "-m", str(gguf_path(cache, t)), "-f", str(text), "-c", str(window),
             "-b", str(window), "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base", str(dump)])
    got = read_logits_dump(dump)
    tokens, data, first, n_vocab = got["tokens"], got["data"], got["first"], got["n_vocab"]
    n_chunk, n_ctx = tokens.shape
    rows = data.shape[1]
    if tokens.reshape(-1).tolist() != ids[: n_chunk * n_ctx]:
        raise RuntimeError(f"llama.cpp tokenized {t}'s text differently from moetier: positions cannot pair")
    where = {s: off for s, _, off in positions(rec)}
    out: dict[int, tuple[float, bool]] = {}
    for c in range(n_chunk):
        s = c * n_ctx
        if s not in where:
            raise RuntimeError(f"llama.cpp's chunk {c} starts at {s}, no reference window does")
        lp_ref = rec.rows(where[s] + first, where[s] + first + rows).double().numpy()  # [rows, V]
        for r in range(rows):
            head = data[c, r, :4].copy().view(np.float32)  # scale, minimum log-probability
            theirs = head[1] + head[0] * data[c, r, 4 : 4 + n_vocab].astype(np.float64)
            theirs = theirs - np.logaddexp.reduce(theirs)  # renormalised, as the KL's both sides are
            mine = lp_ref[r] - np.logaddexp.reduce(lp_ref[r])
            p = np.exp(mine)
            out[s + first + r] = (float((p * (mine - theirs)).sum()), int(np.argmax(mine)) == int(np.argmax(theirs)))
    return out


def moetier_kl(cache: Path, cfg: Config, ids: list[int], window: int, rec: RefLogprobs,
               threads: int) -> dict[int, tuple[float, bool]]:  # fmt: skip
    """{position: (KL(fp32 || moetier), top-1 agreement)} over positions W/2 .. W-1 of each window."""
    torch.set_num_threads(threads)
    path = gguf_path(cache, cfg.gguf) if cfg.gguf else MODEL
    prec = moetier.PrecisionConfig(mode=cfg.precision, quant_dir=str(cache / cfg.quant), groups=cfg.groups)
    rt = moetier.RuntimeConfig(device="cpu", dense_precision=cfg.dense, residual=cfg.residual)
    first = window // 2
    with moetier.load(path, moetier.EngineConfig(precision=prec, runtime=rt)) as engine:
        got = compare(engine, ids, window, rec, f"{cfg.name}'s reference", first=first)
        residual = engine.stats().get("native_step", {}).get("residual")
    want = cfg.residual if cfg.residual != "auto" else ("fp32" if cfg.gguf else "bf16")
    if residual != want:
        raise RuntimeError(f"{cfg.name}: asked for residual {cfg.residual}, the engine ran {residual}")
    kl, agree = got.kl.tolist(), got.agree.tolist()
    out: dict[int, tuple[float, bool]] = {}
    i = 0
    for s, t, _ in positions(rec):
        for j in range(first, t):
            out[s + j] = (kl[i], bool(agree[i]))
            i += 1
    if i != len(kl):
        raise RuntimeError(f"{cfg.name}: {len(kl)} KL values for {i} positions")
    return out


def paired(mine: dict[int, tuple[float, bool]], theirs: dict[int, tuple[float, bool]]) -> dict[str, Any]:
    common = sorted(set(mine) & set(theirs))
    a = np.array([mine[p][0] for p in common])
    b = np.array([theirs[p][0] for p in common])
    d = a - b
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    mean = float(d.mean())
    verdict = "lower" if mean + 1.96 * se < 0 else ("higher" if mean - 1.96 * se > 0 else "tie")
    return {"positions": len(common), "moetier_kl": float(a.mean()), "llamacpp_kl": float(b.mean()),
            "moetier_se": float(a.std(ddof=1) / math.sqrt(len(a))), "llamacpp_se": float(b.std(ddof=1) /
            math.sqrt(len(b))), "diff": mean, "diff_se": se, "ci95": [mean - 1.96 * se, mean + 1.96 * se],
            "verdict": verdict, "moetier_top1": float(np.mean([mine[p][1] for p in common])),
            "llamacpp_top1": float(np.mean([theirs[p][1] for p in common]))}  # fmt: skip


def ensure_g32(cache: Path) -> None:
    """The int8 tier in groups of 32 (Q8_0's block, its bytes: 8.5 bits a weight) under CACHE/quant-g32."""
    root = cache / "quant-g32"
    if not (root / "int8-g32" / "manifest.json").exists():
        run([sys.executable, "-c", "import sys; from moetier.cli.app import main; sys.argv[0] = 'moetier'; main()",
             "quantize", str(MODEL), "--precisions", "int8", "--group", "int8=32", "--out", str(root)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, "comma-separated globs of configuration names")
    a = ap.parse_args()
    cache = a.cache_dir.resolve()
    ref = cache / f"ref-fp32-{a.tokens}-w{a.window}.safetensors"
    text = cache / "kl_text.txt"
    if not ref.exists() or not text.exists():
        raise SystemExit(f"no {ref.name} / kl_text.txt under {cache}: run benchmarks/quality_frontier.py first")
    isa = cpu_isa()
    log(f"CPU: {isa['cpu']}; {' '.join(isa['flags'])}; torch {isa['torch_capability']}")
    lc = get_llamacpp(a.llamacpp_cache.resolve(), LLAMACPP_VERSION, skip_build=True)
    rec = RefLogprobs.load(ref)
    from transformers import AutoTokenizer  # heavy; only here

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    tok.model_max_length = 10**9
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][: a.tokens]
    if rec.targets.tolist() != ids[1:]:
        raise SystemExit("the reference record's tokens are not the text's")
    only = [g.strip() for g in a.only.split(",") if g.strip()]
    configs = [c for c in CONFIGS if any(fnmatch.fnmatch(c.name, g) for g in only)]
    if any(c.quant == "quant-g32" for c in configs):
        ensure_g32(cache)
    llama: dict[str, dict[int, tuple[float, bool]]] = {}
    rows = []
    for c in configs:
        if c.anchor not in llama:
            llama[c.anchor] = llama_kl(cache, lc, c.anchor, text, a.window, a.tokens // a.window, a.threads, rec, ids)
        row = {"config": c.name, "anchor": c.anchor, "residual": c.residual, "precision": c.precision,
               "dense": c.dense, "groups": dict(c.groups)} | paired(
            moetier_kl(cache, c, ids, a.window, rec, a.threads), llama[c.anchor])
        rows.append(row)
        log(f"{c.name} vs {c.anchor}: {row['moetier_kl']:.6f} vs {row['llamacpp_kl']:.6f}, "
            f"diff {row['diff']:+.6f} ± {row['diff_se']:.6f} ({row['verdict']})")  # fmt: skip
    print(f"{'moetier configuration':<22}{'llama.cpp':>10}{'n':>6}{'moetier KL':>12}{'llama KL':>11}"
          f"{'diff':>11}{'± s.e.':>10}{'verdict':>8}{'top-1 m / l':>14}")  # fmt: skip
    for r in rows:
        print(f"{r['config']:<22}{r['anchor']:>10}{r['positions']:>6}{r['moetier_kl']:>12.6f}{r['llamacpp_kl']:>11.6f}"
              f"{r['diff']:>+11.6f}{r['diff_se']:>10.6f}{r['verdict']:>8}"
              f"{100 * r['moetier_top1']:>7.2f}/{100 * r['llamacpp_top1']:.2f}")  # fmt: skip
    print(json.dumps({"benchmark": "paired_kl", "isa": isa, "tokens": a.tokens, "window": a.window, "rows": rows}))


if __name__ == "__main__":
    main()
