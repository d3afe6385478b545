"""Batched decoding: 8 sequences one after another vs together (BatchRunner, runtime/batch.py).

On the bundled model (models/tiny-shakespeare-moe), 8 prompts of `--prompt-len` tokens from the
held-out Shakespeare text each get `--tokens` new tokens (greedy, no early stop):

- serial: Engine.generate for each prompt in turn (the single-sequence path);
- batched: one BatchRunner(BatchConfig(max_batch=8)) with all 8 added at once (decode attention `loop`);
- batched_padded: the same with the padded-SDPA attention variant.

Tokens/s is all generated tokens over the whole wall time (prefills included). Repeats are
interleaved; medians reported. `--budget-frac` shrinks the host expert pool to that fraction of
all experts (misses then cost fetches, which a shared batch step pays once per expert).
Every candidate's tokens are checked equal to serial's. Prints a table, then one JSON line.

    python benchmarks/batch_decode.py [--tokens 64] [--repeats 3] [--dtype bf16] [--budget-frac 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import moetier
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
TEXT = ROOT / "data" / "shakespeare_heldout.txt"
N_SEQ = 8


def _engine(dtype: str, budget_frac: float | None) -> moetier.Engine:
    runtime = moetier.RuntimeConfig(device="cpu", dtype=dtype)  # type: ignore[arg-type]
    engine = moetier.load(MODEL, moetier.EngineConfig(runtime=runtime))
    if budget_frac is None:
        return engine
    slots = max(1, int(budget_frac * engine.info.num_experts * len(engine.info.moe_layers)))  # of all experts
    budget = slots * engine.store.slot_bytes + engine.store.staging_bytes
    engine.close()
    return moetier.load(MODEL, moetier.EngineConfig(budgets=moetier.Budgets(host_expert_bytes=budget), runtime=runtime))


def serial(engine: moetier.Engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = [engine.generate(p, n, stop_at_eos=False).token_ids for p in prompts]
    return time.perf_counter() - t0, out


def batched(engine: moetier.Engine, prompts: list[list[int]], n: int, attention: str) -> tuple[float, list[list[int]]]:
    runner = BatchRunner(engine, BatchConfig(max_batch=N_SEQ, attention=attention))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    ids = [runner.add(SeqRequest(p, n, stop_ids=frozenset())) for p in prompts]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while not runner.idle():
        for ev in runner.step():
            if ev.token is not None:
                got[ev.seq_id].append(ev.token)
    return time.perf_counter() - t0, [got[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--budget-frac", type=float, default=None)
    args = ap.parse_args()
    # 1. engine and 8 distinct prompts from the held-out text
    engine = _engine(args.dtype, args.budget_frac)
    text = TEXT.read_text(encoding="utf-8")
    prompts = [engine.encode(text[i * 1000 : i * 1000 + 8 * args.prompt_len])[: args.prompt_len] for i in range(N_SEQ)]
    serial(engine, prompts[:1], 4)  # warm-up
    # 2. interleaved repeats; every candidate's tokens must equal serial's
    runs: dict[str, list[float]] = {"serial": [], "batched": [], "batched_padded": []}
    hits: dict[str, int] = {}
    mismatches: dict[str, int] = {}
    for _ in range(args.repeats):
        for name in runs:
            before = engine.stats()
            if name == "serial":
                dt, toks = serial(engine, prompts, args.tokens)
                ref = toks
            else:
                dt, toks = batched(engine, prompts, args.tokens, "padded" if name.endswith("padded") else "loop")
            after = engine.stats()
            hits[name], misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
            hits[name + "_misses"] = misses
            mismatches[name] = sum(a != b for a, b in zip(toks, ref, strict=True))
            runs[name].append(N_SEQ * args.tokens / dt)
    med = {k: statistics.median(v) for k, v in runs.items()}
    # 3. report
    base = med["serial"]
    print(f"{'candidate':<16}{'tok/s':>10}{'x serial':>10}{'expert hits':>13}{'misses':>9}{'seq != serial':>15}   runs")
    for k, v in med.items():
        print(
            f"{k:<16}{v:>10.1f}{v / base:>10.2f}{hits[k]:>13}{hits[k + '_misses']:>9}{mismatches[k]:>15}   "
            + ", ".join(f"{x:.1f}" for x in runs[k])
        )
    print(json.dumps({
        "benchmark": "batch_decode", "model": MODEL.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "sequences": N_SEQ, "tokens": args.tokens, "prompt_len": args.prompt_len, "budget_frac": args.budget_frac,
        "tok_s": med, "ratio_batched": med["batched"] / base, "ratio_batched_padded": med["batched_padded"] / base,
        "runs": runs, "expert_accesses": hits, "mismatched_sequences": mismatches,
    }))  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
