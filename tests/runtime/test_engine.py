"""Engine API around the exact core: model info, dtypes, perplexity, sampling, EOS, bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig, SamplingConfig
from moetier.errors import ConfigError
from moetier.runtime.engine import sample

FP32 = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
IDS = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(9))


def engine_for(path, runtime: RuntimeConfig = FP32, budget: int | None = None) -> moetier.Engine:
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime))


@pytest.mark.parametrize(("family", "moe_layers", "experts", "inter", "expert_bytes"), [
    ("qwen3_moe", (0, 1), 6, 16, 3 * 16 * 32 * 4),
    ("mixtral", (0, 1), 6, 48, 3 * 48 * 32 * 4),
    ("deepseek_v2", (1, 2), 8, 16, 3 * 16 * 32 * 4),  # first_k_dense_replace=1: layer 0 is dense
    ("gpt_oss", (0, 1), 6, 16, (3 * 16 * 32 + 2 * 16 + 32) * 4),
])  # fmt: skip
def test_model_info(tiny_ckpt, family, moe_layers, experts, inter, expert_bytes):
    path = tiny_ckpt(family)
    engine = engine_for(path)
    info = engine.info
    assert (info.family, info.moe_layers, info.num_experts, info.top_k) == (family, moe_layers, experts, 2)
    assert (info.hidden_size, info.expert_intermediate, info.checkpoint_dtype) == (32, inter, "F32")
    assert info.expert_bytes == expert_bytes
    assert info.total_expert_bytes == expert_bytes * experts * len(moe_layers)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        all_bytes = sum(f.get_tensor(n).numel() * 4 for n in f.keys())  # noqa: SIM118
    assert info.non_expert_bytes == all_bytes - info.total_expert_bytes
    assert engine.info.as_dict()["family"] == family
    engine.close()


def test_auto_dtype_follows_checkpoint(tiny_ckpt):
    auto = RuntimeConfig(device="cpu", dtype="auto", lean=False)
    e32 = engine_for(tiny_ckpt("qwen3_moe"), auto)
    e16 = engine_for(tiny_ckpt("qwen3_moe", "bf16"), auto)
    assert e32.dtype == torch.float32 and e16.dtype == torch.bfloat16
    assert e16.store.slot_bytes * 2 == e32.store.slot_bytes
    assert e16.logits(IDS).dtype == torch.bfloat16
    assert e16.stats()["dtype"] == "bfloat16"
    e32.close()
    e16.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_perplexity_equals_reference(tiny_ckpt, hf_model, family):
    engine = engine_for(tiny_ckpt(family))
    ids = IDS[0].tolist()
    with torch.no_grad():
        logits = hf_model(family)(IDS).logits[0]  # [T, V]
    nll = F.cross_entropy(logits[:-1], IDS[0, 1:]).item()
    result = engine.perplexity(ids)
    assert result.tokens == len(ids) - 1
    assert result.nll == pytest.approx(nll, abs=1e-5)
    # non-overlapping windows of 6 predicted tokens, each scored from a fresh context
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, 6):
        chunk = IDS[:, start : start + 7]
        if chunk.shape[1] < 2:
            break
        with torch.no_grad():
            lg = hf_model(family)(chunk[:, :-1]).logits[0]
        total += F.cross_entropy(lg, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    windowed = engine.perplexity(ids, window=6)
    assert windowed.tokens == count
    assert windowed.nll == pytest.approx(total / count, abs=1e-5)
    engine.close()


def test_generation_stops_at_eos(tiny_ckpt):
    engine = engine_for(tiny_ckpt("mixtral"))
    prompt = IDS[0, :6].tolist()
    full = engine.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids
    eos = full[3]
    engine.loaded.config.eos_token_id = eos
    stopped = engine.generate(prompt, max_new_tokens=8).token_ids
    assert stopped == full[: full.index(eos) + 1]
    assert engine.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids == full
    engine.close()


def test_generation_streams_and_reports(tiny_ckpt):
    engine = engine_for(tiny_ckpt("olmoe"))
    seen: list[int] = []
    result = engine.generate(IDS[0, :5].tolist(), max_new_tokens=4, on_token=lambda t, s: seen.append(t),
                             stop_at_eos=False)  # fmt: skip
    assert seen == result.token_ids and len(seen) == 4
    assert result.prompt_tokens == 5
    assert result.stats["misses"] > 0 and result.stats["hits"] > 0  # everything resident: decode re-uses experts
    engine.close()


def test_seeded_sampling_is_reproducible(tiny_ckpt):
    engine = engine_for(tiny_ckpt("qwen3_moe"))
    prompt = IDS[0, :5].tolist()
    cfg = SamplingConfig(temperature=1.5, seed=123)
    a = engine.generate(prompt, max_new_tokens=10, sampling=cfg, stop_at_eos=False).token_ids
    b = engine.generate(prompt, max_new_tokens=10, sampling=cfg, stop_at_eos=False).token_ids
    assert a == b
    greedy = engine.generate(prompt, max_new_tokens=10, stop_at_eos=False).token_ids
    nucleus = engine.generate(prompt, max_new_tokens=10, sampling=SamplingConfig(temperature=1.0, top_p=1e-6, seed=1),
                              stop_at_eos=False).token_ids  # fmt: skip
    assert nucleus == greedy  # top_p that keeps only the top token is greedy
    engine.close()


def test_sample_function():
    logits = torch.tensor([0.0, 3.0, 1.0, -2.0])
    assert sample(logits, SamplingConfig(), None) == 1
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingConfig(temperature=1.0, top_p=0.9), gen) for _ in range(200)}
    assert draws <= {1, 2} and 1 in draws  # token 3 (p ~ 0.004) and 0 are outside the nucleus


def test_bad_arguments(tiny_ckpt):
    engine = engine_for(tiny_ckpt("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"\[20\]"):
        engine.logits(IDS[0])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.generate([5, 6], max_new_tokens=0)
    with pytest.raises(ConfigError, match="empty"):
        engine.generate([], max_new_tokens=2)
    with pytest.raises(ConfigError, match="at least 2"):
        engine.perplexity([7])
    engine.close()


def test_bad_configs():
    with pytest.raises(ConfigError, match="-1"):
        Budgets(host_expert_bytes=-1)
    with pytest.raises(ConfigError, match="dtype"):
        RuntimeConfig(dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=-0.1)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0.0)
    assert moetier.parse_size("512MiB") == 512 * 1024**2
    assert moetier.parse_size("1.5GB") == 1_500_000_000
    assert moetier.parse_size(4096) == 4096
    with pytest.raises(ConfigError, match="'12 parsecs'"):
        moetier.parse_size("12 parsecs")


def test_unknown_cache_policy(tiny_ckpt):
    with pytest.raises(ConfigError, match="'belady'"):
        moetier.load(tiny_ckpt("qwen3_moe"), EngineConfig(cache=moetier.CacheConfig(policy="belady"), runtime=FP32))


def test_stats_account_for_the_budget(tiny_ckpt):
    probe = engine_for(tiny_ckpt("deepseek_v3"))
    slot, staging = probe.store.slot_bytes, probe.store.staging_bytes
    probe.close()
    budget = 3 * slot + staging + 17
    engine = engine_for(tiny_ckpt("deepseek_v3"), budget=budget)
    engine.logits(IDS)
    engine.generate(IDS[0, :4].tolist(), max_new_tokens=5, stop_at_eos=False)
    s = engine.stats()
    host = s["tiers"]["host"]
    assert host["slots"] == 3 and host["budget_bytes"] == budget
    assert s["peak_host_expert_bytes"] == 3 * slot <= budget - staging
    assert s["disk_bytes"] == s["misses"] * engine.info.expert_bytes  # every miss reads one expert, nothing more
    assert host["evictions"] == s["misses"] - 3
    assert s["decoder"] == "HFDecoder" and s["device"] == "cpu"
    engine.close()


def test_eos_from_generation_config(ckpt_copy, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    path = ckpt_copy("mixtral")
    prompt = IDS[0, :6].tolist()
    engine = engine_for(path)
    full = engine.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids
    engine.close()
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [2, full[3]]
    gen_file.write_text(json.dumps(gen))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, 6:].tolist()
    assert hf == full[: full.index(full[3]) + 1]  # transformers stops at the generation_config eos
    engine = engine_for(path)
    assert engine.generate(prompt, max_new_tokens=8).token_ids == hf
    engine.close()


def test_lean_kv_cache_length_is_enforced(tiny_ckpt):
    runtime = RuntimeConfig(device="cpu", dtype="fp32", lean=True, max_seq_len=12)
    engine = engine_for(tiny_ckpt("qwen3_moe"), runtime)
    if type(engine.decoder).__name__ != "LeanDecoder":
        pytest.skip("qwen3_moe is not served by the lean decoder")
    assert engine.logits(IDS[:, :12]).shape == (1, 12, 96)
    with pytest.raises(ConfigError, match="13") as err:
        engine.logits(IDS[:, :13])
    assert "12" in str(err.value)
    engine.generate(IDS[0, :8].tolist(), max_new_tokens=5, stop_at_eos=False)  # 8 + 4 fed = 12: fits
    with pytest.raises(ConfigError, match="max_seq_len"):
        engine.generate(IDS[0, :8].tolist(), max_new_tokens=6, stop_at_eos=False)
    engine.close()


def test_generate_refuses_up_front_what_the_kv_cache_cannot_hold(tiny_ckpt):
    runtime = RuntimeConfig(device="cpu", dtype="fp32", lean=True, max_seq_len=12)
    engine = engine_for(tiny_ckpt("qwen3_moe"), runtime)
    streamed: list[int] = []
    with pytest.raises(ConfigError, match=r"8 tokens \+ 6 new tokens exceeds the KV cache of 12"):
        engine.generate(IDS[0, :8].tolist(), max_new_tokens=6, on_token=lambda t, s: streamed.append(t))
    assert streamed == []  # refused before any token was produced
    engine.close()


def test_max_seq_len_beyond_the_model_limit_is_refused(tiny_ckpt):
    runtime = RuntimeConfig(device="cpu", dtype="fp32", lean=True, max_seq_len=10**9)
    with pytest.raises(ConfigError, match="1000000000 exceeds the model's max_position_embeddings of 256"):
        engine_for(tiny_ckpt("qwen3_moe"), runtime)
