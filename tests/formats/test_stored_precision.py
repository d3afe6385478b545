"""The "stored" precision: pool slots hold an expert's bytes as the quantised checkpoint stores them (FP8 + scales,
MXFP4 blocks, GPTQ / AWQ words, compressed-tensors), counted as stored bytes, dequantised per call.

Its logits must equal those of the default (dequantised-into-the-slot) path, all experts resident and at one
slot per MoE layer, and as the lo precision of dynamic switching under full.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quant_ref import TINY_OVERRIDES, VARIANTS, convert

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.config import PrecisionConfig
from moetier.errors import ConfigError
from moetier.formats.layout import ExpertLayout
from moetier.formats.quantize import quantize_model
from moetier.kernels.qformat import linear
from moetier.kernels.stored import StoredFormat, StoredWeight
from moetier.models.tiny import build_tiny_checkpoint
from moetier.types import Precision

PROMPT = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(12))  # [1, T]
RUNTIME = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
CASES = [
    ("qwen3_moe", "fp8"),
    ("gpt_oss", "mxfp4"),
    ("mixtral", "gptq_v1_sym"),
    ("qwen3_moe", "gptq_v2_actorder"),
    ("qwen3_moe", "awq"),
    ("deepseek_v3", "ct_asym"),
]


@pytest.fixture(scope="module")
def quantised(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    cache: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("stored")

    def get(family: str, variant: str) -> Path:
        if (family, variant) not in cache:
            method, opts = VARIANTS[variant]
            src = build_tiny_checkpoint(family, root / f"{family}_{variant}_src", **TINY_OVERRIDES.get(family, {}))
            quant, twin = root / f"{family}_{variant}", root / f"{family}_{variant}_twin"
            convert(src, quant, twin, method, **opts)
            shutil.rmtree(twin)
            cache[(family, variant)] = quant
        return cache[(family, variant)]

    return get


def _engine(path: Path, precision: PrecisionConfig, budget: int | None = None) -> moetier.Engine:
    cfg = EngineConfig(precision=precision, budgets=Budgets(host_expert_bytes=budget), runtime=RUNTIME)
    return moetier.load(path, cfg)


@pytest.mark.parametrize("budget", ["all", "per_layer"])
@pytest.mark.parametrize(("family", "variant"), CASES)
def test_stored_logits_equal_the_dequantised_path(quantised, family, variant, budget):
    path = quantised(family, variant)
    full = _engine(path, PrecisionConfig())
    want, full_slot = full.logits(PROMPT), full.store.slot_bytes
    full.close()
    engine = _engine(path, PrecisionConfig(mode="stored"))
    if budget == "per_layer":
        slot, staging, n_moe = engine.store.slot_bytes, engine.store.staging_bytes, len(engine.info.moe_layers)
        engine.close()
        engine = _engine(path, PrecisionConfig(mode="stored"), n_moe * slot + staging)
        assert engine.store.host.pool.n_slots == n_moe
    assert engine.store.precision is Precision.STORED
    assert engine.store.slot_bytes < full_slot / 2  # the slot holds stored bytes, not fp32 weights
    views = engine.store.host.pool.views[0]
    assert isinstance(views.w13, StoredWeight) and views.w13.kind == "stored"
    diff = (engine.logits(PROMPT) - want).abs().max().item()
    assert diff <= 1e-5, diff
    if budget == "per_layer":
        stats = engine.stats()
        assert engine.store.host.evictions > 0
        assert stats["peak_host_expert_bytes"] + stats["staging_bytes"] <= n_moe * slot + staging
    engine.close()


def test_stored_slot_bytes_are_the_stored_bytes(quantised):
    """An FP8 expert of the tiny qwen3 (3 matrices of 16 x 32, 8x8 blocks): fp8 bytes plus fp32 scales, each part
    on a 64-byte boundary."""
    engine = _engine(quantised("qwen3_moe", "fp8"), PrecisionConfig(mode="stored"))
    part = [16 * 32, 2 * 4 * 4]  # fp8 [16, 32] (and [32, 16]), scales [2, 4] (and [4, 2]) fp32
    assert engine.store.slot_bytes == 3 * sum(-(-b // 64) * 64 for b in part)
    assert engine.store.slot_bytes <= engine.info.expert_bytes + 6 * 64
    engine.close()


def test_stored_weight_decodes_to_the_dequantised_slot(quantised):
    path = quantised("gpt_oss", "mxfp4")  # gate and up interleaved in one fused tensor, and biases
    full, stored = _engine(path, PrecisionConfig()), _engine(path, PrecisionConfig(mode="stored"))
    try:
        (key,) = [k for k in full.store.keys if k.expert == 2 and k.layer == 1]
        fv, sv = full.store.acquire(key), stored.store.acquire(key)
        assert torch.equal(sv.w13.decode(torch.float32), fv.w13) and torch.equal(sv.w2.decode(torch.float32), fv.w2)
        assert torch.equal(sv.b13, fv.b13) and torch.equal(sv.b2, fv.b2)
        x = torch.randn(3, fv.w13.shape[1])
        assert torch.equal(linear(x, sv.w13, sv.b13), linear(x, fv.w13, fv.b13))
        full.store.release(key)
        stored.store.release(key)
    finally:
        full.close()
        stored.close()


def test_dynamic_full_over_stored(quantised):
    path = quantised("qwen3_moe", "fp8")
    full = _engine(path, PrecisionConfig())
    want, hi_slot, n = full.logits(PROMPT), full.store.slot_bytes, len(full.store.keys)
    full.close()
    probe = _engine(path, PrecisionConfig(mode="stored"))
    lo_slot, staging = probe.store.slot_bytes, probe.store.staging_bytes
    probe.close()
    budget = 3 * hi_slot + (n - 3 + 1) * lo_slot + 2 * staging + lo_slot  # three hot experts
    engine = _engine(path, PrecisionConfig(mode="dynamic", hi="full", lo="stored", sync=True), budget)
    try:
        assert engine.store.hi_precision is Precision.FULL and engine.store.lo_precision is Precision.STORED
        assert (engine.logits(PROMPT) - want).abs().max().item() <= 1e-5
        assert engine.store.used_bytes() <= budget
    finally:
        engine.close()


def test_dynamic_refuses_stored_above_full(quantised):
    with pytest.raises(ConfigError, match="hi above lo"):
        _engine(quantised("qwen3_moe", "fp8"), PrecisionConfig(mode="dynamic", hi="stored", lo="full"), 10**6)


def test_stored_refuses_sparse_execution():
    """Sparse execution reads down rows [I, H]; the stored form keeps the checkpoint's orientation."""
    with pytest.raises(ConfigError, match="stored precision does not run sparse"):
        StoredFormat(ExpertLayout(32, 16, has_bias=False, down_rows=True), (), torch.float32)


def test_precision_config_accepts_stored():
    assert PrecisionConfig(mode="stored").precisions == ("stored",)
    assert PrecisionConfig(mode="dynamic", hi="full", lo="stored").precisions == ("full", "stored")
    with pytest.raises(ConfigError, match="hi above lo"):
        PrecisionConfig(mode="dynamic", hi="stored", lo="stored")


def test_dynamic_stored_over_int4(tmp_path):
    """The issue's example: FP8 experts as stored for hot experts, an int4 tier (`moetier quantize` of the FP8
    checkpoint, experts decoded) for cold ones; hot experts compute as the stored path does, cold ones as int4."""
    method, opts = VARIANTS["fp8"]
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src", hidden_size=64, moe_intermediate_size=64)
    path, twin = tmp_path / "fp8", tmp_path / "twin"
    convert(src, path, twin, method, **opts)
    quantize_model(path, ["int4"])  # default root MODEL/moetier-quant
    stored = _engine(path, PrecisionConfig(mode="stored"))
    want, hi_slot, n, staging = stored.logits(PROMPT), stored.store.slot_bytes, len(stored.store.keys), \
        stored.store.staging_bytes  # fmt: skip
    stored.close()
    tier = _engine(path, PrecisionConfig(mode="int4"))
    lo_want, lo_slot, lo_staging = tier.logits(PROMPT), tier.store.slot_bytes, tier.store.staging_bytes
    tier.close()
    assert lo_slot < hi_slot, (lo_slot, hi_slot)
    spare = PrecisionConfig().spare_slots
    budget = n * lo_slot + 4 * (hi_slot - lo_slot) + staging + lo_staging + spare * lo_slot  # four hot experts
    engine = _engine(path, PrecisionConfig(mode="dynamic", hi="stored", lo="int4", sync=True), budget)
    try:
        assert engine.store.hi_precision is Precision.STORED and engine.store.lo_precision is Precision.INT4
        engine.warmup(PROMPT[0].tolist())  # seeds the hot set: promoted to stored (synchronously)
        mix = engine.store.stats()["precision"]
        assert mix["stored"]["experts"] >= 1 and mix["int4"]["experts"] >= 1, mix
        got = engine.logits(PROMPT)
        assert (got - want).abs().max().item() < (lo_want - want).abs().max().item()  # nearer stored than int4
        assert engine.store.used_bytes() <= budget
    finally:
        engine.close()
