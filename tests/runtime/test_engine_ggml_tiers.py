"""ggml block precisions (q4_k, iq4_xs, q2_k ...) through the real engine: static tiers computed by ggml's dot
products inside the native MoE call, and dynamic precision with q4_k hot and q2_k cold experts.

The checkpoint is a bf16 qwen3_moe with H = 256, so w13's rows are whole K-quant super-blocks (Q4_K, Q2_K ...),
and I = 64, so w2 takes llama-quantize's fallback type (Q5_0, IQ4_NL). The per-call decoded engine
(`native_kernels=False`: gguf-py's decoder, then bf16 matmuls) computes the same weights without ggml's kernels,
so the two must agree up to ggml's 8-bit rounding of the activations (tests/kernels/test_ggml.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.config import PrecisionConfig, PrefetchConfig
from moetier.errors import CheckpointError
from moetier.formats.quantize import quantize_model
from moetier.kernels import decode
from moetier.models.tiny import build_tiny_checkpoint
from moetier.types import ExpertKey, Precision

BF16 = torch.bfloat16
PROBE = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(9))  # [1, T]
WARMUP = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(4)).tolist()
NATIVE = decode.load(True, None) is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no kernel library (no C compiler)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ggt") / "m", dtype=BF16, hidden_size=256,
                                 moe_intermediate_size=64)  # fmt: skip
    quantize_model(path, ["q4_k", "q2_k", "int4"])
    return path


def load(path: Path, precision: PrecisionConfig, budget: int | None = None, native: bool = True,
         **kw: object) -> moetier.Engine:  # fmt: skip
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), precision=precision,
                       runtime=RuntimeConfig(device="cpu", native_kernels=native), **kw)  # type: ignore[arg-type]
    return moetier.load(path, cfg)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module")
def full(model: Path) -> torch.Tensor:
    with load(model, PrecisionConfig(mode="full")) as engine:
        return engine.logits(PROBE)


@needs_native
@pytest.mark.parametrize("prec", ["q4_k", "q2_k"])
def test_static_tier_runs_in_the_native_moe_call_as_the_decoded_weights(model: Path, prec: str) -> None:
    with load(model, PrecisionConfig(mode=prec)) as engine:
        fmt = engine.store.source.fmt
        assert fmt.kinds == {"w13": "gg", "w2": "gg"}
        assert fmt.gtypes == ({"w13": "Q4_K", "w2": "Q5_0"} if prec == "q4_k" else {"w13": "Q2_K", "w2": "IQ4_NL"})
        logits = engine.logits(PROBE)
        s = engine.stats()
        assert s["executor"] == "native" and s["native_step"]["unreadable_slots"] == 0
        assert s["native_step"]["torch_moe_calls"] == 0 and s["native_step"]["calls"] > 0
        used = len(engine.store.compute.slots)
        assert s["precision"] == {prec: {"experts": used, "bytes": used * fmt.slot_bytes}}
        out = engine.generate(PROBE[0, :6].tolist(), max_new_tokens=5, stop_at_eos=False).token_ids
    with load(model, PrecisionConfig(mode=prec), native=False) as decoded:
        assert set(decoded.store.source.fmt.kinds.values()) == {"gg-decode"}
        want = decoded.logits(PROBE)
    assert torch.isfinite(logits).all() and rel_err(logits, want) < 0.05, rel_err(logits, want)
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert len(out) == 5


@needs_native
def test_q4_k_is_closer_to_full_precision_than_int4_and_q2_k(model: Path, full: torch.Tensor) -> None:
    err, slot = {}, {}
    for prec in ("q4_k", "int4", "q2_k"):
        with load(model, PrecisionConfig(mode=prec)) as engine:
            err[prec] = rel_err(engine.logits(PROBE), full)
            slot[prec] = engine.store.slot_bytes
    assert err["q4_k"] < err["int4"] < err["q2_k"], err
    assert slot["q4_k"] > slot["int4"] > slot["q2_k"], slot  # 4.5 + Q5_0's 5.5 bits, 4.25, 2.625 + IQ4_NL's 4.5


def test_missing_tier_names_the_command(model: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no iq4_xs quantized tier.*moetier quantize .* --precisions iq4_xs`"):
        load(model, PrecisionConfig(mode="iq4_xs"))


@needs_native
def test_prefetch_prices_a_ggml_tier_as_its_integer_class(model: Path) -> None:
    with load(model, PrecisionConfig(mode="q4_k"), prefetch=PrefetchConfig(enabled=True)) as engine:
        assert engine.prefetcher is not None and engine.prefetcher.pricing.cost.precision == "int4"
        assert torch.isfinite(engine.logits(PROBE)).all()
        assert engine.stats()["prefetch"]["predicted"] > 0


# -- dynamic: q4_k hot, q2_k cold ------------------------------------------------------------------------------
@needs_native
def test_dynamic_q4_k_over_q2_k_switches_and_matches_the_static_tiers(model: Path) -> None:
    with load(model, PrecisionConfig(mode="dynamic", hi="q4_k", lo="q2_k"), budget=10**9) as probe:
        hi_slot = probe.store.pools[Precision.Q4_K].pool.slot_bytes
        lo_slot = probe.store.pools[Precision.Q2_K].pool.slot_bytes
        staging = probe.store.staging_bytes
    assert hi_slot > lo_slot and staging == 0  # ggml tiers are read straight into their slots
    n = 12  # 2 MoE layers x 6 experts
    all_hi = n * hi_slot + lo_slot
    with load(model, PrecisionConfig(mode="q4_k")) as static:
        want = static.logits(PROBE)
    pcfg = PrecisionConfig(mode="dynamic", hi="q4_k", lo="q2_k", sync=True, period=4)
    with load(model, pcfg, budget=all_hi) as engine:
        assert len([k for k in engine.store.keys if engine.store.precision_of(k) == Precision.Q4_K]) == n
        assert torch.equal(engine.logits(PROBE), want)
    budget = n * lo_slot + lo_slot + 4 * (hi_slot - lo_slot)  # every expert at q2_k, 4 of them at q4_k
    pcfg = PrecisionConfig(mode="dynamic", hi="q4_k", lo="q2_k", sync=True, period=4, hysteresis=0.0)
    with load(model, pcfg, budget=budget) as engine:
        engine.warmup(WARMUP[:16])
        ppl = engine.perplexity(WARMUP + PROBE[0].tolist(), window=6).ppl
        s = engine.stats()
        assert s["switching"]["decisions"] > 3 and s["promotions"] > 0 and 1 < ppl < 1e4
        assert s["precision"]["q4_k"]["experts"] == 4 and s["precision"]["q2_k"]["experts"] == n - 4
        assert s["native_step"]["unreadable_slots"] == 0 and s["native_step"]["torch_moe_calls"] == 0
        hot = {k for k in engine.store.keys if engine.store.precision_of(k) == Precision.Q4_K}
        assert len(hot) == 4 and all(isinstance(k, ExpertKey) for k in hot)
        engine.store.check()


@needs_native
def test_expert_biases_and_gpt_oss_experts_ride_along(tmp_path: Path) -> None:
    """GPT-OSS (biased, clamped experts; rows of 64: Q4_K's fallback Q5_0 on both matrices) in the native MoE
    call as the decoded weights compute them."""
    path = build_tiny_checkpoint("gpt_oss", tmp_path / "g", dtype=BF16, intermediate_size=64)
    quantize_model(path, ["q4_k"])
    out = {}
    for native in (True, False):
        with load(path, PrecisionConfig(mode="q4_k"), native=native) as engine:
            fmt = engine.store.source.fmt
            assert set(fmt.kinds.values()) == {"gg" if native else "gg-decode"} and "b13" in fmt.slices["bias"]
            out[native] = engine.logits(PROBE)
            if native:
                s = engine.stats()["native_step"]
                assert s["unreadable_slots"] == 0 and s["torch_moe_calls"] == 0 and s["calls"] > 0
    assert torch.isfinite(out[True]).all() and rel_err(out[True], out[False]) < 0.05, rel_err(out[True], out[False])
