"""Intra-expert sparsity across model families: calibrate a tiny random checkpoint of each
SwiGLU family, then the gather path (always) and the masked dense path (always) must give the
same logits, hit the target on the calibration tokens, and leave shared experts dense; GPT-OSS
is refused with a message that names it.

The target is the paper's total activation sparsity by default: on the families with shared experts
(qwen2_moe: one gated shared expert of 24 neurons; deepseek_v2/v3: one of 16) the shared neurons count
as active, so the routed experts skip target * (k*I + S) / (k*I); `scope="routed"` targets the routed
experts alone. Above the tipping point the default dense path is the original expert: exact."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import moetier
from moetier.config import EngineConfig, RuntimeConfig, SparsityConfig
from moetier.errors import ConfigError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.qtier import source_fingerprint
from moetier.kernels.sparse import default_table_path
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.calibrate import calibrate, model_identity
from moetier.runtime.executors.sparse import shared_neurons
from moetier.runtime.moe_block import TieredExperts

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3"]
SHARED = {"mixtral": 0, "qwen2_moe": 24, "olmoe": 0, "deepseek_v2": 16, "deepseek_v3": 16}  # neurons per token
ROUTED = {"mixtral": 2 * 48, "qwen2_moe": 2 * 16, "olmoe": 2 * 16, "deepseek_v2": 2 * 16, "deepseek_v3": 2 * 16}
TARGET = 0.5


def _calibrated(model_type: str, out: Path) -> tuple[Path, list[int]]:
    path = build_tiny_checkpoint(model_type, out / model_type, seed=3)
    ids = torch.randint(0, 64, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    with moetier.load(path) as eng:
        ident = model_identity(eng.info, source_fingerprint(CheckpointIndex(path))["fingerprint"])
        calibrate(eng, ids, 48, ident, "silu", {"text": "random ids"}).save(default_table_path(path))
    return path, ids


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gather_and_dense_paths_agree_per_family(model_type: str, tmp_path: Path) -> None:
    """Total target 0.5: the routed experts skip 0.5 * (k*I + S) / (k*I) of their neurons; the achieved
    total sparsity (shared neurons counted as active) is 0.5 on both paths."""
    path, ids = _calibrated(model_type, tmp_path)
    x = torch.tensor([ids[:48]])
    with moetier.load(path) as dense:
        ref = dense.logits(x)
    routed_target = TARGET * (ROUTED[model_type] + SHARED[model_type]) / ROUTED[model_type]
    out = {}
    for name, tipping in (("gather", 1000), ("dense", 0)):
        cfg = EngineConfig(sparsity=SparsityConfig(target=TARGET, tipping=tipping, dense="masked"))
        with moetier.load(path, cfg) as eng:
            out[name] = eng.logits(x)
            sp = eng.stats()["sparsity"]
            assert sp["scope"] == "total" and sp["shared_neurons_per_token"] == SHARED[model_type], sp
            assert sp["routed_neurons_per_token"] == ROUTED[model_type]
            assert sp["routed_target"] == pytest.approx(routed_target, abs=1e-4)
            assert abs(sp["achieved"] - TARGET) < 0.08, sp
            assert sp["achieved"] == sp["achieved_total"] == sp["achieved_masked"]
            assert abs(sp["achieved_routed"] - routed_target) < 0.08, sp
            if SHARED[model_type]:
                assert sp["achieved_routed"] > sp["achieved_total"] + 0.1
            calls = [(v["sparse_calls"], v["dense_calls"]) for v in sp["layers"].values()]
            assert all((s > 0) == (name == "gather") and (d > 0) == (name == "dense") for s, d in calls), calls
    torch.testing.assert_close(out["gather"], out["dense"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out["gather"], ref, atol=1e-3)  # half the neurons skipped changes logits


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v2"])
def test_routed_scope_and_the_largest_total_target(model_type: str, tmp_path: Path) -> None:
    """scope "routed": the target is the routed experts' own sparsity, the total one is lower by the shared
    share; a total target that would need more than the table's 0.99 of the routed neurons is refused,
    naming the largest one this model allows."""
    path, ids = _calibrated(model_type, tmp_path)
    x = torch.tensor([ids[:48]])
    routed, shared = ROUTED[model_type], SHARED[model_type]
    cfg = EngineConfig(sparsity=SparsityConfig(target=TARGET, tipping=1000, scope="routed"))
    with moetier.load(path, cfg) as eng:
        eng.logits(x)
        sp = eng.stats()["sparsity"]
    assert sp["scope"] == "routed" and sp["routed_target"] == TARGET
    assert sp["achieved"] == sp["achieved_routed"] and abs(sp["achieved"] - TARGET) < 0.08
    # the two scopes count the same skipped pairs: total = routed * (k*I) / (k*I + S)
    assert sp["achieved_total"] == pytest.approx(sp["achieved_routed"] * routed / (routed + shared), abs=2e-4)
    top = 0.99 * routed / (routed + shared)
    too_high = round(top + 0.01, 2)
    with pytest.raises(ConfigError, match=rf"largest total target for this model is {top:.3f}.*--sparsity-scope"):
        moetier.load(path, EngineConfig(sparsity=SparsityConfig(target=too_high)))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_original_dense_expert_above_the_tipping_point_is_exact(model_type: str, tmp_path: Path) -> None:
    """The paper's switch: at or above the tipping point the original dense expert runs, so with tipping 0
    the sparse engine's logits are the unsparsified engine's, shared experts and all: equal up to fp32
    summation order (the sparse layout stores the down projection as rows, which the matmul reads
    transposed), far inside the exactness tolerance (1e-4)."""
    path, ids = _calibrated(model_type, tmp_path)
    x = torch.tensor([ids[:48]])
    with moetier.load(path) as dense:
        ref = dense.logits(x)
    with moetier.load(path, EngineConfig(sparsity=SparsityConfig(target=TARGET, tipping=0))) as eng:
        got = eng.logits(x)
        sp = eng.stats()["sparsity"]
    assert sp["dense_path"] == "original" and sp["achieved"] == 0.0
    assert (got - ref).abs().max().item() <= 1e-5


def test_shared_neurons_of_family_rows_and_the_seam(tmp_path: Path) -> None:
    """The shared-expert count reads the family row's `shared_attr` on the module that holds each of our
    blocks, so it is the same for a family row and for transformers' own block behind the experts seam
    (which --sparsity does not run yet: its experts are the family module's own function)."""
    for model_type in ("qwen2_moe", "deepseek_v2", "mixtral"):
        path = build_tiny_checkpoint(model_type, tmp_path / model_type, seed=3)
        for seam in (False, True):
            with moetier.load(path, EngineConfig(runtime=RuntimeConfig(seam=seam))) as eng:
                assert all(isinstance(b, TieredExperts) == seam for b in eng.loaded.blocks)
                assert shared_neurons(eng.loaded) == SHARED[model_type], (model_type, seam)


def test_shared_experts_the_family_row_does_not_name_are_refused(tmp_path: Path) -> None:
    """A config that declares shared experts while the family row names no shared-expert module must not
    count them as 0 (that would mistarget total sparsity): ConfigError naming the config field."""
    path = build_tiny_checkpoint("qwen2_moe", tmp_path / "qwen2_moe", seed=3)
    with moetier.load(path) as eng:
        loaded = dataclasses.replace(eng.loaded, family=dataclasses.replace(eng.loaded.family, shared_attr=None))
        with pytest.raises(ConfigError, match=r"declares shared experts.*shared_expert_intermediate_size"):
            shared_neurons(loaded)


def test_shared_experts_stay_dense(tmp_path: Path) -> None:
    """qwen2_moe has a gated shared expert: with every routed neuron skipped (threshold above any
    activation), the MoE output must be exactly the shared expert's."""
    path, _ = _calibrated("qwen2_moe", tmp_path)
    cfg = EngineConfig(sparsity=SparsityConfig(target=0.4, tipping=1000))
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
