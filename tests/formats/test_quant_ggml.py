"""ggml block precisions as quantized tiers (formats/quant_ggml.py): the type each matrix takes, `moetier quantize`
writing q4_k / iq4_xs / q2_k tiers, the tier reader and the slot format that computes them (kernels/qformat.py
kind "gg": ggml's dot products through the native kernels; "gg-decode": gguf-py's decoder per call).

A tier must hold, byte for byte, what ggml's quantiser writes for each expert alone; a slot computes
x @ W.T for the W that gguf-py's reference decodes the blocks to (float64 reference). ggml's dot product rounds
the activation to 8-bit blocks of its vec_dot type first (tests/kernels/test_ggml.py), about 1% of the output's
scale; a wrong layout or type is wrong by the whole scale.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from conftest import canonical_experts_of
from moetier.config import PrecisionConfig
from moetier.errors import ConfigError
from moetier.formats import quant_ggml
from moetier.formats.layout import ExpertLayout
from moetier.formats.qtier import QuantTier, list_tiers, tier_dir
from moetier.formats.quant import QuantSpec, expert_tensor_specs, quantize_expert
from moetier.formats.quantize import quantize_model
from moetier.kernels import decode, ggml
from moetier.kernels.qformat import ExpertFormat, linear
from moetier.kernels.step import desc_row
from moetier.models.open import open_checkpoint
from moetier.models.tiny import build_tiny_checkpoint
from moetier.types import GGML_PRECISIONS, ExpertKey, Precision, precision_bits, priced_as

BF16 = torch.bfloat16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lib():
    lib = decode.load(True, None)
    if lib is None:
        pytest.skip("no kernel library (no C compiler)")
    assert ggml.available(), ggml.load_error()  # ggml-python is a dependency: its absence is a failure here
    return lib


def test_bits_are_the_types_block_bytes(lib):
    for name, (gtype, bits, priced) in GGML_PRECISIONS.items():
        blck, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[gtype]]
        assert bits == tsize * 8 / blck and precision_bits(name) == bits, name
        assert Precision(name).value == name and priced in ("int8", "int4", "int2") and priced_as(name) == priced
        assert {gtype, quant_ggml.FALLBACK[gtype]} <= ggml.register(lib)  # ggml computes the type and its fallback
    assert precision_bits("stored") is None and precision_bits("int4") == 4.0 and priced_as("int4") == "int4"


def test_block_type_takes_llama_quantizes_fallback_and_refuses_what_no_block_tiles():
    assert quant_ggml.block_type("q4_k", 512) == "Q4_K"
    assert quant_ggml.block_type("q4_k", 96) == "Q5_0"  # rows of 96: no super-block of 256
    assert quant_ggml.block_type("q2_k", 64) == "IQ4_NL" and quant_ggml.block_type("q6_k", 32) == "Q8_0"
    with pytest.raises(ConfigError, match=r"shape \[8, 48\] to q4_k: its rows are not whole blocks of Q4_K"):
        quant_ggml.block_type("q4_k", 48, (8, 48))
    assert quant_ggml.row_bytes("q4_k", 512) == 2 * 144 and quant_ggml.row_bytes("q4_k", 96) == 3 * 22


def test_quant_spec_and_config_take_the_ggml_names():
    spec = QuantSpec(Precision.Q4_K)
    assert spec.ggml and spec.bits == 4 and not QuantSpec(Precision.INT4).ggml
    with pytest.raises(ConfigError, match="ggml block type: its blocks are its groups"):
        QuantSpec(Precision.Q4_K, 64)
    with pytest.raises(ConfigError, match=r"unknown precision 'q4_x'.*q4_k"):
        QuantSpec("q4_x")  # type: ignore[arg-type]
    assert PrecisionConfig(mode="q4_k").mode == "q4_k"
    assert PrecisionConfig(mode="dynamic", hi="q4_k", lo="int4").hi == "q4_k"  # 4.5 bits above 4
    with pytest.raises(ConfigError, match="hi above lo, got hi=q2_k lo=q3_k"):
        PrecisionConfig(mode="dynamic", hi="q2_k", lo="q3_k")
    with pytest.raises(ConfigError, match="hi above lo, got hi=int4 lo=q4_k"):
        PrecisionConfig(mode="dynamic", hi="int4", lo="q4_k")
    with pytest.raises(ConfigError, match=r"group size given for 'q4_k' \(a ggml block type"):
        PrecisionConfig(mode="q4_k", groups=(("q4_k", 64),))
    with pytest.raises(ConfigError, match=r"--lo precision must be one of .*q2_k"):
        PrecisionConfig(mode="dynamic", hi="q4_k", lo="q1_k")


def test_down_rows_layout_is_refused():
    layout = ExpertLayout(hidden=256, inter=64, has_bias=False, down_rows=True)
    with pytest.raises(ConfigError, match="q4_k tiers have no down-rows layout for --sparsity"):
        expert_tensor_specs(layout, QuantSpec(Precision.Q4_K), BF16)


def test_stacked_quantisation_gives_each_experts_own_bytes_and_error():
    w = torch.randn(3, 16, 512, generator=torch.Generator().manual_seed(1))  # [B, N, K]
    rows, sq = quant_ggml.quantize_stack(w, "q4_k")
    want = 0.0
    for e in range(3):
        alone = quant_ggml.quantize_rows(w[e], "Q4_K")
        assert torch.equal(rows[e], alone)
        want += float(((quant_ggml.dequantize_rows(alone, "Q4_K", 512) - w[e]) ** 2).sum())
    assert sq == pytest.approx(want, rel=1e-5)
    assert 0.05 < (sq / float((w**2).sum())) ** 0.5 < 0.15  # Q4_K's relative error on gaussian rows: about 0.09


@pytest.mark.parametrize("gtype", ["Q4_K", "IQ4_XS"])
def test_threads_and_chunks_do_not_change_the_bytes(lib, gtype: str):
    w = torch.randn(40, 512, generator=torch.Generator().manual_seed(5))  # [N, K]
    one = ggml.quantize(gtype, w, threads=1)
    assert one is not None and one.shape == (40, ggml.row_bytes(gtype, 512))
    assert torch.equal(ggml.quantize(gtype, w, rows=7, threads=3), one)  # 6 chunks of up to 7 rows on 3 threads


def test_without_ggml_quantising_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(ggml, "quantize", lambda *a, **k: None)
    monkeypatch.setitem(ggml._errors, "load", "ggml-python is not installed (pip install ggml-python)")
    with pytest.raises(ConfigError, match="cannot write Q4_K blocks: ggml-python is not installed"):
        quant_ggml.quantize_rows(torch.randn(4, 256), "Q4_K")


# -- tiers -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 qwen3_moe with H = 256 (w13 rows are whole super-blocks) and I = 64 (w2 takes the fallback)."""
    return build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gg") / "m", dtype=BF16, hidden_size=256,
                                 moe_intermediate_size=64)  # fmt: skip


@pytest.fixture(scope="module")
def tiers(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiers")
    paths = quantize_model(ckpt, ["q4_k", "iq4_xs", "q2_k"], out=out, method="rtn")
    assert [p.name for p in paths] == ["q4_k", "iq4_xs", "q2_k"]
    return out


def test_tier_holds_ggmls_bytes_of_each_expert(ckpt: Path, tiers: Path):
    experts = canonical_experts_of(ckpt, "qwen3_moe")
    for prec, t13, t2 in (("q4_k", "Q4_K", "Q5_0"), ("iq4_xs", "IQ4_XS", "IQ4_NL"), ("q2_k", "Q2_K", "IQ4_NL")):
        m = json.loads((tiers / prec / "manifest.json").read_text())
        assert (m["method"], m["group"], m["group_sizes"]) == ("ggml", "ggml", {"w13": 256, "w2": 32}), prec
        o = open_checkpoint(ckpt, "fp32", CPU)
        try:
            tier = QuantTier.open(ckpt, prec, root=tiers, reader=o.reader)
            dest = {n: torch.empty(s, dtype=dt) for n, (dt, s) in tier.tensor_specs.items()}
            assert set(dest) == {"w13.q", "w2.q"}
            for key in (ExpertKey(0, 0), ExpertKey(1, 5)):
                tier.read_into(key, dest)
                pieces = experts[(key.layer, key.expert)]
                want = quantize_expert(pieces, QuantSpec(Precision(prec)))
                assert torch.equal(dest["w13.q"], want["w13.q"]) and torch.equal(dest["w2.q"], want["w2.q"])
                w13 = torch.cat([pieces["gate"], pieces["up"]])  # [2I, H]
                assert torch.equal(dest["w13.q"], quant_ggml.quantize_rows(w13, t13))
                assert torch.equal(dest["w2.q"], quant_ggml.quantize_rows(pieces["down"], t2))
            tier.close()
        finally:
            o.reader.close()
    listed = {t["precision"]: t for t in list_tiers(ckpt, tiers)}
    assert listed["q4_k"]["status"] == "ok" and listed["q2_k"]["layout"] == "packed"
    assert listed["q4_k"]["types"] == {"w13": "Q4_K", "w2": "Q5_0"} and listed["q2_k"]["types"]["w2"] == "IQ4_NL"
    # a layer file's size follows the types: per expert 128 rows of one Q4_K super-block, 256 rows of 2 Q5_0 blocks
    per_expert = 128 * 144 + 256 * 2 * 22
    assert tier_dir(ckpt, QuantSpec(Precision.Q4_K), tiers).name == "q4_k"
    layer0 = tiers / "q4_k" / "layer-000.safetensors"
    assert per_expert * 6 < layer0.stat().st_size < per_expert * 6 + 4096  # 6 experts and the header


def test_resume_skips_and_other_options_are_refused(ckpt: Path, tiers: Path, tmp_path: Path):
    events = []
    quantize_model(ckpt, ["q4_k"], out=tiers, progress=events.append)
    assert {e.status for e in events} == {"skipped"}
    with pytest.raises(ConfigError, match="ggml block type: its blocks are its groups"):
        quantize_model(ckpt, ["q4_k"], out=tmp_path, group_sizes={"q4_k": 64})
    with pytest.raises(ConfigError, match="q2_k tiers have no down-rows layout"):
        quantize_model(ckpt, ["q2_k"], out=tmp_path, down_rows=True)


# -- the slot format ---------------------------------------------------------------------------------------------
def _expert(seed: int, h: int = 256, i: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(i, h, generator=g) / 16, "up": torch.randn(i, h, generator=g) / 16,
            "down": torch.randn(h, i, generator=g) / 8}  # fmt: skip


@pytest.mark.parametrize("prec", ["q4_k", "iq4_xs", "q3_k", "q2_k", "q6_k", "q5_k"])
@pytest.mark.parametrize("native", [True, False])
def test_slot_computes_the_decoded_blocks(lib, prec: str, native: bool):
    layout = ExpertLayout(hidden=256, inter=64, has_bias=False)
    fmt = ExpertFormat(layout, QuantSpec(Precision(prec)), BF16, CPU, native=native, kernels=native)
    assert set(fmt.kinds.values()) == {"gg" if native else "gg-decode"}
    canonical = quantize_expert(_expert(len(prec)), QuantSpec(Precision(prec)))
    row = torch.zeros(fmt.slot_bytes, dtype=torch.uint8)
    views = fmt.views(row)
    fmt.pack_into(canonical, views)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(BF16)  # [M, H]
    for m, w, k in (("w13", views.w13, 256), ("w2", views.w2, 64)):
        assert w.gtype == quant_ggml.block_type(prec, k) and torch.equal(w.q, canonical[f"{m}.q"])
        xk = x[:, :k].contiguous()
        ref = xk.double() @ quant_ggml.dequantize_rows(canonical[f"{m}.q"], w.gtype, k, torch.float64).T  # [M, N]
        y = linear(xk, w)
        assert y.dtype == BF16 and y.shape == ref.shape
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < (0.03 if native else 0.01), (m, err)
    row_desc = desc_row(views)
    if native:
        assert row_desc is not None
        assert row_desc[1] == ggml.kind_of(views.w13.gtype, lib) and row_desc[10] == ggml.kind_of(views.w2.gtype, lib)
        assert row_desc[3] == views.w13.q.data_ptr() - row.data_ptr() and row_desc[4:6] == [-1, -1]
    else:
        assert row_desc is None  # the MoE call does not read a decoded-per-call slot


def test_slot_is_the_tiers_bytes_and_nothing_more():
    layout = ExpertLayout(hidden=256, inter=64, has_bias=False)
    fmt = ExpertFormat(layout, QuantSpec(Precision.Q4_K), BF16, CPU, native=True)
    assert fmt.slot_bytes == 128 * 144 + 256 * 2 * 22  # both matrices already 64-byte multiples
    assert fmt.pack_scratch_bytes == 0
