"""The engine's own overheads, for the cost model: what a decode step costs beyond the bytes it reads.

The cost model prices weights (rooflines, expert LUTs); the engine also pays per-layer dispatch
(norms, attention ops, router, planning, the store's acquire/release, Python) and a fixed cost per
forward (embedding, LM-head call, sampling, the generate loop). A synthetic tiny layer undercounts
both, so they are measured on the engine itself:

1. build random bf16 Qwen3-MoE checkpoints (the lean decoder's family): depth 2 and 6 at top-4, and
   depth 6 at top-8, every expert resident (no budget);
2. decode `tokens` tokens with each, best of `rounds` runs -> seconds per token t(L, k);
3. per expert call: (t(6, 8) - t(6, 4)) / (6 * 4), minus the LUT's one-token expert -> `dispatch_s`;
4. one layer: (t(6, 4) - t(2, 4)) / 4, minus the priced dense roofline and top-4 expert calls (with
   dispatch) -> `layer_overhead_s`;
5. the intercept t(2, 4) - 2 * layer, minus the priced LM head -> `token_overhead_s`;
6. misses: depth 6, top-4 again with a host budget of a quarter of the experts; the extra time per
   miss over the resident run, minus the bytes at the page-cache bandwidth -> the disk link's
   `latency_s` (the engine's own cost of a miss: slicing, copying into a slot, bookkeeping).
All are clamped at 0. Invariants: temp checkpoints are removed; the engine runs with torch's current
thread count (measure() sets it).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moetier.config import Budgets, EngineConfig, RuntimeConfig, SamplingConfig
from moetier.policies.costmodel import CostModel, HardwareProfile
from moetier.runtime.wire import load
from moetier.specs import load_spec

LAYERS = (2, 6)  # depths; top-k 4 and 8
SHAPE = dict(
    hidden_size=256, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=512,
    norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _checkpoint(folder: Path, layers: int, top_k: int) -> Path:
    torch.manual_seed(layers)
    cfg = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **{**SHAPE, "num_experts_per_tok": top_k})
    out = folder / f"l{layers}k{top_k}"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _decode_s(path: Path, tokens: int, rounds: int, budget_frac: float | None = None) -> tuple[float, float]:
    """(best seconds per decoded token, compute-tier misses per decoded token) of the engine on `path`; every
    expert resident, or a host expert budget of `budget_frac` of the expert bytes."""
    rt = RuntimeConfig(device="cpu", dtype="bf16")
    budget = None
    if budget_frac is not None:
        with load(path, EngineConfig(runtime=rt)) as probe:
            budget = int(probe.info.total_expert_bytes * budget_frac) + probe.store.staging_bytes
    best, misses = float("inf"), 0.0
    sampling = SamplingConfig(temperature=1.0, seed=0)  # varied routing: greedy text of a random model loops
    with load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=rt)) as engine:
        engine.store.preload()
        prompt = list(range(3, 19))
        engine.generate(prompt, 4, stop_at_eos=False)  # warm the kernels
        for _ in range(rounds):
            before = engine.stats()["misses"]
            t0_prefill = engine.generate(prompt, 1, stop_at_eos=False)  # misses of the prefill alone
            m_prefill = t0_prefill.stats["misses"] - before
            res = engine.generate(prompt, tokens, sampling, stop_at_eos=False)
            dec_misses = (res.stats["misses"] - t0_prefill.stats["misses"] - m_prefill) / max(1, tokens - 1)
            if 1.0 / res.decode_tok_s < best:
                best, misses = 1.0 / res.decode_tok_s, dec_misses
    return best, misses


@dataclasses.dataclass(frozen=True)
class EngineOverheads:
    layer_overhead_s: float
    token_overhead_s: float
    dispatch_s: float
    miss_latency_s: float
    raw: dict[str, float]


def engine_overheads(profile: HardwareProfile, tokens: int = 48, rounds: int = 3) -> EngineOverheads:
    """This machine's CPU engine overheads; `profile`'s own overheads are ignored (the priced parts use its
    rooflines, LUTs and the disk link's bandwidth only)."""
    bare = dataclasses.replace(profile, cpu=dataclasses.replace(profile.cpu, layer_overhead_s=0.0,
                                                                token_overhead_s=0.0, dispatch_s=0.0))  # fmt: skip
    lo, hi = LAYERS
    with tempfile.TemporaryDirectory(prefix="moetier-profile-engine-") as tmp:
        # 1-2. decode time per token at two depths and two top-k
        runs = {(lo, 4): None, (hi, 4): None, (hi, 8): None}
        paths = {key: _checkpoint(Path(tmp), *key) for key in runs}
        t = {key: _decode_s(p, tokens, rounds)[0] for key, p in paths.items()}
        t_miss, misses = _decode_s(paths[(hi, 4)], tokens, rounds, budget_frac=0.25)
        spec = load_spec(str(paths[(lo, 4)]))
    cm = CostModel(bare, spec)
    # 3. per expert call
    per_expert = (t[(hi, 8)] - t[(hi, 4)]) / (hi * 4)
    dispatch = max(0.0, per_expert - cm.expert_s("cpu", 1))
    # 4. one layer, minus the priced dense part and top-4 expert calls with their dispatch
    layer = (t[(hi, 4)] - t[(lo, 4)]) / (hi - lo)
    context = 16 + tokens // 2  # the mean KV length while decoding
    priced_layer = cm.dense_s("cpu", 1, context) + spec.top_k * (cm.expert_s("cpu", 1) + dispatch)
    layer_overhead = max(0.0, layer - priced_layer)
    # 5. the rest of a token: intercept minus the priced head
    token_overhead = max(0.0, t[(lo, 4)] - lo * layer - cm.head_s("cpu", 1))
    # 6. one miss, beyond its bytes at the link's bandwidth
    per_miss = (t_miss - t[(hi, 4)]) / misses if misses > 0.5 else 0.0
    miss_latency = max(0.0, per_miss - cm.expert_nbytes / bare.disk.bandwidth)
    raw = {f"decode_s_{n}_layers_top{k}": v for (n, k), v in t.items()} | {
        "decode_s_budget_quarter": t_miss, "misses_per_token": misses, "layer_s": layer,
        "priced_layer_s": priced_layer, "per_expert_s": per_expert, "per_miss_s": per_miss,
    }  # fmt: skip
    return EngineOverheads(layer_overhead, token_overhead, dispatch, miss_latency, raw)
