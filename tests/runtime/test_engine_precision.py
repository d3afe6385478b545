"""Expert precision through the real engine: static quantized tiers and dynamic switching (DynaExq).

Checkpoints are built once per module with an expert inner size of 64 (the conftest ones,
16/48, have no int4/int2 group) and quantized once:
- qwen3_moe bf16, hidden 128: the CPU kernels (int8, int4 and int2 for w13; int2's w2 has
  one group of 64 and stays generic); lean decoder;
- mixtral fp32: the generic format (dequantise, then F.linear) for every precision;
- gpt_oss bf16: expert biases, int8 only; the lean decoder (sinks, sliding windows).

Dynamic engines run on qwen3_moe (2 MoE layers x 6 experts). Their pools are sized from the
slot sizes read off a probe engine; `all_lo` / `all_hi` are the budgets holding every expert
at lo / hi plus the staging buffers and the spare low slot. A mixed precision state is
checked against a second engine brought to the same state with `store.switch` (the logits of
an engine depend only on which precision each expert has).
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.cli.tables import eval_report
from moetier.config import PrecisionConfig, format_size
from moetier.errors import BudgetError, CheckpointError, ConfigError
from moetier.formats.quantize import quantize_model
from moetier.kernels import decode
from moetier.kernels.qformat import _int2_layout_ok
from moetier.models.tiny import build_tiny_checkpoint
from moetier.policies.precision import ExpertState, PrecisionController
from moetier.types import ExpertKey, Precision

CPU = RuntimeConfig(device="cpu")
PROBE = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(9))  # [1, T]
WARMUP = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(4)).tolist()
KEYS = [ExpertKey(layer, e) for layer in (0, 1) for e in range(6)]

MODELS: dict[str, tuple[str, torch.dtype, dict[str, int], tuple[str, ...]]] = {
    "qwen3_bf16": ("qwen3_moe", torch.bfloat16, {"moe_intermediate_size": 64, "hidden_size": 128},
                   ("int8", "int4", "int2", "q4_k", "q2_k")),
    "mixtral_fp32": ("mixtral", torch.float32, {"intermediate_size": 64}, ("int8", "int4", "int2")),
    "gpt_oss_bf16": ("gpt_oss", torch.bfloat16, {"intermediate_size": 64}, ("int8",)),
}  # fmt: skip
# compute format of (w13, w2) per precision: the kernels where dtype and shape allow, else generic
INT2_KIND = "int2" if _int2_layout_ok() else "generic"  # the int2 fold needs the AVX-512 packer layout
# with the native decode kernels loaded, bf16 slots take their formats (n8 / n4 / n2) where both matrices fit
# (int2's w2 has K = 64, not a multiple of 128: that expert keeps the torch formats)
NATIVE = decode.load(True, None) is not None
KINDS = {
    "qwen3_bf16": {"int8": ("n8", "n8") if NATIVE else ("int8", "int8"),
                   "int4": ("n4", "n4") if NATIVE else ("int4", "int4"), "int2": (INT2_KIND, "generic")},
    "mixtral_fp32": {p: ("generic", "generic") for p in ("int8", "int4", "int2")},
    "gpt_oss_bf16": {"int8": ("n8", "n8") if NATIVE else ("int8", "int8")},
}  # fmt: skip
BITS = {"full": 16, "int8": 8, "int4": 4, "int2": 2}


def hot_keys(controller: PrecisionController) -> list[ExpertKey]:
    """The controller's HIGH targets over all layers."""
    return [ExpertKey(layer, e) for layer in controller.layers for e in sorted(controller.hot_set(layer))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """model(name) -> a read-only checkpoint of MODELS[name] with its quantized tiers (built once)."""
    root, cache = tmp_path_factory.mktemp("prec"), {}

    def get(name: str) -> Path:
        if name not in cache:
            family, dtype, overrides, tiers = MODELS[name]
            path = build_tiny_checkpoint(family, root / name, dtype=dtype, **overrides)
            quantize_model(path, tiers)
            cache[name] = path
        return cache[name]

    return get


def load(path: Path, precision: PrecisionConfig | None = None, budget: int | None = None,
         runtime: RuntimeConfig = CPU) -> moetier.Engine:  # fmt: skip
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget), precision=precision or PrecisionConfig(),
                       runtime=runtime)  # fmt: skip
    return moetier.load(path, cfg)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module")
def full_logits(model: Callable[[str], Path]) -> Callable[[str], torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            with load(model(name)) as engine:
                cache[name] = engine.logits(PROBE)
        return cache[name]

    return get


# -- static precisions ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_bf16", "mixtral_fp32"])
def test_static_precisions_track_full_precision_in_order(model, full_logits, name: str) -> None:
    path, ref = model(name), full_logits(name)
    with load(path) as full:
        full_slot, n = full.store.slot_bytes, len(full.store.keys)
        assert full.stats()["precision"] == {"full": {"experts": 0, "bytes": 0}}  # loaded on first use
        full.logits(PROBE)
        used = full.stats()["precision"]["full"]["experts"]
        assert 8 <= used <= n and full.stats()["precision"]["full"]["bytes"] == used * full_slot
    err, slot = {}, {"full": full_slot}
    for prec in ("int8", "int4", "int2"):
        with load(path, PrecisionConfig(mode=prec)) as engine:
            fmt = engine.store.source.fmt
            assert (fmt.kinds["w13"], fmt.kinds["w2"]) == KINDS[name][prec]
            logits = engine.logits(PROBE)
            assert logits.shape == ref.shape and logits.dtype == ref.dtype and torch.isfinite(logits).all()
            err[prec] = rel_err(logits, ref)
            s = engine.stats()
            slot[prec] = engine.store.slot_bytes
            # the experts used, resident at `prec` and counted at the quantized slot size
            used = len(engine.store.compute.slots)
            assert 8 <= used <= n and s["precision"] == {prec: {"experts": used, "bytes": used * slot[prec]}}
            assert s["tiers"]["host"]["resident_bytes"] == used * slot[prec] < used * full_slot
            assert "promotions" in s and s["promotions"] == s["demotions"] == 0 and "switching" not in s
            # the packed bits, plus scales, zeros and alignment of at most half as much again
            layout_numel = full_slot // (2 if MODELS[name][1] == torch.bfloat16 else 4)
            assert layout_numel * BITS[prec] // 8 <= slot[prec] < 0.75 * layout_numel * 2 * BITS[prec] // 8
            prompt = PROBE[0, :6].tolist()
            out = engine.generate(prompt, max_new_tokens=5, stop_at_eos=False)
            assert len(out.token_ids) == 5 and all(0 <= t < 96 for t in out.token_ids)
            assert engine.generate(prompt, max_new_tokens=5, stop_at_eos=False).token_ids == out.token_ids
    assert slot["full"] > slot["int8"] > slot["int4"] > slot["int2"]
    # error ordered by precision; int8 far closer than int2
    assert err["int8"] < err["int4"] < err["int2"], err
    assert err["int8"] < 0.05 and err["int4"] < 0.5 and err["int2"] < 1.0, err
    assert err["int8"] * 10 < err["int2"], err


def test_static_int8_with_expert_biases(model, full_logits) -> None:
    path, ref = model("gpt_oss_bf16"), full_logits("gpt_oss_bf16")
    with load(path, PrecisionConfig(mode="int8")) as engine:
        assert engine.stats()["decoder"] == "LeanDecoder"
        fmt = engine.store.source.fmt
        assert (fmt.kinds["w13"], fmt.kinds["w2"]) == KINDS["gpt_oss_bf16"]["int8"] and "b13" in fmt.slices["bias"]
        logits = engine.logits(PROBE)
        assert rel_err(logits, ref) < 0.05  # the biases (random, std 0.5) are kept
        s = engine.stats()
        assert s["precision"] == {"int8": {"experts": 12, "bytes": 12 * engine.store.slot_bytes}}
        if NATIVE:  # GPT-OSS's biased, clamped experts in the native MoE call (csrc/step.h act 1)
            assert s["executor"] == "native" and s["native"]["native_calls"] > 0 and s["native"]["dense_calls"] == 0
        assert len(engine.generate(PROBE[0, :4].tolist(), max_new_tokens=3, stop_at_eos=False).token_ids) == 3


def test_missing_tier_names_the_quantize_command(model, tmp_path: Path) -> None:
    path = model("gpt_oss_bf16")  # only int8 was written
    with pytest.raises(CheckpointError, match=re.escape(f"run `moetier quantize {path} --precisions int4`")):
        load(path, PrecisionConfig(mode="int4"))
    with pytest.raises(CheckpointError, match=r"moetier quantize .* --precisions int2 --out "):
        load(path, PrecisionConfig(mode="int2", quant_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"no int4 quantized tier.*moetier quantize .* --precisions int4"):
        load(path, PrecisionConfig(mode="dynamic", hi="int8", lo="int4"), budget=10**9)


def test_group_other_than_the_written_tier_is_refused(model) -> None:
    path = model("qwen3_bf16")  # int4 written with the default group (128)
    with pytest.raises(CheckpointError, match=r"moetier quantize .* --precisions int4 --group int4=32`"):
        load(path, PrecisionConfig(mode="int4", groups=(("int4", 32),)))
    with load(path, PrecisionConfig(mode="int4")) as default, \
            load(path, PrecisionConfig(mode="int4", groups=(("int4", 128),))) as explicit:  # fmt: skip
        assert torch.equal(default.logits(PROBE), explicit.logits(PROBE))  # the same tier


def test_static_int4_under_a_small_budget_caches_exactly(model) -> None:
    path = model("qwen3_bf16")
    prompt = PROBE[0, :8].tolist()
    with load(path, PrecisionConfig(mode="int4")) as resident:
        want = resident.logits(PROBE)
        want_tokens = resident.generate(prompt, max_new_tokens=6, stop_at_eos=False).token_ids
        slot, staging = resident.store.slot_bytes, resident.store.staging_bytes
    budget = staging + 4 * slot + 17
    with load(path, PrecisionConfig(mode="int4"), budget=budget) as engine:
        assert torch.equal(engine.logits(PROBE), want)
        assert engine.generate(prompt, max_new_tokens=6, stop_at_eos=False).token_ids == want_tokens
        s = engine.stats()
        host = s["tiers"]["host"]
        assert host["slots"] == 4 and host["budget_bytes"] == budget
        assert s["misses"] > 4 and host["evictions"] == s["misses"] - 4
        assert s["peak_host_expert_bytes"] == 4 * slot <= budget - staging
        assert s["precision"] == {"int4": {"experts": 4, "bytes": 4 * slot}}


# -- dynamic precision: sizes, errors ----------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    hi: int  # slot bytes
    lo: int
    staging: int  # both sources' staging buffers
    n: int = 12

    @property
    def step(self) -> int:
        return self.hi - self.lo

    @property
    def all_lo(self) -> int:  # every expert at lo, the staging and one spare low slot
        return self.n * self.lo + self.staging + self.lo

    @property
    def all_hi(self) -> int:
        return self.n * self.hi + self.staging + self.lo

    def budget(self, n_hot: int, slack: int = 0, transient: int = 0) -> int:
        """The budget that holds exactly `n_hot` experts at hi (slack < step), plus `transient` hi slots."""
        return self.all_lo + n_hot * self.step + slack + transient * self.hi


# q4_k over q2_k: ggml's block types (hidden 128 and I = 64 are no whole super-blocks, so every matrix takes
# llama-quantize's fallback, Q5_0 over IQ4_NL); tests/runtime/test_engine_ggml_tiers.py runs the K-quants themselves
PAIRS = [("full", "int4"), ("int4", "int2"), ("q4_k", "q2_k")]


@pytest.fixture(scope="module")
def sizes(model) -> Callable[[str, str], Sizes]:
    cache: dict[tuple[str, str], Sizes] = {}

    def get(hi: str, lo: str) -> Sizes:
        if (hi, lo) not in cache:
            with load(model("qwen3_bf16"), PrecisionConfig(mode="dynamic", hi=hi, lo=lo), budget=10**9) as probe:
                store = probe.store
                hs, ls = (store.pools[Precision(p)] for p in (hi, lo))
                assert store.staging_bytes == hs.source.staging_bytes + ls.source.staging_bytes
                cache[(hi, lo)] = Sizes(hs.pool.slot_bytes, ls.pool.slot_bytes, store.staging_bytes)
        return cache[(hi, lo)]

    return get


def dynamic(model, hi: str, lo: str, budget: int | None, **kw: Any) -> moetier.Engine:
    return load(model("qwen3_bf16"), PrecisionConfig(mode="dynamic", hi=hi, lo=lo, **kw), budget=budget)


def hi_set(engine: moetier.Engine) -> set[ExpertKey]:
    store = engine.store
    return {k for k in store.keys if store.precision_of(k) == store.hi_precision}


def precision_map(engine: moetier.Engine) -> dict[ExpertKey, Precision]:
    return {k: engine.store.precision_of(k) for k in engine.store.keys}


def assert_settled(engine: moetier.Engine, budget: int) -> None:
    """After mover.drain(): one registered version per expert, pools fully accounted, counters agree."""
    store, sw = engine.store, engine.switching
    store.check()
    assert store.used_bytes() <= budget
    assert set(store.index) == set(store.keys) == set(KEYS)
    assert len(set(store.index.values())) == len(KEYS)  # no two experts share a (precision, slot)
    for p, pool in store.pools.items():
        registered = sum(v.precision == p for v in store.index.values())
        assert registered + len(pool.free) == pool.pool.n_slots, p
        assert not pool.inflight and not pool.retired, p
    s = engine.stats()
    n_hot = sum(store.per_layer.values())
    hi = len(hi_set(engine))
    assert s["precision"][store.hi_precision.value]["experts"] == hi <= n_hot
    assert sum(m["experts"] for m in s["precision"].values()) == len(KEYS)
    for p, m in s["precision"].items():
        assert m["bytes"] == m["experts"] * store.pools[Precision(p)].pool.slot_bytes
    assert s["promotions"] - s["demotions"] == hi - n_hot  # preload put n_hot experts at hi
    assert s["switching"]["pending_moves"] == 0
    assert s["peak_host_expert_bytes"] <= budget - store.staging_bytes
    if not s["switching"]["mover_errors"]:
        assert hi_set(engine) == set(hot_keys(sw.controller))  # the store caught up with every target
        assert sw.planned_hi == hi == n_hot  # demotions only ever pair with promotions


def bring_to(engine: moetier.Engine, target: dict[ExpertKey, Precision]) -> None:
    """Switch a quiet engine's experts (with store.switch) until each has its precision in `target`:
    a demotion then a promotion, so that the pools never need a slot they lack."""
    store = engine.store
    downs = [k for k in store.keys if store.precision_of(k) == store.hi_precision != target[k]]
    ups = [k for k in store.keys if store.precision_of(k) == store.lo_precision != target[k]]
    assert len(ups) <= len(downs) <= len(ups) + 1, (ups, downs)
    for i, key in enumerate(downs):
        assert store.switch(key, store.lo_precision, timeout=5)
        if i < len(ups):
            assert store.switch(ups[i], store.hi_precision, timeout=5)
    assert precision_map(engine) == target


@pytest.mark.parametrize(("hi", "lo"), PAIRS)
def test_dynamic_budget_errors(model, sizes, hi: str, lo: str) -> None:
    z = sizes(hi, lo)
    assert z.hi > z.lo
    with pytest.raises(ConfigError, match="--host-expert-mem") as err:
        dynamic(model, hi, lo, None)
    assert f"between {format_size(z.all_lo)} (every expert {lo}) and {format_size(z.all_hi)}" in str(err.value)
    with pytest.raises(BudgetError, match=rf"minimum budget is {z.all_lo} B"):
        dynamic(model, hi, lo, z.all_lo - 1)
    with pytest.raises(BudgetError, match=rf"every expert at {lo} but no {hi} one") as err:
        dynamic(model, hi, lo, z.budget(1) - 1)
    assert format_size(z.budget(1)) in str(err.value)
    with dynamic(model, hi, lo, z.budget(1)) as engine:  # the smallest budget that works: one hot slot
        assert engine.store.per_layer == {0: 1, 1: 0}
        assert len(hi_set(engine)) == 1 and engine.stats()["switching"]["n_hot"] == 1
        assert_settled(engine, z.budget(1))


@pytest.mark.parametrize(("hi", "lo"), [("int4", "int4"), ("int2", "int4"), ("int8", "full")])
def test_dynamic_needs_hi_above_lo(hi: str, lo: str) -> None:
    with pytest.raises(ConfigError, match=f"hi above lo, got hi={hi} lo={lo}"):
        PrecisionConfig(mode="dynamic", hi=hi, lo=lo)


# -- dynamic precision: serving ------------------------------------------------------------------
@pytest.mark.parametrize(("hi", "lo"), PAIRS)
def test_dynamic_engine_loads_warms_up_promotes_and_serves(model, sizes, hi: str, lo: str) -> None:
    z = sizes(hi, lo)
    budget = z.budget(5, slack=z.step // 2)
    with dynamic(model, hi, lo, budget, warmup_tokens=40) as engine:
        store, sw = engine.store, engine.switching
        assert sw is not None and store.per_layer == {0: 3, 1: 2}  # spread over layers, lower ones first
        initial = {ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2), ExpertKey(1, 0), ExpertKey(1, 1)}
        assert hi_set(engine) == initial
        s = engine.stats()
        assert s["precision"] == {hi: {"experts": 5, "bytes": 5 * z.hi}, lo: {"experts": 7, "bytes": 7 * z.lo}}
        assert s["tiers"]["host"]["pool_bytes"] + s["staging_bytes"] <= budget
        assert s["switching"]["n_hot"] == 5 and s["promotions"] == s["demotions"] == 0
        assert_settled(engine, budget)

        assert engine.warmup(WARMUP) == 40  # warmup_tokens
        assert set(hot_keys(sw.controller)) != initial, "the warmup text must move the hot set"
        s = engine.stats()
        assert s["promotions"] > 0 and s["promotions"] == s["demotions"]
        assert s["switching"]["decisions"] == 1
        assert hi_set(engine) == set(hot_keys(sw.controller))  # warmup waited for its switches
        assert_settled(engine, budget)

        result = engine.perplexity(PROBE[0].tolist(), window=8)
        assert result.tokens == 23 and 1 < result.ppl < 1e4
        tokens = engine.generate(PROBE[0, :5].tolist(), max_new_tokens=4, stop_at_eos=False).token_ids
        assert len(tokens) == 4
        sw.mover.drain()
        assert_settled(engine, budget)


def test_warmup_is_a_no_op_unless_dynamic(model) -> None:
    with load(model("qwen3_bf16"), PrecisionConfig(mode="int4")) as engine:
        assert engine.switching is None and engine.warmup(WARMUP) == 0


@pytest.mark.parametrize(("hi", "lo"), PAIRS)
def test_dynamic_with_every_expert_hot_equals_the_static_engine(model, sizes, hi: str, lo: str) -> None:
    z = sizes(hi, lo)
    with load(model("qwen3_bf16"), PrecisionConfig(mode=hi)) as static:
        want = static.logits(PROBE)
    with dynamic(model, hi, lo, z.all_hi, sync=True, period=4) as engine:
        assert engine.store.per_layer == {0: 6, 1: 6} and len(hi_set(engine)) == 12
        assert torch.equal(engine.logits(PROBE), want)
        engine.warmup(WARMUP)
        assert engine.stats()["promotions"] == 0 and torch.equal(engine.logits(PROBE), want)


@pytest.mark.parametrize(("hi", "lo"), PAIRS)
def test_dynamic_sync_runs_are_reproducible_and_exact(model, sizes, hi: str, lo: str) -> None:
    z = sizes(hi, lo)
    budget = z.budget(4)
    text = WARMUP + PROBE[0].tolist()
    runs = []
    for _ in range(2):
        with dynamic(model, hi, lo, budget, sync=True, period=4, hysteresis=0.0) as engine:
            engine.warmup(WARMUP[:16])
            ppl = engine.perplexity(text, window=6).ppl
            s = engine.stats()
            assert s["switching"]["decisions"] > 3 and s["promotions"] > 0
            assert_settled(engine, budget)
            runs.append((ppl, s["promotions"], s["demotions"], precision_map(engine)))
            # logits depend only on each expert's precision: a quiet engine switched by hand agrees
            with dynamic(model, hi, lo, budget, period=10**6) as ref:
                bring_to(ref, runs[-1][3])
                assert torch.equal(engine.logits(PROBE), ref.logits(PROBE))
    assert runs[0] == runs[1]


# -- reliability: asynchronous switching under random budgets, periods and prompts -------------------
def poisoned(source: Any, pause: float) -> Callable[[ExpertKey, Any], int]:
    """read_into that first fills the slot with NaN bytes and pauses: a forward that read an
    unregistered (in-flight) slot would compute with NaN (non-finite logits, or NaN routing
    weights that the precision controller refuses with a ValueError)."""
    real = source.read_into

    def read_into(key: ExpertKey, views: Any) -> int:
        views.row.view(torch.uint8).fill_(0xFF)  # NaN in bf16 and in the bf16 scales of packed slots
        time.sleep(pause)
        return int(real(key, views))

    return read_into


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    pair=st.sampled_from(PAIRS),
    n_hot=st.integers(1, 12),
    slack=st.floats(0, 0.99),
    period=st.integers(1, 8),
    calls=st.lists(
        st.tuples(st.lists(st.integers(3, 95), min_size=1, max_size=10), st.integers(0, 3)), min_size=1, max_size=4
    ),
    transient=st.integers(0, 3),
)
def test_async_switching_keeps_budget_provenance_and_accounting(model, sizes, pair, n_hot, slack, period, calls,
                                                                transient):  # fmt: skip
    """Also with several switches in flight (transient high slots, pipelined mover)."""
    hi, lo = pair
    z = sizes(hi, lo)
    budget = z.budget(n_hot, int(slack * z.step), transient)
    with dynamic(model, hi, lo, budget, period=period, hysteresis=0.0, alpha=0.5,
                 transient_slots=transient) as engine:  # fmt: skip
        store, sw = engine.store, engine.switching
        assert sum(store.per_layer.values()) == n_hot
        assert store.transient == transient and engine.switching.mover.workers == transient + 1
        for p in store.pools.values():
            p.source.read_into = poisoned(p.source, 0.001)
        for prompt, new in calls:
            if new == 0:
                assert torch.isfinite(engine.logits(torch.tensor([prompt]))).all()
            else:
                assert len(engine.generate(prompt, max_new_tokens=new, stop_at_eos=False).token_ids) == new
            store.check()
            assert store.used_bytes() <= budget
            assert len(hi_set(engine)) <= n_hot + transient  # promotions run ahead into the transient slots
        assert torch.isfinite(engine.logits(PROBE)).all()  # plenty of tokens: at least one decision
        assert sw.controller.decisions >= 1
        sw.mover.drain()
        assert not engine.stats()["switching"]["mover_errors"]
        assert_settled(engine, budget)
        target = precision_map(engine)
        got = engine.logits(PROBE[:, :5])  # computed in `target`: what it enqueues runs after it
        sw.mover.drain()
        assert_settled(engine, budget)
        assert store.peak_inflight <= transient + 1
    with dynamic(model, hi, lo, budget, period=10**6, transient_slots=transient) as ref:
        bring_to(ref, target)
        assert torch.equal(got, ref.logits(PROBE[:, :5]))


# -- the three-level hierarchy: host DRAM cache of both precisions, prefetch of predicted promotions ----
def cached(model, hi: str, lo: str, budget: int, cache: int, **kw: Any) -> moetier.Engine:
    cfg = EngineConfig(budgets=Budgets(host_expert_bytes=budget, host_cache_bytes=cache), runtime=CPU,
                       precision=PrecisionConfig(mode="dynamic", hi=hi, lo=lo, **kw))  # fmt: skip
    return moetier.load(model("qwen3_bf16"), cfg)


@pytest.mark.parametrize(("hi", "lo"), PAIRS)
def test_dram_cache_and_prefetch_keep_sync_runs_exact_and_report_hit_rates(model, sizes, hi: str, lo: str) -> None:
    z = sizes(hi, lo)
    budget = z.budget(4, transient=2)
    text = WARMUP + PROBE[0].tolist()
    kw = dict(sync=True, period=8, hysteresis=0.0, transient_slots=2)
    with dynamic(model, hi, lo, budget, **kw) as plain:  # no DRAM level: every switch reads its disk tier
        plain.warmup(WARMUP[:16])
        want = plain.perplexity(text, window=6).ppl
        want_state, want_disk = precision_map(plain), plain.stats()["disk_bytes"]
        want_moves = (plain.stats()["promotions"], plain.stats()["demotions"])
        assert "dram" not in plain.stats()["switching"]
    # a cache holding everything: after preload, only first promotions read disk
    big = 12 * (z.hi + z.lo) + z.hi
    with cached(model, hi, lo, budget, big, prefetch=True, **kw) as engine:
        engine.warmup(WARMUP[:16])
        assert engine.perplexity(text, window=6).ppl == want  # the cache changes where bytes come from, not them
        assert precision_map(engine) == want_state
        s = engine.stats()
        assert (s["promotions"], s["demotions"]) == want_moves and want_moves[0] > 0
        assert_settled(engine, budget)
        dram, sw = s["switching"]["dram"], s["switching"]
        lo_d, hi_d = dram["precisions"][lo], dram["precisions"][hi]
        # one lookup per fill: preload (8 lo, 4 hi), then each switch; the cache holds all 24 versions, so
        # each is read from disk at most once (a staged hi version by the prefetch, not by a lookup)
        assert lo_d["hits"] + lo_d["misses"] == 8 + s["demotions"] and lo_d["misses"] <= 12
        assert hi_d["hits"] + hi_d["misses"] == 4 + s["promotions"]
        assert hi_d["misses"] + engine.store.prefetch_issued <= 12 and lo_d["hits"] + hi_d["hits"] > 0
        assert dram["used_bytes"] <= dram["budget_bytes"] == big
        assert s["disk_bytes"] < want_disk
        pf = sw["prefetch"]
        assert pf["staged"] == engine.store.prefetch_issued and pf["predicted"] >= pf["staged"] > 0
        assert dram["prefetch_used"] + dram["prefetch_wasted"] + dram["prefetch_pending"] == pf["staged"]
        assert sw["transient"]["hi_slots"] == 2 and sw["transient"]["peak_inflight"] >= 1
        engine.store.check()
    with pytest.raises(BudgetError, match="--host-cache-mem"):
        cached(model, hi, lo, budget, z.hi)
    with pytest.raises(ConfigError, match="--host-cache-mem"):
        dynamic(model, hi, lo, budget, prefetch=True)


# -- a mover that fails mid-transfer -----------------------------------------------------------------
def test_failed_promotion_keeps_serving_the_stable_version(model, sizes, monkeypatch) -> None:
    hi, lo = "full", "int4"
    z = sizes(hi, lo)
    budget = z.budget(5)
    victim, cold = ExpertKey(0, 4), ExpertKey(0, 2)
    engine = dynamic(model, hi, lo, budget, period=10**6)
    ref = dynamic(model, hi, lo, budget, period=10**6)
    try:
        store, sw = engine.store, engine.switching
        source = store.pools[Precision.FULL].source
        real, attempts, failing = source.read_into, [], [True]

        def flaky(key: ExpertKey, views: Any) -> int:
            if key == victim and failing[0]:
                attempts.append(key)
                half = views.row.numel() // 2
                views.row[:half].fill_(float("nan"))  # half the slot written, then the disk fails
                raise OSError("injected read failure")
            return int(real(key, views))

        monkeypatch.setattr(source, "read_into", flaky)
        assert store.per_layer == {0: 3, 1: 2} and victim not in hi_set(engine)
        keep = {1: [1.0, 1.0, 0, 0, 0, 0]}  # layer 1: its incumbents stay

        # 1. promote the victim, paired with demoting the coldest incumbent of layer 0
        sw.controller.seed({0: [1.0, 1.0, 0.5, 0, 10.0, 0], **keep})
        sw.after_forward(force=True)
        sw.mover.drain()
        assert attempts == [victim]
        assert store.precision_of(victim) == Precision.INT4 and store.precision_of(cold) == Precision.INT4
        errors = engine.stats()["switching"]["mover_errors"]
        assert len(errors) == 1 and "promote (0, 4) to full: OSError: injected read failure" in errors[0]
        s = engine.stats()
        assert (s["promotions"], s["demotions"]) == (0, 1)
        store.check()
        after_first = engine.logits(PROBE)  # this forward's after_forward takes the failure back
        assert torch.isfinite(after_first).all()
        assert sw.controller.state(victim) is ExpertState.LOW and sw.planned_hi == 4
        assert ref.store.switch(cold, Precision.INT4)
        assert torch.equal(after_first, ref.logits(PROBE))  # the victim served from its int4 version

        # 2. again, now alone (the failure left a high slot free): nothing else changes
        sw.controller.seed({0: [1.0, 1.0, 0, 0, 10.0, 0], **keep})
        sw.after_forward(force=True)
        sw.mover.drain()
        assert attempts == [victim, victim] and store.precision_of(victim) == Precision.INT4
        assert torch.equal(engine.logits(PROBE), after_first)
        s = engine.stats()
        assert len(s["switching"]["mover_errors"]) == 2 and (s["promotions"], s["demotions"]) == (0, 1)
        payload = {"ppl": 1.5, "nll": 0.4, "tokens": 9, "eval_s": 0.1, "eval_tok_s": 90.0, **s}
        console = Console(file=io.StringIO(), width=400)
        console.print(eval_report(payload))
        table = console.file.getvalue()
        assert "mover errors" in table and "2: promote (0, 4) to full: OSError: injected read failure" in table
        assert "promotions / demotions" in table and "experts at int4" in table

        # 3. the disk recovers: the next decision's move runs
        failing[0] = False
        sw.controller.seed({0: [1.0, 1.0, 0, 0, 10.0, 0], **keep})
        sw.after_forward(force=True)
        sw.mover.drain()
        assert store.precision_of(victim) == Precision.FULL
        s = engine.stats()
        assert (s["promotions"], s["demotions"]) == (1, 1) and len(s["switching"]["mover_errors"]) == 2
        assert_settled(engine, budget)
        assert ref.store.switch(victim, Precision.FULL)
        assert torch.equal(engine.logits(PROBE), ref.logits(PROBE))
    finally:
        engine.close()
        ref.close()


def test_failed_demotion_does_not_stall_the_mover(model, sizes, monkeypatch) -> None:
    hi, lo = "full", "int4"
    z = sizes(hi, lo)
    victim, cold = ExpertKey(0, 4), ExpertKey(0, 2)
    engine = dynamic(model, hi, lo, z.budget(5), period=10**6)
    store, sw = engine.store, engine.switching
    try:
        source = store.pools[Precision.INT4].source
        real = source.read_into

        def flaky(key: ExpertKey, views: Any) -> int:
            if key == cold:
                raise OSError("injected read failure")
            return int(real(key, views))

        monkeypatch.setattr(source, "read_into", flaky)
        sw.controller.seed({0: [1.0, 1.0, 0.5, 0, 10.0, 0], 1: [1.0, 1.0, 0, 0, 0, 0]})
        sw.after_forward(force=True)  # demote `cold`, then promote `victim` into the slot it frees
        # the stall this guards against is the promotion's 30 s wait for a slot (store.begin_switch(...,
        # timeout=30.0) in runtime/precision.py); 15 s stays below it and gives a busy machine room for both moves
        assert sw.mover.drain(timeout=15), "the mover is stuck behind the promotion"
        assert store.precision_of(cold) == Precision.FULL and store.precision_of(victim) == Precision.INT4
        errors = engine.stats()["switching"]["mover_errors"]
        assert errors and "demote (0, 2)" in errors[0] and not any("TimeoutError" in e for e in errors)
        store.check()
    finally:
        with store._lock:  # release a mover thread still waiting for a slot, so close() is quick
            store.closed = True
            store._slot_freed.notify_all()
        sw.mover.drain(timeout=5)
        engine.close()
