"""Intra-expert sparsity across model families: calibrate a tiny random checkpoint of each
SwiGLU family, then the gather path (always) and the masked dense path (always) must give the
same logits, hit the target on the calibration tokens, and leave shared experts dense; GPT-OSS
is refused with a message that names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetier
from moetier.config import EngineConfig, SparsityConfig
from moetier.errors import ConfigError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.qtier import source_fingerprint
from moetier.kernels.sparse import default_table_path
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.calibrate import calibrate, model_identity

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3"]


def _calibrated(model_type: str, out: Path) -> tuple[Path, list[int]]:
    path = build_tiny_checkpoint(model_type, out / model_type, seed=3)
    ids = torch.randint(0, 64, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    with moetier.load(path) as eng:
        ident = model_identity(eng.info, source_fingerprint(CheckpointIndex(path))["fingerprint"])
        calibrate(eng, ids, 48, ident, "silu", {"text": "random ids"}).save(default_table_path(path))
    return path, ids


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gather_and_dense_paths_agree_per_family(model_type: str, tmp_path: Path) -> None:
    path, ids = _calibrated(model_type, tmp_path)
    x = torch.tensor([ids[:48]])
    with moetier.load(path) as dense:
        ref = dense.logits(x)
    out = {}
    for name, tipping in (("gather", 1000), ("dense", 0)):
        cfg = EngineConfig(sparsity=SparsityConfig(target=0.6, tipping=tipping))
        with moetier.load(path, cfg) as eng:
            out[name] = eng.logits(x)
            sp = eng.stats()["sparsity"]
            assert abs(sp["achieved"] - 0.6) < 0.08, sp
            calls = [(v["sparse_calls"], v["dense_calls"]) for v in sp["layers"].values()]
            assert all((s > 0) == (name == "gather") and (d > 0) == (name == "dense") for s, d in calls), calls
    torch.testing.assert_close(out["gather"], out["dense"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out["gather"], ref, atol=1e-3)  # 60% of routed neurons skipped changes logits


def test_shared_experts_stay_dense(tmp_path: Path) -> None:
    """qwen2_moe has a gated shared expert: with every routed neuron skipped (threshold above any
    activation), the MoE output must be exactly the shared expert's."""
    path, _ = _calibrated("qwen2_moe", tmp_path)
    cfg = EngineConfig(sparsity=SparsityConfig(target=0.5, tipping=1000))
    with moetier.load(path, cfg) as eng:
        block = eng.loaded.blocks[0]
        block.pipeline.executor.threshold = float("inf")
        x = torch.randn(1, 5, eng.info.hidden_size)
        with torch.inference_mode():
            y = block(x)
            shared = block.shared(x.reshape(-1, x.shape[-1])).reshape(x.shape)
    torch.testing.assert_close(y[0] if isinstance(y, tuple) else y, shared)


def test_gpt_oss_is_refused(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    with pytest.raises(ConfigError, match="gpt_oss experts are not supported"):
        moetier.load(path, EngineConfig(sparsity=SparsityConfig(target=0.5)))
