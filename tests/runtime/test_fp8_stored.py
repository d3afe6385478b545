"""Block-scaled FP8 experts computed as stored (`--precision stored`, store/source.py StoredFp8Source): the slots
hold the checkpoint's e4m3fn bytes and its scale grid (fp32, one grid row per weight row; kernels/fp8.py), and the
native executor and decode step read them (kernel kind 9, csrc/mm.c `mm_f8`); so do the attention projections
(`fp8_dense`: the decode step's dense weights of kind 9).

Reference: fp32 transformers on the dequantized twin. The bf16 engine with `--precision full` rounds every
dequantized weight (fp8 x scale) to bf16; as stored the scale is applied in fp32, so per token (median over tokens
of the mean |logit difference|) the stored run is held to the full run's error (times 1.5 for summation order);
a wrong byte, row block or scale is off by the logits' scale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moetier
from moetier import EngineConfig, PrecisionConfig, RuntimeConfig
from moetier.kernels.decode import KIND_F8
from moetier.models.tiny import build_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from quant_ref import convert

BF16 = RuntimeConfig(device="cpu", dtype="bf16")
SIZES = {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64}
# (row block, column block): square 32s; row blocks larger than a matrix (128 rows of gate's 64: one grid row),
# and 16 (four grid rows per 64); wide column blocks
BLOCKS = [(32, 32), (128, 32), (16, 64), (64, 64)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fp8_stored")
    src = build_tiny_checkpoint("qwen3_moe", root / "src", **SIZES)
    cache: dict[tuple[int, int], tuple[Path, Path]] = {}

    def get(block: tuple[int, int]) -> tuple[Path, Path]:
        if block not in cache:
            quant, twin = root / f"fp8_{block[0]}x{block[1]}", root / f"twin_{block[0]}x{block[1]}"
            convert(src, quant, twin, "fp8", block=block)
            cache[block] = (quant, twin)
        return cache[block]

    return get


def _run(path: Path, mode: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    with moetier.load(path, EngineConfig(runtime=BF16, precision=PrecisionConfig(mode=mode))) as engine:
        out = engine.logits(ids).float()
        st = engine.stats()
        table = engine.executor_state.table if engine.executor_state is not None else None
        kinds = sorted({int(k) for k in table.table[:, 1].tolist()}) if table is not None else []
        return out, st | {"_kinds": kinds}


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_checkpoints_run_as_stored_on_the_native_kernels(checkpoints, block):
    quant, twin = checkpoints(block)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    got, st = _run(quant, "stored", ids)
    full, ref = _run(quant, "full", ids)
    assert set(st["precision"]) == {"stored"}
    assert st["executor"] == "native" and st["native_step"]["moe"] == "native"
    assert st["native_step"]["torch_moe_calls"] == 0 and st["native_step"]["unreadable_slots"] == 0
    assert st["_kinds"] == [KIND_F8]
    # the attention projections as stored too (kind 9 QDense; q/k/v fused): every layer's q/k/v at least (K = the
    # hidden size, a multiple of every column block here), none with everything decoded at load
    layers = json.loads((quant / "config.json").read_text())["num_hidden_layers"]
    assert st["dense_stored"] >= layers and ref["dense_stored"] == 0
    held, full_held = st["precision"]["stored"], ref["precision"]["full"]
    per, full_per = held["bytes"] / held["experts"], full_held["bytes"] / full_held["experts"]
    assert 0.5 * full_per <= per < 0.6 * full_per  # a byte a weight, fp32 scales per column block, alignment
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids).logits.float()

    def token_err(x: torch.Tensor) -> float:
        return (x - want).abs().mean(-1).median().item()

    assert token_err(got) <= 1.5 * token_err(full), (token_err(got), token_err(full))
    # per token, stored and full agree closely; a router near-tie may flip one token's experts under the attention's
    # different rounding (fp32 scales as stored, bf16 weights when decoded), so the median token is what is bounded
    assert (got - full).abs().amax(-1).median().item() < 0.05 * want.abs().max().item()


def test_auto_precision_computes_fp8_as_stored(checkpoints):
    quant, _ = checkpoints((32, 32))
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    _, st = _run(quant, "auto", ids)
    assert set(st["precision"]) == {"stored"} and st["_kinds"] == [KIND_F8]


def test_ragged_column_blocks_stay_on_the_decoding_path(tmp_path):
    """Column blocks that are no multiple of 32 (16) are not the kernel's groups: the stored slots decode per call,
    as before."""
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "src", **SIZES)
    quant, twin = tmp_path / "q", tmp_path / "t"
    convert(src, quant, twin, "fp8", block=(32, 16))
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    _, st = _run(quant, "stored", ids)
    assert st["executor"] == "dense" and set(st["precision"]) == {"stored"}
