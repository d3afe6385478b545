"""GGUF input: moetier's logits on a GGUF file against llama.cpp's on the same file (not a timing).

Steps (each skipped when its output exists under `--cache-dir`, default `.bench/`):
1. llama.cpp as benchmarks/vs_llamacpp.py builds it (`llama-perplexity`, `llama-quantize`, the vendored
   `convert_hf_to_gguf.py`, with its one-line pre-tokenizer patch for the bundled tokenizer).
2. A tiny random qwen3_moe checkpoint (`moetier.models.tiny`, fp32; hidden and expert sizes 256 so
   K-quants apply; the bundled tokenizer, vocab 4096), converted to an F32 GGUF by llama.cpp's converter,
   then `llama-quantize` to each of `--types` (default Q8_0, Q4_K_M).
3. Per GGUF: `llama-perplexity --kl-divergence-base` dumps llama.cpp's log-probabilities (uint16 over the
   top 16 nats of each row, so a resolution of 16/65535 = 2.4e-4 nats) for the second half of each
   `--ctx`-token chunk of a text; moetier (fp32, full precision experts) runs the same token ids (the
   chunk's first token replaced by BOS when the vocabulary adds one, as llama-perplexity does) and
   its log-softmax is compared on the entries llama.cpp kept.

With `--archs deepseek_v2,deepseek_v3,gpt_oss,...` (transformers model types), step 2 is instead, per family: a
tiny random checkpoint from `moetier.models.tiny.tiny_config` (vocabulary 4096, the bundled tokenizer; ARCH_CONFIG
adds the config fields the family's published checkpoints carry and the converter reads), converted by llama.cpp's
converter with every family's own vocabulary code replaced by its plain GPT-2 BPE one (the tiny checkpoints carry
the bundled byte-level BPE tokenizer whatever their family), then quantised to `--types`. Each file is also
compared with transformers on the source checkpoint (`max_abs_vs_transformers`, fp32 logits), so a mismatch says
which side departs.

Reported per file: max |log p_moetier - log p_llama.cpp|, mean KL(llama.cpp || moetier), top-1 agreement.
llama.cpp's CPU matmuls quantise activations to 8 bits for quantised weights (and keep F32 otherwise),
so only the F32 file is expected at the log-prob resolution; quantised files differ by activation
quantisation.

    python benchmarks/gguf_vs_llamacpp.py [--types Q8_0,Q4_K_M] [--ctx 128] [--chunks 2] [--threads 2]
    python benchmarks/gguf_vs_llamacpp.py --archs deepseek_v2,deepseek_v3,gpt_oss --types Q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.formats.gguf import read_gguf
from moetier.models.tiny import build_tiny_checkpoint, tiny_config
from vs_llamacpp import (
    LLAMACPP_VERSION,
    TOKENIZER_FILES,
    TOKENIZER_SRC,
    get_llamacpp,
    patch_pretokenizer,
    run,
)

REPO = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
            vocab_size=4096, initializer_range=0.05, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip


def make_ggufs(cache: Path, types: list[str]) -> dict[str, Path]:
    lc = get_llamacpp(cache, LLAMACPP_VERSION, skip_build=False)
    out = cache / "llamacpp" / "gguf_tiny"
    src = out / "src"
    if not (src / "model.safetensors").exists():
        build_tiny_checkpoint("qwen3_moe", src, seed=1, **TINY)
        for name in TOKENIZER_FILES:
            shutil.copy2(TOKENIZER_SRC / name, src / name)
    patch_pretokenizer(lc.tree, src)
    files = {"F32": out / "tiny-F32.gguf", **{t: out / f"tiny-{t}.gguf" for t in types}}
    return convert_and_quantize(lc, [str(lc.tree / "convert_hf_to_gguf.py")], src, files)


def convert_and_quantize(lc: Any, converter: list[str], src: Path, files: dict[str, Path]) -> dict[str, Path]:
    """files["F32"] from checkpoint `src` by llama.cpp's converter (`converter`: the arguments after python), then
    each other type of `files` from it by llama-quantize; a file that exists is kept."""
    if not files["F32"].exists():
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        run([sys.executable, *converter, str(src), "--outtype", "f32", "--outfile", str(files["F32"])], env=env)
    for t, path in files.items():
        if t != "F32" and not path.exists():
            run([str(lc.tool("llama-quantize")), "--allow-requantize", str(files["F32"]), str(path), t, "2"])
    return files


# config fields the family's published checkpoints carry and llama.cpp's converter reads (absent from a config built
# from transformers' defaults): DeepSeek-V3's sigmoid router, DeepSeek-V2-Lite's uncompressed q (llama.cpp knows a
# Lite model by its 27 layers, and wants q_lora_rank otherwise)
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "dots1": {"scoring_func": "sigmoid", "num_key_value_heads": 4},  # dots.llm1 is MHA; llama.cpp assumes so
    "granitemoeshared": {"shared_intermediate_size": 24},  # (its default 0 is no shared MLP: plain granitemoe)
    # Llama-4's layout as llama.cpp hard-codes it (and transformers defaults it): MoE every other layer here, chunks
    # of 8192, temperature floor 8192, RoPE-less full attention every fourth layer
    "llama4_text": {"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "moe_layers": None,
                    "no_rope_layers": None, "attention_chunk_size": 8192, "floor_scale": 8192, "layer_types": None},
    # ERNIE-4.5-21B-A3B's proportions: the converter derives the shared expert's width from intermediate_size
    "ernie4_5_moe": {"intermediate_size": 64, "moe_num_shared_experts": 2, "num_hidden_layers": 3},
    # Hunyuan-A13B's config carries these as per-layer lists, which the converter reads
    "hunyuan_v1_moe": {"moe_intermediate_size": [48, 48], "moe_topk": [2, 2], "num_shared_expert": [1, 1]},
    "deepseek_v2": {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                    "num_hidden_layers": 27},
    # Qwen3-Next-80B-A3B's layout: MoE on every layer (llama.cpp's converter maps no dense one), linear attention on
    # three layers of four; its MTP layer (mtp.*, which the converter requires) is added by _add_qwen3next_mtp
    "qwen3_next": {"mlp_only_layers": [], "num_hidden_layers": 4, "layer_types": None},
    # Sarvam-MoE / Ling 2.0 (llama.cpp's bailingmoe2): one expert group (the converter writes no group count, so
    # llama.cpp would not limit the top-k to groups); its config.json in the published form: `_sarvam_published`
    "sarvam_moe": {"n_group": 1, "topk_group": 1},
}
# run llama.cpp's converter with every model class's own vocabulary code replaced by the plain GPT-2 BPE one
CONVERT = """
import importlib, pkgutil, runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion, conversion.base as base
for m in pkgutil.iter_modules(conversion.__path__):
    try:
        importlib.import_module("conversion." + m.name)
    except Exception:
        pass
def walk(c):
    for s in c.__subclasses__():
        yield s
        yield from walk(s)
for cls in [base.TextModel, *walk(base.TextModel)]:
    if "set_vocab" in cls.__dict__:
        cls.set_vocab = base.TextModel._set_vocab_gpt2
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _add_qwen3next_mtp(src: Path, cfg: Any) -> None:
    """Qwen3-Next's published checkpoints carry an MTP layer (mtp.fc, mtp.pre_fc_norm_*, mtp.norm and mtp.layers.0.*,
    a full-attention MoE decoder layer), which transformers neither builds nor saves but llama.cpp's converter needs
    (it counts the MTP layers from them): random ones, shaped as the last full-attention layer."""
    from safetensors.torch import load_file, save_file

    sd = load_file(src / "model.safetensors")
    last = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    g, h = torch.Generator().manual_seed(1), cfg.hidden_size
    for k, v in list(sd.items()):
        if k.startswith(f"model.layers.{last}."):
            sd[k.replace(f"model.layers.{last}.", "mtp.layers.0.")] = torch.randn(v.shape, generator=g) * 0.05
    sd["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = torch.randn(h, generator=g) * 0.05
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})


def _sarvam_published(src: Path) -> Path:
    """A copy of a tiny sarvam_moe checkpoint with its config.json in the form the published Sarvam-MoE checkpoints
    hold (remote code: a model type transformers does not know, so llama.cpp's converter reads the file's own keys
    rather than AutoConfig's renamed ones), as SarvamMoEModel over BailingMoeV2Model reads it: the architecture name
    and the Bailing keys of the expert counts and the router's scoring. The weights already carry the Bailing names.
    -> the copy's folder."""
    out = src.parent / "published"
    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg |= {"architectures": ["SarvamMoEForCausalLM"], "model_type": "sarvam_moe_remote",
            "num_experts": cfg["n_routed_experts"], "num_shared_experts": cfg["n_shared_experts"],
            "score_function": "sigmoid"}  # fmt: skip  # transformers' sarvam_moe routes as DeepSeek-V3: sigmoid
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_arch_ggufs(cache: Path, model_type: str, types: list[str]) -> dict[str, Path]:
    """F32 and `types` GGUFs of a tiny random `model_type` checkpoint, by llama.cpp's own converter and quantiser."""
    from transformers import AutoModelForCausalLM

    lc = get_llamacpp(cache, LLAMACPP_VERSION, skip_build=False)
    out = cache / "llamacpp" / "gguf_archs" / model_type
    src = out / "src"
    if not (src / "model.safetensors").exists():
        cfg = tiny_config(model_type, vocab_size=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                          **ARCH_CONFIG.get(model_type, {}))  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for prm in model.parameters():  # matrices N(0, 0.05); norms and biases near 1 and small
                prm.normal_(0, 0.05) if prm.dim() > 1 else prm.uniform_(0.5, 1.5)
        model.save_pretrained(src)
        if model_type == "qwen3_next":
            _add_qwen3next_mtp(src, cfg)
        for name in TOKENIZER_FILES:
            shutil.copy2(TOKENIZER_SRC / name, src / name)
    conv = _sarvam_published(src) if model_type == "sarvam_moe" else src  # what llama.cpp's converter reads
    patch_pretokenizer(lc.tree, conv)
    files = {"F32": out / "F32.gguf", **{t: out / f"{t}.gguf" for t in types}}
    return convert_and_quantize(lc, ["-c", CONVERT, str(lc.tree)], conv, files)


def vs_transformers(gguf: Path, src: Path) -> float:
    """max |logits| difference, moetier on the GGUF file against transformers on the checkpoint it came from (fp32)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(1, 4000, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids).logits[0]
    engine = moetier.load(gguf, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", lean=False)))
    try:
        return float((engine.logits(ids)[0] - want).abs().max())
    finally:
        engine.close()


def llama_logprobs(cache: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict[str, Any]:
    """Run llama-perplexity --kl-divergence-base; parse its file: tokens and per-row log-prob data."""
    lc = get_llamacpp(cache, LLAMACPP_VERSION, skip_build=True)
    dump = gguf.with_suffix(".kld")
    run([str(lc.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
         "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base", str(dump)])  # fmt: skip
    return read_logits_dump(dump)


def read_logits_dump(dump: Path) -> dict[str, Any]:
    """A llama-perplexity `--kl-divergence-base` file: {"tokens": [chunks, n_ctx] int32, "data": [chunks, rows, nv]
    uint16 (per row: float32 scale and minimum log-probability, then the 16-bit codes), "first": the first scored
    position of each chunk (n_ctx / 2), "n_vocab"}."""
    raw = dump.read_bytes()
    if raw[:8] != b"_logits_":
        raise RuntimeError(f"{dump}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", raw, 8)
    at = 20
    tokens = np.frombuffer(raw, dtype="<i4", count=n_chunk * n_ctx, offset=at).reshape(n_chunk, n_ctx)
    at += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    rows = n_ctx - 1 - first
    data = np.frombuffer(raw, dtype="<u2", count=n_chunk * rows * nv, offset=at).reshape(n_chunk, rows, nv)
    return {"tokens": tokens, "data": data, "first": first, "n_vocab": n_vocab}


def compare(gguf: Path, ref: dict[str, Any], add_bos: bool, bos: int) -> dict[str, Any]:
    engine = moetier.load(gguf, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32", lean=False)))
    worst, kls, agree, n = 0.0, [], 0, 0
    try:
        for c, toks in enumerate(ref["tokens"]):
            ids = torch.tensor(toks.astype(np.int64))[None]
            if add_bos:
                ids[0, 0] = bos
            ours = torch.log_softmax(engine.logits(ids)[0].double(), -1).numpy()  # [T, V]
            first = ref["first"]
            for r, row in enumerate(ref["data"][c]):
                head = row[:4].copy().view(np.float32)  # scale, min log-prob
                q = row[4 : 4 + ref["n_vocab"]].astype(np.float64)
                theirs = head[1] + head[0] * q
                mine = ours[first + r]
                kept = q > 0
                worst = max(worst, float(np.abs(mine[kept] - theirs[kept]).max()))
                p = np.exp(theirs) * kept
                kls.append(float((p * (theirs - mine)).sum()))
                agree += int(np.argmax(mine) == np.argmax(theirs))
                n += 1
    finally:
        engine.close()
    return {"max_abs_logprob": worst, "mean_kl": float(np.mean(kls)), "top1_agree": agree / n, "rows": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".bench")
    ap.add_argument("--types", default="Q8_0,Q4_K_M")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--archs", default="", help="transformers model types to check instead of the qwen3_moe model")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    if args.archs:
        files = {f"{mt}/{t}": p for mt in args.archs.split(",")
                 for t, p in make_arch_ggufs(args.cache_dir, mt, types).items()}  # fmt: skip
    else:
        files = make_ggufs(args.cache_dir, types)
    text = args.cache_dir / "llamacpp" / "gguf_tiny" / "text.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text((REPO / "README.md").read_text())  # tokenizes to far more than ctx * chunks tokens
    rows = {}
    for name, path in files.items():
        meta = read_gguf(path).metadata
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        bos = int(meta.get("tokenizer.ggml.bos_token_id", 0))
        ref = llama_logprobs(args.cache_dir, path, text, args.ctx, args.chunks, args.threads)
        kinds = sorted({t.type_name for t in read_gguf(path).tensors.values()})
        rows[name] = {**compare(path, ref, add_bos, bos), "tensor_types": kinds}
        if args.archs:
            rows[name]["max_abs_vs_transformers"] = vs_transformers(path, path.parent / "src")
    print(f"{'file':24} {'max|dlogp|':>11} {'mean KL':>10} {'top-1':>6} {'vs tf':>9}  tensor types")
    for name, r in rows.items():
        tf = r.get("max_abs_vs_transformers")
        print(f"{name:24} {r['max_abs_logprob']:11.2e} {r['mean_kl']:10.2e} {r['top1_agree']:6.3f} "
              f"{'-' if tf is None else f'{tf:.2e}':>9}  {','.join(r['tensor_types'])}")  # fmt: skip
    print(json.dumps({"benchmark": "gguf_vs_llamacpp", "ctx": args.ctx, "chunks": args.chunks, "results": rows}))


if __name__ == "__main__":
    main()
