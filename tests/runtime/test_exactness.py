"""Exactness: the engine's logits equal transformers' for every family, at every budget.

Budgets: everything resident, half the experts, one slot per MoE layer, one slot in all.
Both decoder choices (lean=False: transformers modules; lean=True: the engine's own
decoder where the family supports it, else the automatic fallback) must be exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.models.families import FAMILIES
from moetier.models.tiny import TINY
from moetier.runtime.decode_hf import HFDecoder
from moetier.runtime.lean import LeanDecoder
from moetier.runtime.observers import Tap

ATOL = 1e-4
FAMILY_NAMES = tuple(TINY)
BUDGETS = ("all", "half", "per_layer", "one")
NEW_TOKENS = 8


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))  # [1, T]


PROMPT_A = _prompt(1, 16)
PROMPT_B = _prompt(2, 11)
PROMPT_GEN = _prompt(3, 7)  # 7 + 8 new tokens > gpt_oss's sliding window of 8


def runtime(lean: bool) -> RuntimeConfig:
    return RuntimeConfig(device="cpu", dtype="fp32", lean=lean)


def load(path, budget: int | None, lean: bool) -> moetier.Engine:
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime(lean)))


@pytest.fixture(scope="module")
def geometry(tiny_ckpt):
    """family -> (n_moe_layers, total_experts, slot_bytes, staging_bytes), from an all-resident engine."""
    cache: dict[tuple[str, str], tuple[int, int, int, int]] = {}

    def get(family: str, variant: str = "fp32") -> tuple[int, int, int, int]:
        if (family, variant) not in cache:
            engine = load(tiny_ckpt(family, variant), None, lean=False)
            n_moe = len(engine.info.moe_layers)
            cache[(family, variant)] = (
                n_moe,
                n_moe * engine.info.num_experts,
                engine.store.slot_bytes,
                engine.store.staging_bytes,
            )
            engine.close()
        return cache[(family, variant)]

    return get


def budget_of(kind: str, geometry: tuple[int, int, int, int]) -> tuple[int | None, int]:
    """-> (host budget in bytes, the number of slots it must give)."""
    n_moe, total, slot, staging = geometry
    slots = {"all": total, "half": total // 2, "per_layer": n_moe, "one": 1}[kind]
    return (None if kind == "all" else slots * slot + staging), slots


@pytest.fixture(scope="module")
def ref_logits(hf_model):
    cache: dict[tuple[str, str, int], torch.Tensor] = {}

    def get(family: str, ids: torch.Tensor, variant: str = "fp32") -> torch.Tensor:
        key = (family, variant, hash(tuple(ids[0].tolist())))
        if key not in cache:
            with torch.no_grad():
                cache[key] = hf_model(family, variant)(ids).logits  # [1, T, V]
        return cache[key]

    return get


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# -- full-sequence logits ----------------------------------------------------------------------


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_transformers(tiny_ckpt, geometry, ref_logits, family, budget, lean):
    nbytes, slots = budget_of(budget, geometry(family))
    engine = load(tiny_ckpt(family), nbytes, lean)
    store = engine.store
    assert store.host.pool.n_slots == slots
    for ids in (PROMPT_A, PROMPT_B, PROMPT_A):  # the repeat runs against a warm, partly evicted cache
        out = engine.logits(ids)
        assert out.shape == (1, ids.shape[1], 96)
        assert max_diff(out, ref_logits(family, ids)) <= ATOL
    stats = engine.stats()
    if nbytes is not None:
        assert stats["peak_host_expert_bytes"] + stats["staging_bytes"] <= nbytes
    if budget in ("per_layer", "one"):  # routing is diverse (see below): these budgets must evict
        assert store.host.evictions > 0
    assert stats["misses"] >= len(engine.info.moe_layers) * 2
    engine.close()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tiny_models_route_diversely(tiny_ckpt, family):
    """More than top_k distinct experts per MoE layer over one prompt, or the budget tests have no teeth."""
    engine = load(tiny_ckpt(family), None, lean=False)
    used: dict[int, set[int]] = {}

    def hook(route):
        used.setdefault(route.layer, set()).update(route.ids.flatten().tolist())

    engine.observers.add(Tap(hook))
    engine.logits(PROMPT_A)
    assert set(used) == set(engine.info.moe_layers)
    for layer, experts in used.items():
        assert len(experts) > engine.info.top_k, f"layer {layer} used only {sorted(experts)}"
    engine.close()


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_decoder_choice_and_fallback(tiny_ckpt, family, lean):
    """lean=False always uses the transformers modules; lean=True uses the lean decoder for llama-style
    families and falls back to the transformers modules for the others."""
    engine = load(tiny_ckpt(family), None, lean)
    row = next(f for f in FAMILIES if f.name == family)
    if not lean or row.lean_attention is None:
        assert isinstance(engine.decoder, HFDecoder)
    else:  # the tiny llama-style configs are plain full attention: the lean decoder must take them,
        # or the lean=True cases above silently test the fallback twice
        assert isinstance(engine.decoder, LeanDecoder)
    assert engine.stats()["decoder"] == type(engine.decoder).__name__
    engine.close()


# -- KV-cached greedy decode -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """family -> (new token ids, per-step reference logits [NEW_TOKENS, V]) for PROMPT_GEN."""
    cache: dict[str, tuple[list[int], torch.Tensor]] = {}

    def get(family: str) -> tuple[list[int], torch.Tensor]:
        if family not in cache:
            model = hf_model(family)
            gc = copy.deepcopy(model.generation_config)
            gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
            gc.max_new_tokens = gc.min_new_tokens = NEW_TOKENS
            with torch.no_grad():
                out = model.generate(PROMPT_GEN, attention_mask=torch.ones_like(PROMPT_GEN), generation_config=gc)
                new = out[0, PROMPT_GEN.shape[1] :].tolist()
                assert len(new) == NEW_TOKENS
                # the logits that predicted each new token, from one uncached forward pass
                logits = model(out[:, :-1]).logits[0, PROMPT_GEN.shape[1] - 1 :]  # [NEW_TOKENS, V]
            assert logits.argmax(-1).tolist() == new
            cache[family] = (new, logits)
        return cache[family]

    return get


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("budget", ["all", "one"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_decode_matches_transformers(tiny_ckpt, geometry, hf_greedy, family, budget, lean):
    new, ref_steps = hf_greedy(family)
    nbytes, _ = budget_of(budget, geometry(family))
    engine = load(tiny_ckpt(family), nbytes, lean)
    result = engine.generate(PROMPT_GEN[0].tolist(), max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert result.token_ids == new
    assert result.prompt_tokens == PROMPT_GEN.shape[1]
    # step by step through the KV cache: prefill, then one token at a time
    with torch.inference_mode():
        engine.decoder.reset()
        steps = [engine.decoder.forward(PROMPT_GEN)[-1]]
        for tok in new[:-1]:
            steps.append(engine.decoder.forward(torch.tensor([[tok]]))[-1])
    assert max_diff(torch.stack(steps), ref_steps) <= ATOL
    # a fresh generate after the manual steps starts over (reset) and gives the same tokens
    again = engine.generate(PROMPT_GEN[0].tolist(), max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert again.token_ids == new
    engine.close()


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_chunked_prefill(tiny_ckpt, geometry, ref_logits, family, lean):
    """Prefill in chunks through the cache (6 tokens, 1 token, then 9 at once) equals one full pass."""
    nbytes, _ = budget_of("per_layer", geometry(family))
    engine = load(tiny_ckpt(family), nbytes, lean)
    with torch.inference_mode():
        engine.decoder.reset()
        parts = [engine.decoder.forward(PROMPT_A[:, a:b], all_logits=True) for a, b in ((0, 6), (6, 7), (7, 16))]
    assert max_diff(torch.cat(parts)[None], ref_logits(family, PROMPT_A)) <= ATOL
    engine.close()


# -- other checkpoint variants -----------------------------------------------------------------


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
@pytest.mark.parametrize("budget", ["all", "one"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_checkpoint_in_fp32_engine(tiny_ckpt, geometry, ref_logits, family, budget, lean):
    """A bf16 checkpoint read into an fp32 engine equals transformers loading the same folder in fp32."""
    nbytes, _ = budget_of(budget, geometry(family, "bf16"))
    engine = load(tiny_ckpt(family, "bf16"), nbytes, lean)
    assert engine.dtype == torch.float32
    assert engine.info.checkpoint_dtype == "BF16"
    for ids in (PROMPT_A, PROMPT_B):
        assert max_diff(engine.logits(ids), ref_logits(family, ids, "bf16")) <= ATOL
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_tied_embeddings(tiny_ckpt, geometry, ref_logits, family):
    nbytes, _ = budget_of("one", geometry(family, "tied"))
    engine = load(tiny_ckpt(family, "tied"), nbytes, lean=True)
    assert max_diff(engine.logits(PROMPT_A), ref_logits(family, PROMPT_A, "tied")) <= ATOL
    engine.close()


@pytest.mark.parametrize(("family", "overrides"), [
    ("qwen3_moe", dict(mlp_only_layers=[0], num_hidden_layers=3)),  # a dense layer before the MoE ones
    ("qwen2_moe", dict(decoder_sparse_step=2, num_hidden_layers=4)),  # MoE every other layer
    ("mixtral", dict(num_experts_per_tok=1)),
    ("olmoe", dict(num_experts_per_tok=6)),  # every expert active
    ("deepseek_v2", dict(topk_method="greedy", n_group=1, topk_group=1)),
    ("deepseek_v3", dict(first_k_dense_replace=0, num_hidden_layers=2)),
    ("gpt_oss", dict(num_experts_per_tok=4)),
])  # fmt: skip
def test_config_variants(tmp_path, family, overrides):
    from transformers import AutoModelForCausalLM

    from moetier.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(family, tmp_path / family, seed=7, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(PROMPT_A).logits
    probe = load(path, None, lean=True)
    n_layers = int(probe.loaded.config.num_hidden_layers)
    budget = probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    engine = load(path, budget, lean=True)
    if "mlp_only_layers" in overrides or "decoder_sparse_step" in overrides:
        assert len(engine.info.moe_layers) < n_layers
    assert max_diff(engine.logits(PROMPT_A), expected) <= ATOL
    engine.close()
