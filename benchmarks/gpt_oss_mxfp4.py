"""GPT-OSS's MXFP4 experts computed as stored, against the same experts decoded to bf16 and against llama.cpp on
the same weights (issue 28: "stored" at least as fast as "full" for every format, MXFP4 included).

The checkpoint: a GPT-OSS-shaped random model (`CONFIG`: 8 layers, 32 experts of width 1024, top-4, hidden 1024,
sliding-window attention on every other layer, a 4,096-token vocabulary, so that the experts are most of a token's
bytes as in gpt-oss-20b), built once in bf16 under `--cache-dir`, then its expert tensors quantised to MXFP4 the way
GPT-OSS ships them (`*_blocks` U8 + `*_scales` E8M0, `quantization_config: {quant_method: mxfp4}`; the reference
quantiser of tests/formats/quant_ref.py, one expert at a time); attention, router, embeddings and head stay bf16, as
in the published checkpoints. llama.cpp's own converter (`convert_hf_to_gguf.py --outtype bf16`, from the
llama-cpp-python tree that benchmarks/vs_llamacpp.py builds) turns the MXFP4 folder into a GGUF file whose experts
are the same MXFP4 blocks and the rest bf16.

Candidates, every expert resident (`--budget 1.0`, the default) or at a host expert budget of that share of the bf16
expert bytes (the budget counts slot bytes, so MXFP4 slots hold ~3.7x the experts):
- `bf16/full`: the bf16 checkpoint (the anchor of the bytes);
- `mxfp4/full`: the MXFP4 folder, each expert decoded to bf16 when read (`--precision full`);
- `mxfp4/stored`: the MXFP4 folder computed as stored (`auto` picks it): blocks re-laid as GGUF MXFP4 rows in their
  slot when read, ggml's MXFP4 dot product inside the native MoE call;
- `gguf/auto`: moetier on llama.cpp's GGUF file;
- `llamacpp`: `llama-bench -m FILE -t T -p 0 -n N -r 1` on that file (skipped with `--no-llamacpp`).
Each moetier run is a fresh load, a warm-up generate of N tokens (every expert the timed run routes to is then
resident, as llama.cpp's page-cached weights are), then a timed generate of N tokens after a 1-token prompt (the
engine's own decode tok/s). A warm-up round, then `--rounds` rounds, the candidates interleaved; medians.

    python benchmarks/gpt_oss_mxfp4.py [--rounds 3] [--tokens 64] [--budget 1.0] [--threads 2]
        [--cache-dir .bench] [--no-llamacpp]

Prints the CPU and its ISA flags, a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import moetier
from gguf_vs_llamacpp import CONVERT  # llama.cpp's converter with the GPT-2 vocabulary code
from vs_llamacpp import (
    LLAMACPP_VERSION,
    TOKENIZER_FILES,
    TOKENIZER_SRC,
    cpu_isa,
    get_llamacpp,
    llama_bench,
    patch_pretokenizer,
    run,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO / "tests" / "formats"))  # the reference MXFP4 quantiser (quant_ref.py)
sys.path.insert(1, str(REPO / "benchmarks"))

CONFIG = dict(
    hidden_size=1024, num_hidden_layers=8, num_local_experts=32, num_experts_per_tok=4, intermediate_size=1024,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
    sliding_window=128, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[gpt_oss_mxfp4] {msg}", file=sys.stderr, flush=True)


def bf16_model(cache: Path) -> Path:
    """The GPT-OSS-shaped random bf16 checkpoint (seeded), built once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = cache / "gptoss-bench-bf16"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **CONFIG), dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_SRC / name, tmp / name)
    tmp.rename(out)
    return out


def mxfp4_model(cache: Path, src: Path) -> Path:
    """`src` with its expert tensors in GPT-OSS's MXFP4 (blocks + E8M0 scales), built once."""
    from quant_ref import mxfp4_quantise

    out = cache / "gptoss-bench-mxfp4"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        sd |= load_file(f)
    qsd: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = [mxfp4_quantise(t[e : e + 1].float()) for e in range(t.shape[0])]  # [1, R, G, 16], [1, R, G]
            qsd[name + "_blocks"] = torch.cat([p[0] for p in parts])
            qsd[name + "_scales"] = torch.cat([p[1] for p in parts])
        else:
            qsd[name] = t
    save_file(qsd, tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                  "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    tmp.rename(out)
    return out


def gguf_file(cache: Path, src: Path) -> Path:
    """llama.cpp's converter on the MXFP4 folder: MXFP4 experts, the rest bf16."""
    lc = get_llamacpp(cache, LLAMACPP_VERSION, skip_build=False)
    out = cache / "llamacpp" / "gguf" / "gptoss-bench-mxfp4.gguf"
    if not out.exists():
        patch_pretokenizer(lc.tree, src)
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        run([sys.executable, "-c", CONVERT, str(lc.tree), str(src), "--outtype", "bf16", "--outfile", str(out)],
            env=env)  # fmt: skip
    return out


def moetier_run(path: Path, mode: str, budget: int | None, tokens: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    cfg = moetier.EngineConfig(budgets=moetier.Budgets(host_expert_bytes=budget),
                               precision=moetier.PrecisionConfig(mode=mode),
                               runtime=moetier.RuntimeConfig(device="cpu", dtype="bf16"))  # fmt: skip
    with moetier.load(str(path), cfg) as engine:
        prompt = [5]
        engine.generate(prompt, max_new_tokens=tokens, stop_at_eos=False)  # warm-up: the routed experts resident
        res = engine.generate(prompt, max_new_tokens=tokens, stop_at_eos=False)
        st = engine.stats()
    return {"decode": res.decode_tok_s, "precision": st.get("precision"), "executor": st.get("executor"),
            "native": st.get("native"), "kernels": st.get("kernels")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=1.0, help="host expert budget, share of the bf16 expert bytes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--no-llamacpp", action="store_true")
    a = ap.parse_args()
    cache = Path(a.cache_dir)
    t0 = time.perf_counter()
    bf16 = bf16_model(cache)
    mx = mxfp4_model(cache, bf16)
    log(f"checkpoints ready in {time.perf_counter() - t0:.0f} s")
    cfg = CONFIG
    expert_bf16 = cfg["num_hidden_layers"] * cfg["num_local_experts"] * 3 * cfg["hidden_size"] * cfg[
        "intermediate_size"] * 2  # fmt: skip
    budget = None if a.budget >= 1.0 else int(a.budget * expert_bf16)
    cands: dict[str, Any] = {
        "bf16/full": lambda: moetier_run(bf16, "full", budget, a.tokens, a.threads),
        "mxfp4/full": lambda: moetier_run(mx, "full", budget, a.tokens, a.threads),
        "mxfp4/stored": lambda: moetier_run(mx, "auto", budget, a.tokens, a.threads),
    }
    gguf: Path | None = None
    if not a.no_llamacpp:
        try:
            gguf = gguf_file(cache, mx)
        except Exception as e:  # the converter or the build failed: said, and the moetier rows still run
            log(f"no GGUF file: {type(e).__name__}: {e}"[:2000])
    if gguf is not None:
        cands["gguf/auto"] = lambda: moetier_run(gguf, "auto", budget, a.tokens, a.threads)
        lc = get_llamacpp(cache, LLAMACPP_VERSION, skip_build=True)
        cmd = [str(lc.tool("llama-bench")), "-m", str(gguf), "-t", str(a.threads), "-r", "1", "-o", "json",
               "-p", "0", "-n", str(a.tokens)]  # fmt: skip
        cands["llamacpp"] = lambda: {"decode": float(next(r for r in llama_bench(cmd) if r["n_gen"] > 0)["avg_ts"])}
    runs: dict[str, list[float]] = {n: [] for n in cands}
    last: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for rnd in range(a.rounds + 1):  # round 0: warm-up, not counted
        for name, fn in cands.items():
            if name in errors:
                continue
            try:
                got = fn()
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"[:400]
                log(traceback.format_exc())
                continue
            log(f"round {rnd}: {name} {got['decode']:.1f} tok/s")
            if rnd > 0:
                runs[name].append(got["decode"])
                last[name] = got
    med = {n: statistics.median(v) for n, v in runs.items() if v}
    isa = cpu_isa()
    print(f"CPU: {isa['cpu']}; flags: {' '.join(isa['flags'])}; torch capability {isa['torch_capability']}")
    print(f"budget: {'all experts resident' if budget is None else f'{a.budget:.0%} of bf16 expert bytes'}; "
          f"{a.tokens} tokens, {a.rounds} rounds, {a.threads} threads")  # fmt: skip
    print("| candidate | decode tok/s (median) | runs | x bf16/full | x mxfp4/full | x llamacpp | held |")
    print("|---|---|---|---|---|---|---|")
    for n in cands:
        if n not in med:
            print(f"| {n} | failed: {errors.get(n, '?')} | | | | | |")
            continue

        def x(ref: str, n: str = n) -> str:
            return f"{med[n] / med[ref]:.2f}" if ref in med else "-"

        held = last[n].get("precision")
        print(f"| {n} | {med[n]:.1f} | {', '.join(f'{v:.1f}' for v in runs[n])} | {x('bf16/full')} | "
              f"{x('mxfp4/full')} | {x('llamacpp')} | {held or ''} |")  # fmt: skip
    print(json.dumps({"isa": isa, "config": CONFIG, "budget": a.budget, "tokens": a.tokens, "rounds": a.rounds,
                      "runs": runs, "median": med, "errors": errors, "last": last}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
