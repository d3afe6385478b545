"""GGUF experts computed as stored: precision "auto" resolves to "stored" where ggml computes every expert
tensor's block type (runtime/wire.py resolve_precision), the slots hold the file's own blocks (the budget
counts stored bytes), the native executor and decode step read them (kernels/ggml.py, csrc/mm.h), and so do
the attention projections and the output head.

The reference is transformers in fp32 on the twin checkpoint holding the values the file decodes to (numpy
reference, tests/gguf_ref.py). The bf16 engine with `--precision full` (everything decoded to bf16 at load)
differs from it by bf16 rounding; computing as stored adds ggml's 8-bit activation blocks (Q8_0 / Q8_K) at
every product (each product within 1% of the float64 reference: tests/kernels/test_ggml.py). On these random
models a router near-tie can flip one token's experts under that rounding (seen: one token of twelve off by
the logits' scale, the others at twice the bf16 engine's error), so the comparison is per token, by the median
over tokens of the mean |error|: at most 3x the bf16 engine's. A wrong row, type or layout puts every token off
by the logits' scale (over 10x).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers import AutoModelForCausalLM

import moetier
from gguf_ref import dequantized_twin, write_gguf
from moetier import Budgets, EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.kernels import ggml
from moetier.models.tiny import build_tiny_checkpoint

SIZES = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256}  # K-quant rows of 256
BF16 = RuntimeConfig(device="cpu", dtype="bf16")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gguf_stored")
    src = build_tiny_checkpoint("qwen3_moe", root / "src", **SIZES)
    cache: dict[str, Path] = {}

    def get(qtype: str, types: dict[str, str] | None = None) -> Path:
        key = qtype + repr(sorted((types or {}).items()))
        if key not in cache:
            cache[key] = write_gguf(src, root / f"m{len(cache)}.gguf", "qwen3_moe", qtype, types=types)
        return cache[key]

    get.src, get.root = src, root  # type: ignore[attr-defined]
    return get


def _twin_logits(files, qtype: str, ids: torch.Tensor) -> torch.Tensor:
    twin = dequantized_twin(files.src, files.root / f"twin_{qtype}", "qwen3_moe", qtype)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _token_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Median over tokens of the mean |logit error| of each (logits [1, T, V])."""
    return (got - want).abs().mean(-1).median().item()


def _run(path: Path, mode: str, ids: torch.Tensor, residual: str = "bf16") -> tuple[torch.Tensor, dict]:
    """Logits and stats of the file at precision `mode`; the bf16 step unless `residual` says otherwise (a GGUF file
    runs the wide step by default, runtime/wire.py)."""
    rt = replace(BF16, residual=residual)
    with moetier.load(path, EngineConfig(runtime=rt, precision=PrecisionConfig(mode=mode))) as engine:
        return engine.logits(ids).float(), engine.stats()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "IQ4_XS", "Q4_0"])
def test_auto_computes_gguf_experts_as_stored(files, qtype):
    assert ggml.available(), ggml.load_error()
    path = files(qtype)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(7))
    got, st = _run(path, "auto", ids)
    full, ref = _run(path, "full", ids)
    want = _twin_logits(files, qtype, ids)
    blck, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert st["executor"] == "native" and st["native_step"]["moe"] == "native"
    assert st["native_step"]["torch_moe_calls"] == 0 and st["native"]["native_calls"] > 0
    cfg = json.loads((files.src / "config.json").read_text())
    o_in = cfg["num_attention_heads"] * cfg["head_dim"]  # o_proj's K: the writer keeps rows of partial blocks F32
    assert st["dense_stored"] == 2 * (1 + (o_in % blck == 0)) + 1  # per layer q/k/v (and o), and the head
    assert ref["dense_stored"] == 0
    held = st["precision"]["stored"]
    per_expert = 3 * 256 * 256 // blck * size  # gate, up, down: the file's own bytes
    assert held["bytes"] == held["experts"] * per_expert  # the slots count stored bytes
    assert ref["precision"]["full"]["bytes"] == ref["precision"]["full"]["experts"] * 3 * 256 * 256 * 2
    scale = want.abs().max().item()
    assert scale > 1.0
    err, bf16_err = _token_err(got, want), _token_err(full, want)
    assert err <= 3.0 * bf16_err, f"token error {err:.4f} against the bf16 engine's {bf16_err:.4f}"
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.75
    wide, st = _run(path, "auto", ids, residual="auto")  # a GGUF file's default: the wide step
    assert st["native_step"]["residual"] == "fp32" and st["native_step"]["torch_moe_calls"] == 0
    # no further from the dequantised model than the bf16 step (seen: 0.26x for Q4_K, 0.82-0.98x for the rest)
    assert _token_err(wide, want) <= 1.05 * err


def test_generate_on_stored_experts_matches_full_greedy_start(files):
    path = files("Q8_0")
    prompt = list(range(5, 17))
    out = {}
    for mode in ("auto", "full"):
        with moetier.load(path, EngineConfig(runtime=BF16, precision=PrecisionConfig(mode=mode))) as engine:
            out[mode] = engine.generate(prompt, max_new_tokens=4, stop_at_eos=False).token_ids
    assert out["auto"][0] == out["full"][0]  # Q8_0: the first greedy token survives the activation blocks


def test_fp32_models_and_explicit_full_decode_as_before(files):
    path = files("Q4_K")
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    fp32 = RuntimeConfig(device="cpu", dtype="fp32", lean=False)
    with moetier.load(path, EngineConfig(runtime=fp32)) as engine:  # exactness runs decode to fp32
        engine.logits(ids)
        assert set(engine.stats()["precision"]) == {"full"}
    _, st = _run(path, "full", ids)
    assert set(st["precision"]) == {"full"}


def test_a_mixed_file_runs_each_layer_in_its_own_type(files):
    """Q4_K_M-style: layer 1's down projections in Q6_K, the rest Q4_K. Slots of the larger layout hold either;
    each layer's experts are read and computed in their own type, by the native kernels."""
    types = {"blk.1.ffn_down_exps.weight": "Q6_K"}
    path = files("Q4_K", types)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    got, st = _run(path, "auto", ids)
    full, _ = _run(path, "full", ids)
    assert set(st["precision"]) == {"stored"}
    assert st["native_step"]["moe"] == "native" and st["native_step"]["torch_moe_calls"] == 0
    assert st["native_step"]["unreadable_slots"] == 0
    q4k, q6k = (GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in ("Q4_K", "Q6_K"))
    slot = 2 * 256 * 256 // q4k[0] * q4k[1] + 256 * 256 // q6k[0] * q6k[1]  # the larger layout: Q6_K down
    held = st["precision"]["stored"]
    assert held["bytes"] == held["experts"] * slot
    twin_name = "Q4_K_mixed"
    twin = dequantized_twin_mixed(files, twin_name, types)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits.float()
    err, bf16_err = _token_err(got, want), _token_err(full, want)
    assert err <= 3.0 * bf16_err, f"token error {err:.4f} against the bf16 engine's {bf16_err:.4f}"
    # the torch path (no native executor) reads the same slots per layer
    with moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="bf16", native_kernels=False),
                                         precision=PrecisionConfig(mode="stored"))) as engine:  # fmt: skip
        slow = engine.logits(ids).float()
        assert engine.stats()["executor"] == "dense"
    assert _token_err(slow, want) <= 3.0 * bf16_err


def dequantized_twin_mixed(files, name: str, types: dict[str, str]) -> Path:
    return dequantized_twin(files.src, files.root / f"twin_{name}", "qwen3_moe", "Q4_K", types=types)


def test_dynamic_precision_with_stored_cold_experts_stays_native(files):
    """--precision dynamic --hi full --lo stored on a mixed GGUF: bf16 slots and stored slots of both layouts in one
    engine, every MoE half on the native kernels (the slot table serves each layer its layout and the bf16 rows)."""
    types = {"blk.1.ffn_down_exps.weight": "Q6_K"}
    path = files("Q4_K", types)
    prec = PrecisionConfig(mode="dynamic", hi="full", lo="stored", warmup_tokens=0, period=4)
    cfg = EngineConfig(runtime=BF16, budgets=Budgets(host_expert_bytes=6 << 20), precision=prec)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    with moetier.load(path, cfg) as engine:
        got = engine.logits(ids).float()
        engine.generate(list(range(5, 17)), max_new_tokens=8, stop_at_eos=False)
        st = engine.stats()
    assert set(st["precision"]) == {"full", "stored"}
    assert st["native_step"]["moe"] == "native" and st["native_step"]["torch_moe_calls"] == 0
    full, _ = _run(path, "full", ids)
    twin = dequantized_twin_mixed(files, "Q4_K_mixed", types)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits.float()
    assert _token_err(got, want) <= 3.0 * _token_err(full, want)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_q4_0_and_q8_0_slots_are_re_laid_for_our_kernels_and_decode_exactly(files, qtype):
    """Q4_0 / Q8_0 experts run on our own kernels (faster than ggml's vec_dot on them, docs/engine.md): each slot's
    blocks are split into their quants and fp16 scales in place after the read (kind | SF16 in the descriptor),
    and the torch path still decodes them to exactly the file's values."""
    from safetensors.torch import load_file

    from moetier.kernels.decode import SF16
    from moetier.kernels.stored import for_layer
    from moetier.types import ExpertKey

    path = files(qtype)
    twin_dir = dequantized_twin(files.src, files.root / f"twin_{qtype}", "qwen3_moe", qtype)
    twin = load_file(twin_dir / "model.safetensors")
    with moetier.load(path, EngineConfig(runtime=BF16)) as engine:
        engine.logits(torch.tensor([[5, 6, 7]]))
        table = engine.executor_state.table
        key = ExpertKey(1, 2)
        views = for_layer(engine.store.acquire(key), key.layer)
        try:
            assert views.w13.relaid == qtype and views.w2.relaid == qtype
            row = table.table[next(i for i, (_, v) in enumerate(table._owners) if v is views)].tolist()
            bits = 4 if qtype == "Q4_0" else 8
            assert row[1] == bits | SF16 and row[10] == bits | SF16 and row[2] == 32 and row[4] >= 0
            w13 = views.w13.decode(torch.float32)
            pre = "model.layers.1.mlp.experts.2."
            want = torch.cat([twin[pre + "gate_proj.weight"], twin[pre + "up_proj.weight"]]).float()
            assert torch.equal(w13, want)
            assert torch.equal(views.w2.decode(torch.float32), twin[pre + "down_proj.weight"].float())
        finally:
            engine.store.release(key)
