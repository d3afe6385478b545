"""Shared fixtures: tiny checkpoints and transformers reference models, built once per session.

Everything here is CPU-only and offline. Checkpoints come from moetier.models.tiny
(random, seeded), are written once per session under tmp_path_factory and must be
treated as read-only; tests that damage a checkpoint copy it first (`ckpt_copy`).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# tiny models: one thread is fastest and immune to oversubscription on a shared 2-core machine
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import AutoModelForCausalLM

from moetier.models.tiny import TINY, build_tiny_checkpoint

# Hypothesis: no per-example deadline and no too_slow health check. Examples run the engine, torch kernels and
# the simulators; on a busy 2-core machine one of them can take seconds, which is not a failure of the property.
# Per-test @settings still set max_examples etc. (their deadline=None just repeats this). The examples are drawn
# from a fixed seed (`derandomize`), so the README's test command runs the same ones every time and on every
# machine: a property that fails is found by a developer exploring (HYPOTHESIS_PROFILE=explore: fresh random
# examples each run), fixed, and its example pinned with @example, not met by chance in someone else's CI run.
settings.register_profile("moetier", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moetier"))

FAMILY_NAMES = tuple(TINY)  # every family the project ships a tiny checkpoint for

# Where each family keeps its routed experts in the checkpoint, written out by hand
# (independent of moetier.models.families) so the tests check the family table too.
# per-expert: (block name, gate, up, down) ; fused: gpt_oss only.
PER_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def _build(family: str, variant: str, out: Path) -> Path:
    """variants: fp32, bf16 (weights stored as bf16), tied (tie_word_embeddings), sharded (~20 KB shards
    plus model.safetensors.index.json; same weights as fp32)."""
    if variant == "fp32":
        return build_tiny_checkpoint(family, out)
    if variant == "bf16":
        return build_tiny_checkpoint(family, out, dtype=torch.bfloat16)
    if variant == "tied":
        return build_tiny_checkpoint(family, out, tie_word_embeddings=True)
    if variant == "sharded":
        src = build_tiny_checkpoint(family, out.with_name(out.name + "_src"))
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.save_pretrained(out, max_shard_size="20KB")
        return out
    raise KeyError(variant)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_ckpt(family, variant="fp32") -> folder of a tiny checkpoint (built once, read-only)."""
    cache: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(family: str, variant: str = "fp32") -> Path:
        key = (family, variant)
        if key not in cache:
            cache[key] = _build(family, variant, root / f"{family}_{variant}")
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt: Callable[..., Path]) -> Callable[..., torch.nn.Module]:
    """hf_model(family, variant="fp32") -> the transformers reference in fp32, loaded once."""
    cache: dict[tuple[str, str], torch.nn.Module] = {}

    def get(family: str, variant: str = "fp32") -> torch.nn.Module:
        key = (family, variant)
        if key not in cache:
            path = tiny_ckpt(family, variant)
            cache[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[key]

    return get


@pytest.fixture
def ckpt_copy(tiny_ckpt: Callable[..., Path], tmp_path: Path) -> Callable[..., Path]:
    """ckpt_copy(family, variant="fp32", config=None) -> a private, writable copy of a tiny checkpoint;
    `config` fields overwrite those of its config.json."""

    def get(family: str, variant: str = "fp32", config: dict[str, Any] | None = None) -> Path:
        dst = tmp_path / f"{family}_{variant}"
        shutil.copytree(tiny_ckpt(family, variant), dst)
        if config:
            cfg_file = dst / "config.json"
            cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | config))
        return dst

    return get


def canonical_experts_of(path: Path, family: str) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """(layer, expert) -> canonical fp32 pieces {gate [I,H], up [I,H], down [H,I], (biases)} read with
    safetensors.torch.load_file, following the families' checkpoint conventions by hand."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        sd.update(load_file(file))
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    if family == "gpt_oss":
        for name, t in sd.items():
            if not name.endswith("mlp.experts.gate_up_proj"):
                continue
            layer = int(name.split(".")[2])
            p = f"model.layers.{layer}.mlp.experts."
            gate_up, gu_bias = sd[p + "gate_up_proj"].float(), sd[p + "gate_up_proj_bias"].float()  # [E, H, 2I]
            down, d_bias = sd[p + "down_proj"].float(), sd[p + "down_proj_bias"].float()  # [E, I, H]
            for e in range(t.shape[0]):
                out[(layer, e)] = {
                    "gate": gate_up[e].T[0::2], "up": gate_up[e].T[1::2], "down": down[e].T,
                    "gate_bias": gu_bias[e][0::2], "up_bias": gu_bias[e][1::2], "down_bias": d_bias[e],
                }  # fmt: skip
        return out
    block, gate, up, down = PER_EXPERT_NAMES[family]
    for name in sd:
        parts = name.split(".")
        # model.layers.{L}.{block}.experts.{e}.{gate}.weight
        if len(parts) == 8 and parts[3] == block and parts[4] == "experts" and parts[6] == gate:
            layer, e = int(parts[2]), int(parts[5])
            p = f"model.layers.{layer}.{block}.experts.{e}."
            out[(layer, e)] = {
                "gate": sd[p + gate + ".weight"].float(),
                "up": sd[p + up + ".weight"].float(),
                "down": sd[p + down + ".weight"].float(),
            }
    return out


@pytest.fixture(scope="session")
def canonical_experts(
    tiny_ckpt: Callable[..., Path],
) -> Callable[..., dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """canonical_experts(family, variant="fp32") -> {(layer, e): {piece: tensor}} from the files."""
    cache: dict[tuple[str, str], dict[tuple[int, int], dict[str, torch.Tensor]]] = {}

    def get(family: str, variant: str = "fp32") -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        if (family, variant) not in cache:
            cache[(family, variant)] = canonical_experts_of(tiny_ckpt(family, variant), family)
        return cache[(family, variant)]

    return get


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small UTF-8 text of the CLI tests' sentences (test_cli.SENTENCES, which their tokenizer knows)."""
    from test_cli import SENTENCES

    path = tmp_path_factory.mktemp("text") / "sample.txt"
    path.write_text("\n".join(SENTENCES * 3), encoding="utf-8")
    return path
