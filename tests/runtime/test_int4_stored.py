"""GPTQ / AWQ / compressed-tensors int4 experts computed as stored (`--precision stored`, store/source.py
StoredIntSource): the slots hold the checkpoint's 4-bit values, integer zeros and own scales (fp16 / bf16) in the
native int4 layout, and the native executor and decode step read them (kernels: kind 4 | MT_SF16 for fp16); the
quantised attention projections are computed as stored the same way (decode.int4_dense).

Reference: the same checkpoint with `--precision full` (experts dequantized into bf16 slots). The two differ by
the int4 kernels' 8-bit activation blocks; per token (median over tokens of the mean |logit difference|) within
3x the bf16 engine's own error against fp32 transformers on the dequantized twin (the bound of
tests/runtime/test_gguf_stored.py); a wrong nibble order, zero or group is off by the logits' scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moetier
from moetier import EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.kernels.decode import SF16
from moetier.models.tiny import build_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from quant_ref import convert

BF16 = RuntimeConfig(device="cpu", dtype="bf16")
SIZES = {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64}  # groups of 32 along K
CASES = {
    "gptq_v1_g32": ("gptq", {"group": 32, "sym": False, "v1": True, "act_order": False}),
    "gptq_v2_noidx_sym": ("gptq", {"group": 32, "sym": True, "v1": False, "act_order": False, "drop_g_idx": True}),
    "awq_g32": ("awq", {"group": 32}),
    "ct_asym_g32": ("compressed-tensors", {"group": 32, "sym": False}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("int4_stored")
    src = build_tiny_checkpoint("qwen3_moe", root / "src", **SIZES)
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            method, opts = CASES[name]
            quant, twin = root / name, root / f"{name}_twin"
            convert(src, quant, twin, method, **opts)
            cache[name] = (quant, twin)
        return cache[name]

    return get


def _run(path: Path, mode: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    with moetier.load(path, EngineConfig(runtime=BF16, precision=PrecisionConfig(mode=mode))) as engine:
        out = engine.logits(ids).float()
        st = engine.stats()
        table = engine.executor_state.table if engine.executor_state is not None else None
        kinds = sorted({int(k) for k in table.table[:, 1].tolist()}) if table is not None else []
        return out, st | {"_kinds": kinds}


@pytest.mark.parametrize("name", sorted(CASES))
def test_int4_checkpoints_run_as_stored_on_the_native_kernels(checkpoints, name):
    quant, twin = checkpoints(name)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    got, st = _run(quant, "stored", ids)
    full, ref = _run(quant, "full", ids)
    assert set(st["precision"]) == {"stored"}
    assert st["executor"] == "native" and st["native_step"]["moe"] == "native"
    assert st["native_step"]["torch_moe_calls"] == 0 and st["native_step"]["unreadable_slots"] == 0
    assert st["dense_stored"] >= 2 and ref["dense_stored"] == 0  # the attention projections as stored too
    fp16 = name.startswith(("gptq", "awq"))  # their scales are fp16; compressed-tensors' here bf16
    assert st["_kinds"] == [4 | SF16] if fp16 else [4]
    held, full_held = st["precision"]["stored"], ref["precision"]["full"]
    assert held["bytes"] / held["experts"] < 0.4 * full_held["bytes"] / full_held["experts"]  # 4-bit slots
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits.float()

    def token_err(x: torch.Tensor) -> float:
        return (x - want).abs().mean(-1).median().item()

    assert token_err(got) <= 3.0 * token_err(full), (token_err(got), token_err(full))


def test_act_order_gptq_stays_on_the_decoding_path(checkpoints, tmp_path):
    """Non-sequential g_idx (act-order) is no run of groups along K: stored slots decode per call, as before."""
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src", **SIZES)
    quant, twin = tmp_path / "q", tmp_path / "t"
    convert(src, quant, twin, "gptq", group=32, sym=False, v1=False, act_order=True)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    _, st = _run(quant, "stored", ids)
    assert st["executor"] == "dense" and set(st["precision"]) == {"stored"}


def test_dense_precision_quantises_only_what_the_file_keeps_in_bf16(checkpoints):
    """--dense-precision int8 on a GPTQ checkpoint: its int4 attention stays as stored, the bf16 output head goes
    to 8 bits (what the flag does for any checkpoint's bf16 dense weights)."""
    quant, twin = checkpoints("gptq_v1_g32")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    rt = RuntimeConfig(device="cpu", dtype="bf16", dense_precision="int8")
    with moetier.load(quant, EngineConfig(runtime=rt, precision=PrecisionConfig(mode="stored"))) as engine:
        got = engine.logits(ids).float()
        st = engine.stats()
        head = engine.decoder.lm_head
    assert st["dense_stored"] >= 2 and st["dense_precision"] == "int8"
    assert head.bits == 8 and head.scale.dtype == torch.bfloat16  # the head: quantised here, not stored
    full, _ = _run(quant, "full", ids)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits.float()
    err = (got - want).abs().mean(-1).median().item()
    assert err <= 3.0 * (full - want).abs().mean(-1).median().item()
