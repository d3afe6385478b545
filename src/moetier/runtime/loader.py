"""Opening a checkpoint folder into a model whose MoE blocks are TieredMoE, over a tiered store.

Not the wiring (runtime/wire.py is): this module builds the parts wire.py connects, in two
calls so the wiring can refuse a combination, or a bad sparsity table, before any pool is
allocated:
1. `open_skeleton`: config, family, checkpoint index, dtype, the model skeleton (parameters on
   meta), its MoE sites and the expert reader (no pool, no weights);
2. `build_model`: the tiered store, the MoE blocks swapped for TieredMoE (not yet attached to
   an executor), every other weight loaded, leftovers refused.

Invariants: a checkpoint tensor is either an expert's (read through the store) or loaded here,
never neither (`check_all_consumed`); the non-expert weights' bytes are reserved on their
device before the pools are sized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from moetier.config import EngineConfig
from moetier.models import seam
from moetier.models.base import check_all_consumed, ignored_unexpected, load_non_experts
from moetier.models.families import Family
from moetier.models.open import ModelInfo, Opened, model_info, open_checkpoint, resolve_device
from moetier.policies.memory import MemoryNeeds, MemoryPlan
from moetier.runtime.moe_block import TieredExperts, TieredMoE
from moetier.runtime.precision import build_store
from moetier.store.dynamic import DynamicStore
from moetier.store.store import ExpertStore


@dataclass
class Skeleton:
    """Step 1: an opened checkpoint without pools or weights."""

    path: str | os.PathLike[str]
    device: torch.device
    opened: Opened
    info: ModelInfo

    def close(self) -> None:
        """Release the checkpoint's file descriptors (when the store was never built)."""
        self.opened.reader.close()


@dataclass
class LoadedModel:
    info: ModelInfo
    family: Family
    config: PretrainedConfig
    model: nn.Module
    blocks: list[TieredMoE | TieredExperts]
    store: ExpertStore | DynamicStore
    dtype: torch.dtype
    device: torch.device
    index: Any = None  # the checkpoint's CheckpointIndex (non-expert tensors as stored, for the decoder)
    memory: MemoryPlan | None = None  # how --memory was spent (runtime/memory.py), None without it
    disk_io: Any = None  # the expert reader's formats/diskio.py DiskIO (Engine.stats()["disk_io"])


def open_skeleton(path: str | os.PathLike[str], cfg: EngineConfig) -> Skeleton:
    """1-3. config, index, dtype, skeleton, MoE sites, expert reader."""
    device = resolve_device(cfg.runtime.device)
    o = open_checkpoint(path, cfg.runtime.dtype, device, down_rows=cfg.sparsity.enabled, seam=cfg.runtime.seam)
    info = model_info(path, o)
    return Skeleton(path, device, o, info)


def build_model(sk: Skeleton, cfg: EngineConfig, needs: MemoryNeeds | None = None) -> LoadedModel:
    """4-5. the store, the TieredMoE blocks, every other weight; with --memory (`needs`: what the process holds
    besides experts) the store's host expert budget is the rest of it."""
    o, device = sk.opened, sk.device
    config, family, model, sites, dtype = o.config, o.family, o.model, o.sites, o.dtype
    fn = o.expert_fn
    # 4. the tiered store; the non-expert weights' bytes are reserved on their device before
    #    the pools are sized
    non_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) * dtype.itemsize
    store, plan = build_store(o.reader, sk.path, cfg, dtype, device, reserve=non_expert, top_k=sk.info.top_k,
                              needs=needs)  # fmt: skip
    # 5. swap the blocks, load everything else, refuse leftovers (a refusal closes the store it made)
    try:
        blocks: list[TieredMoE | TieredExperts] = []
        for site in sites:
            parent_path, attr = site.path.rsplit(".", 1)
            parent = model.get_submodule(parent_path)
            if family.seam:  # transformers' block keeps routing; its experts module becomes ours
                block: TieredMoE | TieredExperts = TieredExperts(site.layer, o.num_experts, store, fn)
            else:
                block = TieredMoE(family, site.block, site.layer, o.num_experts, store, fn)
            setattr(parent, attr, block)
            blocks.append(block)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        converted = seam.converted_names(family.conversions)  # the seam: tensors transformers converts
        consumed = load_non_experts(model, o.index, sites, family, dtype, tied, skip=converted.__contains__)
        consumed |= seam.load_converted(model, o.index, family.conversions, dtype)
        check_all_consumed(o.index, consumed | o.reader.consumed, ignored_unexpected(model))
        model.to(device)
    except BaseException:
        store.close()
        raise
    return LoadedModel(sk.info, family, config, model, blocks, store, dtype, device, o.index, plan,
                       disk_io=o.reader.io)  # fmt: skip
