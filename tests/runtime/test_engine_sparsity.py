"""Intra-expert activation sparsity through the real engine (CPU, lean decoder).

One Qwen3-MoE-style checkpoint (hidden 32, expert inner size 48: every mask block but 32 divides
it) is built and calibrated once per module on random token ids; the table goes to the default
path MODEL/moetier-sparsity/thresholds.json. Then:
- target 0 is the dense engine, bit for bit;
- above the tipping point the default dense path is the original expert: with tipping=0 the sparse
  engine is the dense engine (up to fp32 summation order); with a tipping point between the experts' token counts the
  small calls are masked and the big ones exact (a float64 reference that masks only those);
- the gather path (tipping=1000: every call below the tipping point) and the masked dense path
  (tipping=0, dense="masked") agree, reach the target on the calibration tokens, and match a dense
  engine whose experts are masked by hand in float64 (a model-level reference);
- the torch fallback of the gather path, a 2-slot expert budget (chunks of 2 experts per native
  call) and decode agree with the same engines;
- the refusals: quantized precision, no table, another model's table, a block not dividing the
  expert size;
- the tipping profile is cached and read back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import moetier
from moetier import Budgets, EngineConfig, PrecisionConfig, RuntimeConfig, SparsityConfig
from moetier.errors import CheckpointError, ConfigError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.qtier import source_fingerprint
from moetier.kernels import decode, native
from moetier.kernels.sparse import ThresholdTable, default_table_path, native_kernel
from moetier.models.tiny import build_tiny_checkpoint
from moetier.policies.hwprofile import ComputeProfile, HardwareProfile, LinkProfile
from moetier.policies.sparsity import tipping_point
from moetier.runtime.calibrate import calibrate, model_identity
from moetier.runtime.executors import sparse as rs
from moetier.runtime.executors.base import Grouped, ResidentFirst
from moetier.runtime.executors.dense import DenseExecutor
from moetier.runtime.moe_block import Pipeline
from moetier.runtime.tipping import load_or_measure_tipping
from moetier.types import ExpertKey

CPU = RuntimeConfig(device="cpu", dtype="fp32")
INTER = 48
CALIB = torch.randint(3, 96, (256,), generator=torch.Generator().manual_seed(1)).tolist()
WINDOW = 128  # calibration runs two windows
PROBE = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(7))  # [1, T]
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def identity_of(engine: moetier.Engine, path: Path) -> dict[str, Any]:
    return model_identity(engine.info, source_fingerprint(CheckpointIndex(path))["fingerprint"])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The calibrated checkpoint (table at the default path); read-only."""
    path = build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("sparse") / "qwen3", moe_intermediate_size=INTER)
    with moetier.load(path, EngineConfig(runtime=CPU)) as engine:
        table = calibrate(engine, CALIB, WINDOW, identity_of(engine, path), "silu", {"text": "random ids"})
    table.save(default_table_path(path))
    return path


def sparse_cfg(target: float, tipping: int, block: int = 1, dense: str = "masked", **kw: Any) -> EngineConfig:
    """Masked dense by default here: most tests compare the gather path with the same function on the
    dense matmuls; the original-expert default has its own tests."""
    sc = SparsityConfig(target=target, tipping=tipping, block=block, dense=dense)  # type: ignore[arg-type]
    return EngineConfig(runtime=CPU, sparsity=sc, **kw)


@pytest.fixture(scope="module")
def dense_logits(model: Path) -> torch.Tensor:
    with moetier.load(model, EngineConfig(runtime=CPU)) as engine:
        return engine.logits(PROBE)


def calib_windows(engine: moetier.Engine) -> None:
    for s in range(0, len(CALIB), WINDOW):
        engine.logits(torch.tensor([CALIB[s : s + WINDOW]]))


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[Callable[..., moetier.Engine]]:
    """engines(target, tipping, block=1, dense="masked") -> a sparse engine, opened once per module (counts
    reset)."""
    cache: dict[tuple[float, int, int, str], moetier.Engine] = {}

    def get(target: float, tipping: int, block: int = 1, dense: str = "masked") -> moetier.Engine:
        key = (target, tipping, block, dense)
        if key not in cache:
            cache[key] = moetier.load(model, sparse_cfg(target, tipping, block, dense))
        engine = cache[key]
        assert engine.sparsity is not None
        engine.sparsity.reset_counts()
        return engine

    yield get
    for engine in cache.values():
        engine.close()


# --- calibration ---------------------------------------------------------------------------------


def test_calibrated_table(model: Path) -> None:
    table = ThresholdTable.load(default_table_path(model))
    assert sorted(table.thresholds) == [0, 1]
    assert all(sorted(rows) == [1, 4, 8, 16] for rows in table.thresholds.values())  # 32 does not divide 48
    assert table.calibration["tokens"] == len(CALIB) and table.calibration["window"] == WINDOW
    assert table.calibration["pairs"] == {"0": 2 * len(CALIB), "1": 2 * len(CALIB)}  # top-2 routing
    assert table.activation == "silu" and table.model["moe_intermediate"] == INTER
    for rows in table.thresholds.values():
        assert rows[1][0] == 0.0 and rows[1][-1] > rows[1][10] > 0
        assert rows[16][10] > rows[4][10] > rows[1][10]  # a block's largest magnitude is larger


def test_calibrate_refuses_too_few_tokens(model: Path) -> None:
    with moetier.load(model, EngineConfig(runtime=CPU)) as engine:
        with pytest.raises(ConfigError, match="at least a few hundred"):
            before = [b.pipeline for b in engine.loaded.blocks]
            calibrate(engine, [5], WINDOW, identity_of(engine, model), "silu", {})
        assert [b.pipeline for b in engine.loaded.blocks] == before  # executors restored


# --- exactness and agreement ---------------------------------------------------------------------


def test_target_zero_is_the_dense_engine(model: Path, dense_logits: torch.Tensor) -> None:
    with moetier.load(model, EngineConfig(runtime=CPU, sparsity=SparsityConfig())) as engine:
        assert engine.sparsity is None and "sparsity" not in engine.stats()
        assert engine.executor == "dense"
        assert all(isinstance(b.pipeline.executor, DenseExecutor) for b in engine.loaded.blocks)
        assert torch.equal(engine.logits(PROBE), dense_logits)
    # a table path given with target 0 is not even read
    cfg = EngineConfig(runtime=CPU, sparsity=SparsityConfig(target=0.0, table="/nonexistent/t.json"))
    with moetier.load(model, cfg) as engine:
        assert torch.equal(engine.logits(PROBE), dense_logits)


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_gather_and_dense_paths_agree_and_reach_the_target(
    model: Path, engines: Callable[..., moetier.Engine], target: float
) -> None:
    gather, dense = engines(target, 1000), engines(target, 0)
    torch.testing.assert_close(gather.logits(PROBE), dense.logits(PROBE), **CLOSE)
    for engine, sparse_path in ((gather, True), (dense, False)):
        engine.sparsity.reset_counts()  # type: ignore[union-attr]
        calib_windows(engine)
        s = engine.stats()["sparsity"]
        assert s["target"] == target and s["block"] == 1
        assert s["tipping_tokens"] == (1000 if sparse_path else 0)
        want_kernel = "native" if native.load() is not None else f"torch ({native.load_error()})"
        assert s["kernel"] == want_kernel
        assert s["table"] == str(default_table_path(model))
        assert s["profile_cached"] is False
        assert abs(s["achieved"] - target) < 0.05
        assert sorted(s["layers"]) == [0, 1]
        table = ThresholdTable.load(default_table_path(model))
        for layer, ls in s["layers"].items():
            assert ls["threshold"] == pytest.approx(table.threshold(layer, target))
            assert abs(ls["achieved"] - target) < 0.05
            routed = 2 * len(CALIB)  # top-2 over every calibration token
            if sparse_path:
                assert ls["dense_calls"] == 0 and ls["dense_tokens"] == 0
                assert ls["sparse_calls"] > 0 and ls["sparse_tokens"] == routed
            else:
                assert ls["sparse_calls"] == 0 and ls["sparse_tokens"] == 0
                assert ls["dense_calls"] > 0 and ls["dense_tokens"] == routed


@pytest.mark.parametrize("block", [4, 16])
def test_blocks_paths_agree(engines: Callable[..., moetier.Engine], block: int) -> None:
    gather, dense = engines(0.5, 1000, block), engines(0.5, 0, block)
    torch.testing.assert_close(gather.logits(PROBE), dense.logits(PROBE), **CLOSE)
    calib_windows(gather)
    s = gather.stats()["sparsity"]
    assert s["block"] == block and abs(s["achieved"] - 0.5) < 0.05


class HandMasked:
    """Executor of one MoE layer on the dense store: per token and routed expert, in float64,
    a = silu(x Wg^T); y = ((|a| >= thr) * a * (x Wu^T)) Wd^T; out = sum w * y. With `tipping`, a call is masked
    only when its mean tokens per routed expert is below it (the switch by batch size); else every expert of it is
    the original expert."""

    def __init__(self, threshold: float, moe: Any = None, tipping: int | None = None) -> None:
        self.threshold, self.moe, self.tipping = threshold, moe, tipping

    def group(self, ids: torch.Tensor, weights: torch.Tensor) -> Grouped:
        return Grouped({e: int((ids == e).sum()) for e in sorted(set(ids.flatten().tolist()))}, (ids, weights))

    def execute(self, x: torch.Tensor, plan: Any, grouped: Grouped) -> torch.Tensor:
        ids, weights = grouped.data
        return self.forward(self.moe, x, ids, weights)

    def forward(self, moe: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.exact(moe, x, ids, weights).to(x.dtype)

    def exact(self, moe: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The float64 result [T, H]."""
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            xt = x[t].double()
            for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
                key = ExpertKey(moe.layer, e)
                masked = self.tipping is None or ids.numel() < self.tipping * len(set(ids.flatten().tolist()))
                v = moe.store.acquire(key)
                try:
                    gate, up = (v.w13.double() @ xt).chunk(2)
                    a = F.silu(gate)
                    keep = a.abs() >= self.threshold if masked else torch.ones_like(a, dtype=torch.bool)
                    out[t] += w * (v.w2.double() @ (keep * a * up))
                finally:
                    moe.store.release(key)
        return out


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_matches_hand_masked_dense_engine(
    model: Path, engines: Callable[..., moetier.Engine], dense_logits: torch.Tensor, target: float
) -> None:
    gather, dense = engines(target, 1000), engines(target, 0)
    thresholds = {layer: ls["threshold"] for layer, ls in gather.stats()["sparsity"]["layers"].items()}
    with moetier.load(model, EngineConfig(runtime=CPU)) as ref:
        for b in ref.loaded.blocks:
            assert b.pipeline is not None
            b.attach(Pipeline(ResidentFirst(b.store), HandMasked(thresholds[b.layer], b), b.pipeline.observers))
        want = ref.logits(PROBE)
        # decode goes through the same executors (one token per call)
        prompt = PROBE[0, :6].tolist()
        want_gen = ref.generate(prompt, max_new_tokens=6, stop_at_eos=False).token_ids
    assert not torch.allclose(want, dense_logits, **CLOSE)  # the masking changes the model
    torch.testing.assert_close(gather.logits(PROBE), want, **CLOSE)
    torch.testing.assert_close(dense.logits(PROBE), want, **CLOSE)
    assert gather.generate(prompt, max_new_tokens=6, stop_at_eos=False).token_ids == want_gen
    assert dense.generate(prompt, max_new_tokens=6, stop_at_eos=False).token_ids == want_gen


@pytest.mark.parametrize("tipping", [2, 14, 1000])
def test_one_path_per_call(engines: Callable[..., moetier.Engine], tipping: int) -> None:
    """The switch by batch size (policies.sparsity.call_sparse): each layer call runs wholly on the gather path
    when its mean tokens per expert is below the tipping point, else wholly dense, whatever each expert's own
    count (the prefill of 40 tokens routes 80 pairs; tipping 14 lies among the experts' counts)."""
    eng = engines(0.5, tipping)
    got = eng.logits(PROBE)
    for layer, ls in eng.stats()["sparsity"]["layers"].items():
        assert ls["sparse_tokens"] + ls["dense_tokens"] == 2 * PROBE.shape[1]
        assert (ls["sparse_calls"] == 0) != (ls["dense_calls"] == 0), (layer, ls)  # one path, never both
        experts = ls["sparse_calls"] + ls["dense_calls"]
        assert (ls["sparse_calls"] > 0) == (2 * PROBE.shape[1] < tipping * experts), (layer, ls)
    torch.testing.assert_close(got, engines(0.5, 0).logits(PROBE), **CLOSE)


def test_original_dense_path_above_the_tipping_point_is_exact(
    model: Path, engines: Callable[..., moetier.Engine], dense_logits: torch.Tensor
) -> None:
    """The default dense path is the original expert (the paper's switch): with every call at or above the
    tipping point the sparse engine computes the dense engine's logits, prefill and decode, and counts no
    neuron skipped: equal up to fp32 summation order (the sparse layout's down projection is read
    transposed), far inside the exactness tolerance (1e-4)."""
    exact = engines(0.9, 0, dense="original")
    assert (exact.logits(PROBE) - dense_logits).abs().max().item() <= 1e-5
    s = exact.stats()["sparsity"]
    assert s["dense_path"] == "original" and s["tipping_source"] == "configured"
    assert s["achieved"] == 0.0 and s["achieved_masked"] == 0.0
    assert all(ls["dense_calls"] > 0 and ls["sparse_calls"] == 0 for ls in s["layers"].values())
    prompt = PROBE[0, :6].tolist()
    with moetier.load(model, EngineConfig(runtime=CPU)) as ref:
        want = ref.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    got = exact.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    assert got.token_ids == want.token_ids
    # the masked dense path at the same settings is not the dense model
    assert not torch.allclose(engines(0.9, 0).logits(PROBE), dense_logits, **CLOSE)


def test_routed_gather_path_matches_the_planned_one(engines: Callable[..., moetier.Engine]) -> None:
    """Every call below the tipping point with the original dense path takes the executor's routed call
    (`execute_routed`: no Plan, experts in ascending id); the masked setting takes the planned path. Both gather
    with the same thresholds: the same logits and the same counters."""
    routed, planned = engines(0.5, 1000, dense="original"), engines(0.5, 1000)
    block = routed.loaded.blocks[0]
    assert block.pipeline is not None and block.pipeline.routed is not None  # the sparse executor takes routing
    assert routed.sparsity is not None
    ex = routed.sparsity.layers[block.layer]
    planned_calls: list[int] = []
    plain = ex.execute
    ex.execute = lambda *a: planned_calls.append(1) or plain(*a)  # type: ignore[method-assign]
    try:
        got = routed.logits(PROBE)
    finally:
        del ex.execute
    assert not planned_calls  # the routed call took every call of the layer
    torch.testing.assert_close(got, planned.logits(PROBE), **CLOSE)
    a, b = routed.stats()["sparsity"], planned.stats()["sparsity"]
    assert a["achieved"] == b["achieved"] > 0.3
    for layer, ls in a["layers"].items():
        assert ls["sparse_calls"] == b["layers"][layer]["sparse_calls"] > 0 and ls["dense_calls"] == 0


def _prefill_then_decode(engine: moetier.Engine, n: int) -> torch.Tensor:
    """Logits [T, V] of PROBE: its first n tokens as one prefill call, the rest one decode step each."""
    engine.decoder.reset()
    with torch.inference_mode():
        out = [engine.step(PROBE[:, :n], all_logits=True)]
        out += [engine.step(PROBE[:, t : t + 1])[-1:] for t in range(n, PROBE.shape[1])]
    return torch.cat(out).float()


def test_both_paths_with_the_original_dense_expert(model: Path, engines: Callable[..., moetier.Engine]) -> None:
    """Tipping point 2: the prefill's calls (mean tokens per expert above 2) run the original, unmasked experts,
    every decode step's (one token each) the gather path; a float64 reference that masks exactly those calls
    agrees; the achieved sparsity counts the unmasked calls as fully active, and `achieved_masked` (the masked
    calls alone) stays near the target."""
    both = engines(0.5, 2, dense="original")
    got = _prefill_then_decode(both, 30)
    s = both.stats()["sparsity"]
    assert all(ls["sparse_calls"] > 0 and ls["dense_calls"] > 0 for ls in s["layers"].values())
    assert all(ls["sparse_tokens"] == 2 * 10 for ls in s["layers"].values())  # the 10 decode steps' pairs
    thresholds = {layer: ls["threshold"] for layer, ls in s["layers"].items()}
    with moetier.load(model, EngineConfig(runtime=CPU)) as ref:
        for b in ref.loaded.blocks:
            assert b.pipeline is not None
            b.attach(Pipeline(ResidentFirst(b.store), HandMasked(thresholds[b.layer], b, tipping=2),
                              b.pipeline.observers))  # fmt: skip
        want = _prefill_then_decode(ref, 30)
    torch.testing.assert_close(got, want, **CLOSE)
    assert 0 < s["achieved"] < s["achieved_masked"]
    assert abs(s["achieved_masked"] - 0.5) < 0.1


def test_perplexity_finite_and_near_dense(model: Path, engines: Callable[..., moetier.Engine]) -> None:
    with moetier.load(model, EngineConfig(runtime=CPU)) as engine:
        dense = engine.perplexity(CALIB, window=WINDOW).ppl
    sparse = engines(0.5, 1000).perplexity(CALIB, window=WINDOW)
    assert math.isfinite(sparse.ppl) and dense / 2 < sparse.ppl < 2 * dense
    assert sparse.ppl != dense
    assert "sparsity" in sparse.stats


def test_torch_fallback_matches_native(
    model: Path, engines: Callable[..., moetier.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rs, "native_kernel", lambda *a, **k: None)
    with moetier.load(model, sparse_cfg(0.5, 1000, block=4)) as engine:
        s = engine.stats()["sparsity"]
        assert s["kernel"].startswith("torch (")
        got = engine.logits(PROBE)
        s = engine.stats()["sparsity"]
        assert all(ls["sparse_calls"] > 0 and ls["dense_calls"] == 0 for ls in s["layers"].values())
    torch.testing.assert_close(got, engines(0.5, 1000, 4).logits(PROBE), **CLOSE)
    torch.testing.assert_close(got, engines(0.5, 0, 4).logits(PROBE), **CLOSE)


@pytest.mark.parametrize("tipping", [1000, 0])
def test_small_budget_chunks_by_capacity(model: Path, engines: Callable[..., moetier.Engine], tipping: int) -> None:
    with moetier.load(model, sparse_cfg(0.5, tipping)) as probe:
        slot, staging = probe.store.slot_bytes, probe.store.staging_bytes
    budget = 2 * slot + staging
    with moetier.load(model, sparse_cfg(0.5, tipping, budgets=Budgets(host_expert_bytes=budget))) as engine:
        assert engine.store.capacity == 2  # type: ignore[union-attr]
        got = engine.logits(PROBE)
        s = engine.stats()
        assert s["tiers"]["host"]["slots"] == 2 and s["misses"] > 2
        assert s["peak_host_expert_bytes"] == 2 * slot
        layers = s["sparsity"]["layers"]
        calls = "sparse_calls" if tipping else "dense_calls"
        assert all(ls[calls] >= 3 for ls in layers.values())  # more experts than slots: several chunks
        gen = engine.generate(PROBE[0, :6].tolist(), max_new_tokens=5, stop_at_eos=False).token_ids
    full = engines(0.5, tipping)
    torch.testing.assert_close(got, full.logits(PROBE), **CLOSE)
    assert gen == full.generate(PROBE[0, :6].tolist(), max_new_tokens=5, stop_at_eos=False).token_ids


@pytest.fixture(scope="module")
def model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 twin of `model` (weights stored as bf16), calibrated the same way."""
    path = tmp_path_factory.mktemp("sparse_bf16") / "qwen3"
    build_tiny_checkpoint("qwen3_moe", path, dtype=torch.bfloat16, moe_intermediate_size=INTER)
    with moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu"))) as engine:
        table = calibrate(engine, CALIB, WINDOW, identity_of(engine, path), "silu", {"text": "random ids"})
    table.save(default_table_path(path))
    return path


def test_bf16_layer_gather_path_matches_reference(model_bf16: Path) -> None:
    """One MoE layer call of a bf16 engine on fixed inputs: the gather path (fp32 accumulation, one
    rounding) is within bf16 rounding of the float64 reference with the same threshold."""
    gen = torch.Generator().manual_seed(3)
    t = 24
    x = torch.randn(t, 32, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(t)])
    weights = torch.rand(t, 2, generator=gen).to(torch.bfloat16)
    bf16 = RuntimeConfig(device="cpu")
    with moetier.load(model_bf16, EngineConfig(runtime=bf16, sparsity=SparsityConfig(0.5, tipping=1000))) as engine:
        assert engine.dtype == torch.bfloat16
        block = engine.loaded.blocks[0]
        got = block.experts_forward(x, ids, weights)
        ref = HandMasked(block.pipeline.executor.threshold).exact(block, x, ids, weights)
        s = engine.stats()["sparsity"]["layers"][0]
    assert got.dtype == torch.bfloat16 and s["sparse_calls"] == 6 and s["sparse_tokens"] == 2 * t
    assert abs(s["achieved"] - 0.5) < 0.05
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=2e-2)


def test_bf16_dense_path_is_the_native_moe_half(model_bf16: Path) -> None:
    """bf16 on the CPU with the original dense path: a call above the tipping point runs the native MoE half on the
    sparse layout's slots (down rows read as such, csrc/step.c MT_ROWS), as the dense engine runs its experts: the
    same greedy tokens as the dense bf16 engine, logits within bf16 rounding (the down projection is summed over
    neurons in another order), and the native calls counted."""
    bf16 = RuntimeConfig(device="cpu")
    prompt = PROBE[0, :8].tolist()
    with moetier.load(model_bf16, EngineConfig(runtime=bf16)) as ref:
        assert ref.executor == "native"
        want = ref.generate(prompt, max_new_tokens=6, stop_at_eos=False)
        want_logits = ref.logits(PROBE)
    sc = SparsityConfig(target=0.5, tipping=0, dense="original")
    with moetier.load(model_bf16, EngineConfig(runtime=bf16, sparsity=sc)) as engine:
        got = engine.generate(prompt, max_new_tokens=6, stop_at_eos=False)
        got_logits = engine.logits(PROBE)
        s = engine.stats()["sparsity"]
    assert s["dense_kernel"] == "native MoE half" and s["native_dense_calls"] > 0
    assert all(ls["sparse_calls"] == 0 and ls["dense_calls"] > 0 for ls in s["layers"].values())
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got_logits.float(), want_logits.float(), rtol=0, atol=0.05)
    masked = SparsityConfig(target=0.5, tipping=0, dense="masked")  # the masked dense path is not the native half
    with moetier.load(model_bf16, EngineConfig(runtime=bf16, sparsity=masked)) as engine:
        engine.logits(PROBE)
        assert engine.stats()["sparsity"]["dense_kernel"] == "torch"


# --- refusals ------------------------------------------------------------------------------------


def test_quantized_precision_needs_the_rows_tier(model: Path) -> None:
    """A static quantized precision reads the rows tier (`quantize --for-sparsity`); without it the
    error names the command. Dynamic precision is refused."""
    cfg = sparse_cfg(0.5, 0, precision=PrecisionConfig(mode="int8"))
    with pytest.raises(CheckpointError, match=r"moetier quantize .* --precisions int8 --for-sparsity"):
        moetier.load(model, cfg)
    cfg = sparse_cfg(0.5, 0, precision=PrecisionConfig(mode="dynamic", hi="int8", lo="int4"))
    with pytest.raises(ConfigError, match="--precision dynamic"):
        moetier.load(model, cfg)


def test_refuses_a_missing_table(model: Path, tiny_ckpt: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"no sparsity table at .*moetier-sparsity/thresholds\.json.*`moetier calibrate"
    ):
        moetier.load(tiny_ckpt("qwen3_moe"), sparse_cfg(0.5, 0))  # never calibrated: nothing at the default path
    cfg = EngineConfig(runtime=CPU, sparsity=SparsityConfig(target=0.5, tipping=0, table=str(tmp_path / "t.json")))
    with pytest.raises(ConfigError, match=r"t\.json; run `moetier calibrate"):
        moetier.load(model, cfg)


def test_refuses_another_models_table(model: Path, tmp_path: Path, tiny_ckpt: Callable[..., Path]) -> None:
    table = str(default_table_path(model))
    # same shape, other weights (seed): only the fingerprint differs
    twin = build_tiny_checkpoint("qwen3_moe", tmp_path / "twin", seed=1, moe_intermediate_size=INTER)
    cfg = EngineConfig(runtime=CPU, sparsity=SparsityConfig(target=0.5, tipping=0, table=table))
    with pytest.raises(ConfigError, match=r"calibrated for another model \(fingerprint is"):
        moetier.load(twin, cfg)
    # another shape
    with pytest.raises(ConfigError, match=r"calibrated for another model \(moe_intermediate is 48"):
        moetier.load(tiny_ckpt("qwen3_moe"), cfg)


def test_refuses_a_block_not_dividing_the_expert_size(model: Path) -> None:
    with pytest.raises(ConfigError, match="32 does not divide the expert size 48"):
        moetier.load(model, sparse_cfg(0.5, 0, block=32))


def test_config_validation() -> None:
    for bad in ({"target": -0.1}, {"target": 0.96}, {"block": 2}, {"tipping": -1}):
        with pytest.raises(ConfigError):
            SparsityConfig(**bad)
    with pytest.raises(ConfigError, match="scope must be 'total' or 'routed'"):
        SparsityConfig(target=0.5, scope="shared")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dense path must be 'original' or 'masked'"):
        SparsityConfig(target=0.5, dense="exact")  # type: ignore[arg-type]
    assert SparsityConfig().scope == "total" and SparsityConfig().dense == "original"  # the paper's defaults
    assert not SparsityConfig().enabled and SparsityConfig(target=0.05).enabled


# --- tipping profile cache -----------------------------------------------------------------------


def test_tipping_profile_is_cached(tmp_path: Path) -> None:
    cache = tmp_path / "p.json"
    kernel = native_kernel(32, INTER, torch.float32, torch.device("cpu"))
    cfg = SparsityConfig(target=0.5)
    tip, profile, cached = load_or_measure_tipping(32, INTER, torch.float32, F.silu, cfg, kernel, cache=cache)
    assert not cached and cache.is_file()
    assert tip == tipping_point(profile) and profile and min(profile) == 1
    assert all(d > 0 and s > 0 for d, s in profile.values())
    stored = json.loads(cache.read_text())
    assert len(stored) == 1
    tip2, profile2, cached2 = load_or_measure_tipping(32, INTER, torch.float32, F.silu, cfg, kernel, cache=cache)
    assert cached2 and tip2 == tip and profile2 == profile
    # a corrupt cache only costs a re-measure
    cache.write_text("{not json")
    _, _, cached3 = load_or_measure_tipping(32, INTER, torch.float32, F.silu, cfg, kernel, cache=cache)
    assert not cached3 and len(json.loads(cache.read_text())) == 1
    # so does a malformed entry under the right key
    (key,) = json.loads(cache.read_text())
    for bad in ([1, 2], {}, {"1": "x"}):
        cache.write_text(json.dumps({key: bad}))
        tip4, _, cached4 = load_or_measure_tipping(32, INTER, torch.float32, F.silu, cfg, kernel, cache=cache)
        assert not cached4 and tip4 >= 0


def test_tipping_profile_keys_the_dense_path(tmp_path: Path) -> None:
    """The original and the masked dense path are timed (and cached) separately: the dense side is the
    path the engine runs above the switch."""
    cache = tmp_path / "p.json"
    kernel = native_kernel(32, INTER, torch.float32, torch.device("cpu"))
    cfg = SparsityConfig(target=0.5)
    for masked in (True, False):
        tip, profile, cached = load_or_measure_tipping(32, INTER, torch.float32, F.silu, cfg, kernel, cache=cache,
                                                       masked=masked)  # fmt: skip
        assert not cached and tip == tipping_point(profile)
    keys = [json.loads(k) for k in json.loads(cache.read_text())]
    assert sorted(k["dense"] for k in keys) == ["masked", "original"]
    # bf16 with the decode library: the dense side is the native MoE half on down rows, keyed apart
    lib = decode.load(True, None)
    assert lib is not None
    bf16 = native_kernel(64, 64, torch.bfloat16, torch.device("cpu"))
    _, profile, _ = load_or_measure_tipping(64, 64, torch.bfloat16, F.silu, cfg, bf16, cache=cache, masked=False,
                                            decode_lib=lib)  # fmt: skip
    assert profile and all(d > 0 and s > 0 for d, s in profile.values())
    keys = [json.loads(k) for k in json.loads(cache.read_text())]
    assert sorted(k["dense"] for k in keys) == ["masked", "native", "original"]


# --- the GPU tipping point from a hardware profile (unverified on a GPU: none was lent) ----------


def test_roofline_tipping_from_a_profile() -> None:
    """On CUDA with --profile NAME the tipping point is read off the profile's GPU roofline at the routed
    sparsity; a profile without a GPU is refused, naming the way out."""
    gpu = ComputeProfile(peak_flops=8e14, mem_bw=2e12, overhead_s=1e-5, efficiency=((64, 0.1), (256, 0.3)))
    hw = HardwareProfile("fake-gpu", "test", cpu=gpu, gpu=gpu, pcie=LinkProfile(3e10), disk=LinkProfile(3e9),
                         cpu_threads=8, host_mem_bytes=1 << 34, gpu_mem_bytes=1 << 34)  # fmt: skip
    tip, profile = rs.roofline_tipping(hw, 2048, 512, 2, 0.94)
    assert tip == tipping_point(profile) and 1 < tip < max(profile)
    assert tip < rs.roofline_tipping(hw, 2048, 512, 2, 0.98)[0]  # more sparsity: the gather path pays longer
    cpu_only = HardwareProfile("cpu-box", "test", cpu=gpu, gpu=None, pcie=None, disk=LinkProfile(3e9),
                               cpu_threads=8, host_mem_bytes=1 << 34, gpu_mem_bytes=None)  # fmt: skip
    with pytest.raises(ConfigError, match=r"'cpu-box' has no GPU section.*--sparsity-tipping"):
        rs.roofline_tipping(cpu_only, 2048, 512, 2, 0.94)


def test_bf16_sparse_engine_keeps_the_native_attention_half(model_bf16: Path) -> None:
    """A bf16 engine with sparsity runs the native step's attention half and router; each MoE half is the sparse
    executor's call on that routing (runtime/native_step.py), and decoding agrees with the step off."""
    bf16 = RuntimeConfig(device="cpu")
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(4))
    out = {}
    for step in (True, False):
        cfg = EngineConfig(runtime=replace(bf16, native_step=step), sparsity=SparsityConfig(0.5, tipping=1000))
        with moetier.load(model_bf16, cfg) as engine:
            st = engine.stats()
            assert st["executor"] == "sparse" and ("native_step" in st) == step
            out[step] = engine.logits(ids).float()
            if step:
                assert st["native_step"]["moe"] == "executor"
                assert engine.stats()["sparsity"]["layers"][0]["sparse_calls"] > 0
    rel = (out[True] - out[False]).abs().amax(-1) / out[False].abs().amax(-1)
    assert float(rel.median()) <= 0.02, rel
