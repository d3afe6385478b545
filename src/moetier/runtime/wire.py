"""The one place that wires a model from its EngineConfig: `load(path, config) -> Engine`.

Steps (numbered in `load`):
1. open the checkpoint skeleton (runtime/loader.py): config, family, index, dtype, expert reader; resolve
   precision "auto" (`resolve_precision`: "stored" where the native kernels compute the checkpoint's stored
   experts, GGUF blocks through ggml, else "full");
2. choose the executor variant (runtime/executors EXECUTORS: sparse when SparsityConfig is on,
   hybrid on CUDA with SchedulerConfig.name set, native on a CPU bf16 SwiGLU model when the kernel
   library loads, else dense) and refuse impossible combinations
   from the capabilities the config's store declares and each feature needs, before any pool is
   allocated, in this order: sparsity, prefetch, hybrid execution; then what the variant prepares
   (the sparsity table);
3. build the store and the model (runtime/loader.py); with a process budget (Budgets.memory_bytes, --memory)
   the host expert budget is what the process, dense weights, KV cache, scratch and margin leave
   (runtime/memory.py), and the checkpoint's pages the load read are dropped from the page cache;
4. the route observers, in stage order (runtime/observers.py): precision switching when the store
   switches precisions, cache scores when its policy takes router scores, the prefetcher when
   PrefetchConfig is on (with the predictor PrefetchConfig.predictor names: runtime/prefetch.py
   PREDICTORS; on a row family's blocks or the seam's alike, a predictor that needs the routers refused
   on the seam in step 2); the pricing both the prefetcher and the hybrid scheduler use;
5. the executor of every MoE layer, attached with its scheduler, the observers and the routing override
   (RoutingConfig: runtime/route_override.py; a trace or pruning file that does not fit is refused here), once;
6. the decoder (lean when the family's attention allows it; its dense projections on the native
   kernels when loaded, quantised per RuntimeConfig.dense_precision; with the native executor and
   RuntimeConfig.native_step, its layers as two native calls each, runtime/native_step.py) and the Engine;
7. with RuntimeConfig.preload (--preload), the host expert tier filled at load (ExpertStore.preload).

Invariants: every refusal of step 2 comes before any pool is allocated and closes the checkpoint's
files; a failure after the model is built closes its store and stops the threads wiring started;
nothing outside this module decides which executor or observers a model runs (calibration and tests
may attach their own pipelines).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch

from moetier.config import EngineConfig
from moetier.errors import CheckpointError, ConfigError
from moetier.formats.codecs_quant import INT4_INTS
from moetier.formats.gguf import is_gguf, read_blocks
from moetier.formats.safetensors import read_parts
from moetier.kernels import decode, ggml, native
from moetier.kernels.decode import QDense
from moetier.kernels.fp8 import fp8_dense
from moetier.kernels.stored import StoredFormat
from moetier.models.families import Family
from moetier.policies.schedulers import make_scheduler
from moetier.runtime import memory
from moetier.runtime.decode_hf import HFDecoder
from moetier.runtime.engine import Decoder, Engine, Wired
from moetier.runtime.executors.base import PRECISION_SWITCHING, ROUTE_SCORES, refuse_missing
from moetier.runtime.executors.native import NativeState, native_fits
from moetier.runtime.executors.registry import EXECUTORS
from moetier.runtime.executors.spec import BuildContext, Built, ExecutorSpec
from moetier.runtime.lean import LeanDecoder, lean_supported
from moetier.runtime.loader import LoadedModel, Skeleton, build_model, open_skeleton
from moetier.runtime.memory_needs import memory_needs
from moetier.runtime.moe_block import Pipeline
from moetier.runtime.native_step import NativeStep
from moetier.runtime.observers import CacheScores, ObserverList
from moetier.runtime.precision import Switching, store_capabilities
from moetier.runtime.prefetch import NEEDS as PREFETCH_NEEDS
from moetier.runtime.prefetch import PREDICTORS, Prefetcher
from moetier.runtime.pricing import Pricing, make_pricing
from moetier.runtime.route_override import build_override
from moetier.store.dynamic import DynamicStore
from moetier.store.source import StoredFp8Source, StoredIntSource
from moetier.store.store import ExpertStore
from moetier.types import Precision


def load(path: str | os.PathLike[str], config: EngineConfig | None = None) -> Engine:
    """Open a local Hugging Face MoE checkpoint folder with tiered experts, wired per `config`."""
    cfg = config or EngineConfig()
    # 1. the skeleton: no pool, no weights yet
    sk = open_skeleton(path, cfg)
    try:
        # whether the native kernels read the checkpoint's experts as stored: asked once, only when it matters
        reads_stored = cfg.precision.mode == "auto" or Precision.STORED.value in cfg.precision.precisions
        as_stored = reads_stored and stored_native(cfg, sk)
        cfg = resolve_precision(cfg, as_stored)
        # 2. the executor variant; refusals; what it prepares
        spec = choose_executor(cfg, sk.device.type == "cuda", native_ok(cfg, sk, as_stored))
        refuse(cfg, spec, store_capabilities(cfg), sk.opened.family, sk.device.type == "cuda")
        prepared = spec.prepare(cfg, sk)
    except BaseException:
        sk.close()  # release the checkpoint's file descriptors
        raise
    # 3. store and model; with --memory the host expert budget is what the rest of the process leaves
    try:
        needs = memory_needs(sk, cfg) if cfg.budgets.memory_bytes is not None else None
        loaded = build_model(sk, cfg, needs)
    except BaseException:
        sk.close()  # the reader's files (build_model closes the store it made)
        raise
    if needs is not None:  # the dense weights' pages the load read leave the page cache (charged to us otherwise)
        memory.drop_page_cache(memory.checkpoint_files(path))
    try:
        engine = Engine(wire(loaded, cfg, spec, prepared, is_gguf(path)))
    except BaseException:
        loaded.store.close()
        raise
    if cfg.runtime.preload and isinstance(loaded.store, ExpertStore):  # a DynamicStore holds every expert already
        try:
            loaded.store.preload()
        except BaseException:
            engine.close()
            raise
    return engine


def native_ok(cfg: EngineConfig, sk: Skeleton, as_stored: bool) -> bool:
    """Whether the model fits the native executor (executors/native.py native_fits) and the kernel library
    loads (with stored slots, `as_stored`: `stored_native`); refuses a quantised --dense-precision the engine
    cannot run."""
    o = sk.opened
    cuda = sk.device.type == "cuda"
    fits = native_fits(cfg, o.family, o.expert_fn, o.dtype, cuda)
    lib = decode.load(cfg.runtime.native_kernels, cfg.runtime.kernel_cache) if not cuda else None
    if cfg.runtime.dense_precision != "full":
        if lib is None or o.dtype != torch.bfloat16:
            why = "a CUDA device" if cuda else (native.load_error(cfg.runtime.native_kernels, cfg.runtime.kernel_cache)
                                                 or f"a {o.dtype} model (bf16 only)")  # fmt: skip
            raise ConfigError(f"--dense-precision {cfg.runtime.dense_precision} needs the native CPU kernels on a "
                              f"bf16 model; here: {why}")  # fmt: skip
        if not (cfg.runtime.lean and o.family.lean_attention):
            raise ConfigError(f"--dense-precision {cfg.runtime.dense_precision} needs the lean decoder (this family "
                              "or --no-lean runs transformers' modules)")  # fmt: skip
    # slots in the checkpoint's own coding: native where the kernels read every stored expert tensor, else torch decodes
    stored = Precision.STORED.value in cfg.precision.precisions
    return fits and lib is not None and (not stored or as_stored)


def stored_native(cfg: EngineConfig, sk: Skeleton) -> bool:
    """Whether the native kernels compute this checkpoint's experts as stored: a CPU bf16 model the native
    executor fits, and either every expert tensor a GGUF block type our kernels or ggml's compute
    (kernels/ggml.py), or every one a GPTQ / AWQ / compressed-tensors int4 tensor our int4 kernels read as stored
    (store/source.py StoredIntSource), or every one a block-scaled FP8 tensor (StoredFp8Source); biases (GPT-OSS)
    are decoded into the slots' bf16 bias slices when read, whatever their stored type."""
    o = sk.opened
    if sk.device.type == "cuda" or not native_fits(cfg, o.family, o.expert_fn, o.dtype, False):
        return False
    lib = decode.load(cfg.runtime.native_kernels, cfg.runtime.kernel_cache)
    if lib is None:
        return False
    try:
        layouts, _ = o.reader.stored_layouts()  # per layer group (a Q4_K_M file's layers differ)
    except CheckpointError:  # a layer's experts stored unlike each other
        return False
    if not layouts:
        return False
    if StoredIntSource.fits(o.reader) is not None or StoredFp8Source.fits(o.reader) is not None:
        return True
    for tensors in layouts:
        if any(t.codec == "mxfp4" for t in tensors):  # GPT-OSS: re-laid for our kernels when read (kind 4 | FP4)
            relaid = StoredFormat(o.reader.layout, tensors, o.dtype, relay=True).relaid
            if [v[0] for v in relaid.values()] != ["MXFP4", "MXFP4"]:
                return False
    for t in (t for tensors in layouts for t in tensors):
        if all(piece.endswith("_bias") for piece, _ in t.pieces) or t.codec == "mxfp4":
            continue
        codec = t.codec or ""
        if not codec.startswith("gguf:") or "+" in codec or ggml.kind_of(codec.removeprefix("gguf:"), lib) is None:
            return False
    return True


def stored_dense_reader(index: Any) -> Callable[[str], QDense | None]:
    """checkpoint tensor name -> the tensor as a QDense the kernels compute as stored (GGUF blocks; GPTQ / AWQ /
    compressed-tensors int4 values, zeros and scales; block-scaled FP8 bytes and scales), or None (another format,
    or one they do not compute)."""

    def read(name: str) -> QDense | None:
        loc = index.tensors.get(name)
        if loc is not None and loc.dtype.startswith("fp8_block:") and len(loc.shape) == 2:  # DeepSeek-V3, Qwen3-FP8
            bn, bk = (int(v) for v in loc.dtype.removeprefix("fp8_block:").split("x"))
            weight, grid = read_parts(loc)[:2]
            return fp8_dense(weight, grid, bn, bk)
        if loc is not None and loc.dtype in INT4_INTS and len(loc.shape) == 2:  # GPTQ / AWQ / compressed-tensors
            try:
                v, z, s = INT4_INTS[loc.dtype](read_parts(loc))
            except ValueError:  # act-order groups: dequantised at load, as before
                return None
            return decode.int4_dense(v, z, s)
        got = read_blocks(loc) if loc is not None else None
        if got is None:
            return None
        type_name, q = got
        return decode.stored_dense(type_name, q, int(loc.shape[1]))

    return read


def resolve_precision(cfg: EngineConfig, as_stored: bool) -> EngineConfig:
    """`cfg` with precision "auto" resolved: "stored" where the native kernels read the experts as stored
    (`as_stored`, from `stored_native`), else "full"."""
    if cfg.precision.mode != "auto":
        return cfg
    mode = Precision.STORED.value if as_stored else "full"
    return replace(cfg, precision=replace(cfg.precision, mode=mode))


def choose_executor(cfg: EngineConfig, cuda: bool, native_ok: bool = False) -> ExecutorSpec:
    """sparse when sparsity is on, hybrid on CUDA with a scheduler named, native where the model and the
    kernel library allow it (`native_ok`), else dense."""
    if cfg.sparsity.enabled:
        return EXECUTORS["sparse"]
    if cuda and cfg.scheduler.name is not None:
        return EXECUTORS["hybrid"]
    return EXECUTORS["native" if native_ok else "dense"]


def refuse(cfg: EngineConfig, spec: ExecutorSpec, capabilities: frozenset[str], family: Family, cuda: bool) -> None:
    """ConfigError, with each feature's own message, for a combination the store's declared capabilities
    or an executor cannot run, in the order: sparsity, prefetch, hybrid execution (a sparse engine that
    also asks for hybrid execution gets the hybrid refusal), then the chosen executor's own needs."""
    if cfg.sparsity.enabled:
        sparse = EXECUTORS["sparse"]
        refuse_missing(sparse.needs, capabilities)
        sparse.check(cfg, family)
    if cfg.prefetch.enabled:
        refuse_missing(PREFETCH_NEEDS, capabilities)
        predictor = cfg.prefetch.predictor
        if family.seam and PREDICTORS[predictor].needs_router:
            raise ConfigError(f"prefetch predictor {predictor!r} applies the next MoE layers' routers, which "
                              f"{family.name} keeps inside transformers' own MoE block (the experts seam, "
                              "models/seam.py): use --prefetch-predictor history (it predicts from the routed "
                              "experts alone)")  # fmt: skip
    name = cfg.scheduler.name
    if name is not None and make_scheduler(name).gates:
        raise ConfigError(f"scheduler {name!r} drops routed experts (adaptive gating), which changes the model's "
                          "output; it runs in the simulator only (`moetier simulate --scheduler "
                          f"{name}`)")  # fmt: skip
    if name is not None and make_scheduler(name).cache_alloc != "global":
        raise ConfigError(f"scheduler {name!r} sizes one cache per MoE layer ({make_scheduler(name).cache_alloc!r} "
                          "allocation), where the engine's store keeps one cache for all layers; it runs in the "
                          f"simulator only (`moetier simulate --scheduler {name}`)")  # fmt: skip
    if cuda and cfg.scheduler.name is not None:
        hybrid = EXECUTORS["hybrid"]
        refuse_missing(hybrid.needs, capabilities)
        hybrid.check(cfg, family)
    refuse_missing(spec.needs, capabilities)


def wire(loaded: LoadedModel, cfg: EngineConfig, spec: ExecutorSpec, prepared: object, gguf: bool = False) -> Wired:
    """Steps 4-6 of `load` on a built model (`gguf`: the checkpoint is a GGUF file, which residual "auto" runs wide)."""
    store, caps = loaded.store, type(loaded.store).capabilities
    switching: Switching | None = None
    built: Built | None = None
    try:
        # 4. observers (stage order is kept by ObserverList) and the pricing
        observers = ObserverList()
        if PRECISION_SWITCHING in caps:
            dyn = cast(DynamicStore, store)  # the capability: hi / lo pools, switch(), per-layer quotas
            switching = Switching(dyn, dyn.per_layer, loaded.info.num_experts, cfg.precision)
            observers.add(switching)
        static = cast(ExpertStore, store)  # the capabilities checked below: prefetch, route scores
        if ROUTE_SCORES in caps and static.wants_scores:
            observers.add(CacheScores(static))
        pricing: Pricing | None = None
        if cfg.prefetch.enabled or spec.needs_pricing:
            pricing = make_pricing(loaded, cfg, static.precision.value, hybrid=cfg.scheduler.name is not None)
        prefetcher = None
        if cfg.prefetch.enabled:
            assert pricing is not None
            prefetcher = Prefetcher(loaded.blocks, static, pricing, cfg.prefetch, loaded.info.top_k)
            observers.add(prefetcher)
        # 5. one pipeline per MoE layer, attached once
        built = spec.build(BuildContext(loaded, cfg, prepared, pricing))
        override = build_override(cfg.routing, loaded.info, loaded.family, loaded.config)  # RoutingConfig, or None
        for block in loaded.blocks:
            scheduler, executor = built.layers[block.layer]
            block.attach(Pipeline(scheduler, executor, observers, built.routed.get(block.layer), override))
        # 6. the decoder
        decoder: Decoder
        if cfg.runtime.lean and loaded.family.lean_attention and lean_supported(loaded):
            native_bf16 = loaded.device.type == "cpu" and decode.load(cfg.runtime.native_kernels,
                                                                      cfg.runtime.kernel_cache) is not None  # fmt: skip
            stored = None
            if native_bf16 and Precision.STORED.value in cfg.precision.precisions and loaded.index is not None:
                stored = stored_dense_reader(loaded.index)  # GGUF projections and head computed as stored too
            lean = LeanDecoder(loaded, cfg.runtime.max_seq_len, cfg.runtime.dense_precision, native_bf16, stored)
            lib = decode.load(cfg.runtime.native_kernels, cfg.runtime.kernel_cache) if native_bf16 else None
            if lib is not None and cfg.runtime.native_step and loaded.dtype == torch.bfloat16:
                # the attention half native for every executor; the MoE half the native executor's routed call, or
                # the chosen executor's own (sparse, dense) on the same routing
                state = built.state if isinstance(built.state, NativeState) else None
                # the wide step (fp32 residual, llama.cpp's numerics) when asked, and by default for a GGUF file
                lean.fused = NativeStep(lean, loaded, lib, state, cfg.runtime.step_rows, cfg.runtime.wide(gguf))
            decoder = lean
        else:
            decoder = HFDecoder(loaded.model, loaded.config)
        if cfg.runtime.residual == "fp32" and loaded.dtype != torch.float32 and getattr(decoder, "fused", None) is None:
            raise ConfigError(
                "--residual fp32 needs the native decode step: a bf16 model on the CPU, the lean decoder (a family "
                "with lean attention, no --no-lean), the native kernels and the native step (this model runs "
                f"{type(decoder).__name__} on {loaded.device.type} in {loaded.dtype})"
            )  # an fp32 model keeps its residual stream in fp32 anyway
    except BaseException:  # stop what steps 4-5 started (the mover thread, the hybrid worker); load closes the store
        if switching is not None:
            switching.close()
        if built is not None and built.state is not None:
            built.state.close()
        raise
    return Wired(loaded, cfg, decoder, observers, spec.name, built.state, switching, prefetcher)
