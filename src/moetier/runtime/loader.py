"""Opens a checkpoint folder into a model whose MoE blocks are TieredMoE.

The one place that wires config -> family -> checkpoint index -> store -> model.
Steps are numbered in `open_model`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from moetier.config import EngineConfig
from moetier.formats.qtier import source_fingerprint
from moetier.kernels.sparse import ThresholdTable, default_table_path
from moetier.models.base import check_all_consumed, ignored_unexpected, load_non_experts
from moetier.models.families import Family
from moetier.models.open import ModelInfo, expert_fn_for, model_info, open_checkpoint, resolve_device
from moetier.runtime.calibrate import model_identity
from moetier.runtime.moe_block import TieredMoE
from moetier.runtime.precision import build_store
from moetier.runtime.sparsity import SparsityState, attach, check_supported
from moetier.store.dynamic import DynamicStore
from moetier.store.store import ExpertStore


@dataclass
class LoadedModel:
    info: ModelInfo
    family: Family
    config: PretrainedConfig
    model: nn.Module
    blocks: list[TieredMoE]
    store: ExpertStore | DynamicStore
    dtype: torch.dtype
    device: torch.device
    sparsity: SparsityState | None = None


def open_model(path: str | os.PathLike[str], cfg: EngineConfig) -> LoadedModel:
    # 1-3. config, index, dtype, skeleton, MoE blocks, expert reader
    device = resolve_device(cfg.runtime.device)
    o = open_checkpoint(path, cfg.runtime.dtype, device, down_rows=cfg.sparsity.enabled)
    config, family, model, sites, dtype, num_experts = o.config, o.family, o.model, o.sites, o.dtype, o.num_experts
    info = model_info(path, family, config, sites, o.index, o.reader, num_experts, o.hidden, o.inter)
    table: ThresholdTable | None = None
    table_path = cfg.sparsity.table or str(default_table_path(path))
    try:  # refuse an unsupported combination or a bad sparsity table before allocating any pool
        check_supported(cfg, family)
        if cfg.sparsity.enabled:
            table = ThresholdTable.load(table_path)
            table.check_model(model_identity(info, source_fingerprint(o.index)["fingerprint"]), table_path)
    except BaseException:
        o.reader.close()
        raise
    fn = expert_fn_for(family, config)
    # 4. the tiered store; the non-expert weights' bytes are reserved on their device before
    #    the pools are sized
    non_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) * dtype.itemsize
    store = build_store(o.reader, path, cfg, dtype, device, reserve=non_expert, top_k=info.top_k)  # MRS: p = 2k
    # 5. swap the blocks, load everything else, refuse leftovers
    blocks = []
    for site in sites:
        block = TieredMoE(family, site.block, site.layer, num_experts, store, fn)
        layer = model.get_submodule(site.path.rsplit(".", 1)[0])
        setattr(layer, family.block_attr, block)
        blocks.append(block)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    consumed = load_non_experts(model, o.index, sites, family, dtype, tied)
    check_all_consumed(o.index, consumed | o.reader.consumed, ignored_unexpected(model))
    model.to(device)
    # 6. intra-expert sparsity: the per-layer sparse executors with the table's thresholds
    sparsity = None
    if table is not None:
        act = getattr(config, "hidden_act", None)
        try:
            fmt = getattr(getattr(store, "source", None), "fmt", None)  # QuantSource: rows-layout format
            quant = (fmt.spec.bits, fmt.groups["w13"]) if fmt is not None else None  # rows: w2 grouped alike
            sparsity = attach(blocks, table, table_path, cfg.sparsity, o.hidden, o.inter, dtype, device, act, quant)
        except BaseException:
            store.close()
            raise
    return LoadedModel(info, family, config, model, blocks, store, dtype, device, sparsity)


