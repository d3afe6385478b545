"""The engine's life in a command of cli/ (generate, eval, serve): its flags, declared once, load it
with a status line on stderr, start the routing trace if asked, warm up dynamic precision on a text, and
always close.

`EngineFlags` is a frozen dataclass whose fields carry the typer option types of cli/options.py; the
`engine_flags` decorator replaces a command's `flags: EngineFlags` parameter by one option per field and
calls the command with one EngineFlags built from them, so generate, eval and serve share one list.

Invariants: `engine_session` closes the engine on every exit, which also writes
the trace; `--trace-scores` without `--trace` and `--warmup` without `--precision dynamic` are
ConfigErrors (one-line errors through cli_io.user_errors), raised by `EngineFlags.config` /
`session` inside the command, never by the decorator.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console

from moetier.cli.console import read_text
from moetier.cli.options import (
    CachePolicy,
    Device,
    Dtype,
    GpuMem,
    Groups,
    HiPrecision,
    HostMem,
    LoPrecision,
    MaxSeqLen,
    Memory,
    NoLean,
    Period,
    PrecisionMode,
    Prefetch,
    PrefetchDepth,
    PrefetchMax,
    Profile,
    QuantDir,
    Scheduler,
    Seam,
    Sparsity,
    SparsityBlock,
    SparsityTable,
    SparsityTipping,
    SyncSwitches,
    TraceFile,
    TraceScores,
    Warmup,
    WarmupTokens,
    engine_config,
    precision_config,
    prefetch_config,
    scheduler_config,
    size_flag,
    sparsity_config,
)
from moetier.config import EngineConfig, RoutingConfig
from moetier.errors import ConfigError
from moetier.runtime.engine import Engine
from moetier.runtime.wire import load

# RuntimeConfig.native_kernels / kernel_cache; their environment variables are the defaults, shown in --help
Native = Annotated[
    bool,
    typer.Option("--native/--no-native", envvar="MOETIER_NATIVE", rich_help_panel="Engine",
                 help="Build and use the C kernels (kernels/native.py: decode, sparse); --no-native runs torch ops."),
]  # fmt: skip
# RuntimeConfig.native_step / step_rows
NativeStep = Annotated[
    bool,
    typer.Option("--native-step/--no-native-step", rich_help_panel="Engine",
                 help="Run each layer of the lean decoder (Mixtral, Qwen2/3-MoE, OLMoE; bf16 on the CPU) as two native "
                      "calls (runtime/native_step.py); --no-native-step runs its attention in torch."),
]  # fmt: skip
StepRows = Annotated[
    int,
    typer.Option("--step-rows", min=1, max=4096, rich_help_panel="Engine",
                 help="Rows one native step call takes (prompts run in chunks of this many tokens); its scratch is "
                      "sized for them (Engine.stats()['native_step']['scratch_bytes'])."),
]  # fmt: skip
# RuntimeConfig.disk_io / io_depth
DiskIo = Annotated[
    str,
    typer.Option("--disk-io", metavar="auto|direct|buffered", rich_help_panel="Engine",
                 help="How experts are read from disk: direct (O_DIRECT, bypassing the page cache; where the "
                      "filesystem refuses it, buffered reads that drop their pages after; Engine.stats()['disk_io']), "
                      "buffered (through the page cache, which keeps them for a rerun), or auto (default: direct for "
                      "experts of at least 1 MiB, buffered for smaller ones)."),
]  # fmt: skip
IoDepth = Annotated[
    int,
    typer.Option("--io-depth", min=1, max=64, rich_help_panel="Engine",
                 help="Expert disk reads in flight at once (a layer call's misses are read together)."),
]  # fmt: skip
Preload = Annotated[
    bool,
    typer.Option("--preload/--no-preload", rich_help_panel="Engine",
                 help="Fill the host expert tier at load (every expert when they fit, reads in flight together), as "
                      "llama.cpp populates its mapping, instead of reading each expert on its first use."),
]  # fmt: skip
DensePrecision = Annotated[
    str,
    typer.Option("--dense-precision", metavar="full|int8|int4", rich_help_panel="Precision",
                 help="Non-expert weights (attention projections, output head): full, or quantised in blocks of 32 "
                      "as llama.cpp's Q8_0 (int8) / Q4_0 (int4) files hold them (the output head at Q8_0 under "
                      "both); needs the native kernels."),
]  # fmt: skip
Residual = Annotated[
    str,
    typer.Option("--residual", metavar="auto|bf16|fp32", rich_help_panel="Precision",
                 help="Numerics of the native decode step: bf16 rounds the residual stream, projection outputs, "
                      "attention and router to bf16 as transformers' bf16 model does; fp32 keeps them in fp32, the KV "
                      "cache in fp16, and returns fp32 logits, as llama.cpp does (closer to the fp32 model at the same "
                      "speed; only what a matmul reads is rounded), and needs the native decode step (a bf16 model on "
                      "the CPU); auto (default): fp32 for a GGUF file where the native step runs, else bf16."),
]  # fmt: skip
# SparsityConfig.scope / dense (the other sparsity flags are cli/options.py's)
SparsityScope = Annotated[
    str,
    typer.Option("--sparsity-scope", metavar="total|routed", rich_help_panel="Sparsity",
                 help="What --sparsity counts: total (default, the paper's target) = skipped neurons over all of a "
                      "token's active neurons, shared experts' included (they stay dense); routed = the routed "
                      "experts' own sparsity."),
]  # fmt: skip
SparsityDense = Annotated[
    str,
    typer.Option("--sparsity-dense", metavar="original|masked", rich_help_panel="Sparsity",
                 help="The path above the tipping point: original (default, the paper's: the unmasked expert, "
                      "exact) or masked (the same mask on the dense matmuls: the sparse model at every batch size, "
                      "for measuring its quality)."),
]  # fmt: skip
# PrefetchConfig.predictor (the other prefetch flags are cli/options.py's)
PrefetchPredictor = Annotated[
    str,
    typer.Option("--prefetch-predictor", metavar="gate|history", rich_help_panel="Prefetch and scheduling",
                 help="What predicts the next MoE layers' experts for --prefetch: gate (default, HybriMoE's: their "
                      "routers on the current hidden state) or history (the simulator's predictor, learning online "
                      "from the routing seen so far: policies/route_history.py; the one a model behind the "
                      "experts seam can use)."),
]  # fmt: skip
KernelCache = Annotated[
    Path | None,
    typer.Option("--kernel-cache", metavar="DIR", envvar="MOETIER_CACHE", rich_help_panel="Engine",
                 help="Folder of native kernel builds, measured tipping profiles and the quantized tiers and sparsity "
                      "tables of hub models (hub/OWNER--NAME/) (default ~/.cache/moetier)."),
]  # fmt: skip

# dynamic precision's controller, transient buffer, prefetch and DRAM cache (PrecisionConfig, Budgets)
Hysteresis = Annotated[
    float,
    typer.Option("--hysteresis", min=0.0, rich_help_panel="Precision",
                 help="dynamic: a challenger must beat a hot expert's EMA by this factor to displace it; "
                      "0 = the paper's Algorithm 1 exactly."),
]  # fmt: skip
EmaAlpha = Annotated[
    float,
    typer.Option("--ema-alpha", min=0.0, max=1.0, rich_help_panel="Precision",
                 help="dynamic: EMA factor per token of expert hotness (paper eq. 2), in (0, 1); memory about "
                      "1 / (1 - alpha) tokens."),
]  # fmt: skip
TransientSlots = Annotated[
    int,
    typer.Option("--transient-slots", min=0, rich_help_panel="Precision",
                 help="dynamic: high-precision slots of the transient buffer (paper 3.4), counted in the budget: "
                      "up to this many promotions in flight before their demotions run; 0 = one switch at a time."),
]  # fmt: skip
Lookahead = Annotated[
    float,
    typer.Option("--lookahead", min=0.0, max=16.0, metavar="PERIODS", rich_help_panel="Precision",
                 help="dynamic: rank experts by their EMA extrapolated this many periods along its trend "
                      "(promote ahead of need); 0 = Algorithm 1."),
]  # fmt: skip
PrecisionPrefetch = Annotated[
    bool,
    typer.Option("--precision-prefetch", rich_help_panel="Precision",
                 help="dynamic: halfway between decisions, stage the high-precision bytes of the experts predicted "
                      "to be promoted next from disk into the host DRAM cache (needs --host-cache-mem)."),
]  # fmt: skip
HostCacheMem = Annotated[
    int | None,
    typer.Option("--host-cache-mem", parser=size_flag, metavar="SIZE", rich_help_panel="Precision",
                 help="dynamic: host DRAM caching experts of both precisions between their disk tiers and the "
                      "compute pools (DynaExq's SSD -> DRAM level), e.g. 64MiB; default none."),
]  # fmt: skip
# RoutingConfig: overrides of the router's decision (runtime/route_override.py, docs/levers.md)
ExpertThreshold = Annotated[
    float,
    typer.Option("--expert-threshold", metavar="T", rich_help_panel="Routing",
                 help="Skip a token's routed expert whose renormalised router weight (over its top-k) is below T, "
                      "in [0, 1); its heaviest expert is always computed. 0 = off."),
]  # fmt: skip
MaxExpertsPerToken = Annotated[
    int | None,
    typer.Option("--max-experts-per-token", metavar="N", rich_help_panel="Routing",
                 help="Compute at most N of a token's top-k routed experts, the heaviest (1..top-k); default: all."),
]  # fmt: skip
ExpertRenorm = Annotated[
    bool,
    typer.Option("--expert-renorm/--no-expert-renorm", rich_help_panel="Routing",
                 help="With --expert-threshold / --max-experts-per-token: scale the kept experts' weights back to "
                      "the top-k's sum (default), or keep their router values."),
]  # fmt: skip
PruneFileOpt = Annotated[
    Path | None,
    typer.Option("--prune", metavar="FILE", rich_help_panel="Routing",
                 help="Pruned experts per MoE layer (written by `moetier prune`): the router chooses among the "
                      "others, and the pruned ones are never read."),
]  # fmt: skip
FollowTrace = Annotated[
    Path | None,
    typer.Option("--follow-trace", metavar="FILE.parquet", rich_help_panel="Routing",
                 help="BENCHMARK MODE: replace the router's expert ids and weights by a recorded routing trace's "
                      "(same MoE layers, experts and top-k as the model; a random checkpoint of the traced model's "
                      "shape): the text output is meaningless, the expert reads, evictions and prefetches are real."),
]  # fmt: skip


def run_warmup(engine: Engine, warmup: Path | None, err: Console) -> None:
    """`--warmup FILE`: promote the experts the text uses (needs --precision dynamic), with a status line."""
    if warmup is None:
        return
    if engine.switching is None:
        raise ConfigError("--warmup needs --precision dynamic")
    with err.status(f"warming up on {warmup}"):
        n = engine.warmup(read_text(warmup))
    err.print(f"warmup: {n} tokens, {engine.store.stats().get('promotions', 0)} experts promoted", highlight=False)


@contextmanager
def engine_session(
    model: Path, config: EngineConfig, trace: Path | None, scores: bool, err: Console
) -> Iterator[Engine]:
    """Load (with a status line on stderr), start the trace if asked, and always close."""
    if scores and trace is None:
        raise ConfigError("--trace-scores needs --trace FILE")
    with err.status(f"loading {model}"):
        engine = load(model, config)
    if config.routing.follow_trace is not None:
        err.print(f"BENCHMARK MODE: routing follows {config.routing.follow_trace}, not the model's router: the text "
                  "output is meaningless; expert reads, evictions and prefetches are the engine's own",
                  markup=False, highlight=False)  # fmt: skip
    if engine.loaded.memory is not None:  # --memory: say how it was spent
        host = engine.store.stats()["host"]
        err.print(f"{engine.loaded.memory.describe()} ({host['slots']} expert slots)", markup=False, highlight=False)
    try:
        if trace is not None:
            engine.record_trace(trace, with_scores=scores)
        yield engine
    finally:
        engine.close()  # also writes the trace
    if trace is not None:
        err.print(f"trace written to {trace}", markup=False, highlight=False)


@dataclass(frozen=True)
class EngineFlags:
    """The engine options of generate, eval and serve; each field is one CLI flag (its type says which)."""

    memory: Memory = None
    host_expert_mem: HostMem = None
    gpu_expert_mem: GpuMem = None
    device: Device = "auto"
    dtype: Dtype = "auto"
    cache_policy: CachePolicy = "auto"
    max_seq_len: MaxSeqLen = 0
    no_lean: NoLean = False
    seam: Seam = False
    trace: TraceFile = None
    trace_scores: TraceScores = False
    precision: PrecisionMode = "auto"
    hi: HiPrecision = "full"
    lo: LoPrecision = "int4"
    group: Groups = None
    quant_dir: QuantDir = None
    warmup: Warmup = None
    warmup_tokens: WarmupTokens = 256
    period: Period = 128
    sync_switches: SyncSwitches = False
    hysteresis: Hysteresis = 0.1
    ema_alpha: EmaAlpha = 0.99
    transient_slots: TransientSlots = 0
    lookahead: Lookahead = 0.0
    precision_prefetch: PrecisionPrefetch = False
    host_cache_mem: HostCacheMem = None
    sparsity: Sparsity = 0.0
    sparsity_table: SparsityTable = None
    sparsity_block: SparsityBlock = 1
    sparsity_tipping: SparsityTipping = None
    sparsity_scope: SparsityScope = "total"
    sparsity_dense: SparsityDense = "original"
    prefetch: Prefetch = False
    prefetch_depth: PrefetchDepth = 1
    prefetch_max: PrefetchMax = 4
    prefetch_predictor: PrefetchPredictor = "gate"
    scheduler: Scheduler = None
    profile: Profile = None
    native: Native = True
    kernel_cache: KernelCache = None
    dense_precision: DensePrecision = "full"
    residual: Residual = "auto"
    native_step: NativeStep = True
    step_rows: StepRows = 128
    disk_io: DiskIo = "auto"
    io_depth: IoDepth = 8
    preload: Preload = False
    expert_threshold: ExpertThreshold = 0.0
    max_experts_per_token: MaxExpertsPerToken = None
    expert_renorm: ExpertRenorm = True
    prune: PruneFileOpt = None
    follow_trace: FollowTrace = None

    def config(self) -> EngineConfig:
        """The EngineConfig these flags ask for; ConfigError names a bad value or combination."""
        cfg = engine_config(
            self.host_expert_mem, self.gpu_expert_mem, self.device, self.dtype, self.cache_policy,
            self.max_seq_len, self.no_lean,
            precision_config(self.precision, self.hi, self.lo, self.group, self.quant_dir, self.warmup_tokens,
                             self.period, self.sync_switches),
            sparsity_config(self.sparsity, self.sparsity_table, self.sparsity_block, self.sparsity_tipping),
            prefetch_config(self.prefetch, self.prefetch_depth, self.prefetch_max),
            scheduler_config(self.scheduler, self.profile),
        )  # fmt: skip
        sparsity = replace(cfg.sparsity, scope=self.sparsity_scope, dense=self.sparsity_dense)  # type: ignore[arg-type]
        cfg = replace(cfg, sparsity=sparsity)  # SparsityConfig checks both values (ConfigError)
        precision = replace(cfg.precision, hysteresis=self.hysteresis, alpha=self.ema_alpha,
                            transient_slots=self.transient_slots, lookahead=self.lookahead,
                            prefetch=self.precision_prefetch)  # fmt: skip
        budgets = replace(cfg.budgets, host_cache_bytes=self.host_cache_mem or 0, memory_bytes=self.memory)
        if self.precision != "dynamic" and (self.host_cache_mem or self.precision_prefetch or self.transient_slots):
            raise ConfigError("--host-cache-mem, --precision-prefetch and --transient-slots need --precision dynamic")
        if self.prefetch_predictor != "gate" and not self.prefetch:
            raise ConfigError("--prefetch-predictor needs --prefetch")
        prefetch = replace(cfg.prefetch, predictor=self.prefetch_predictor)  # PrefetchConfig checks it (ConfigError)
        cfg = replace(cfg, precision=precision, budgets=budgets, prefetch=prefetch)  # PrecisionConfig checks too
        cache = str(self.kernel_cache) if self.kernel_cache is not None else None
        runtime = replace(
            cfg.runtime, native_kernels=self.native, kernel_cache=cache, dense_precision=self.dense_precision,
            seam=self.seam, native_step=self.native_step, step_rows=self.step_rows, disk_io=self.disk_io,
            io_depth=self.io_depth, preload=self.preload, residual=self.residual,
        )
        return replace(cfg, runtime=runtime, routing=self.routing())

    def routing(self) -> RoutingConfig:
        """The RoutingConfig of --expert-threshold, --max-experts-per-token, --expert-renorm, --prune and
        --follow-trace (RoutingConfig checks the values: ConfigError)."""
        cap = self.max_experts_per_token
        if cap is not None and cap < 1:
            raise ConfigError(f"--max-experts-per-token must be at least 1, got {cap}")
        return RoutingConfig(
            threshold=self.expert_threshold, max_k=cap or 0, renormalize=self.expert_renorm,
            prune=str(self.prune) if self.prune is not None else None,
            follow_trace=str(self.follow_trace) if self.follow_trace is not None else None,
        )  # fmt: skip

    @contextmanager
    def session(self, model: Path, config: EngineConfig, err: Console, trace: Path | None) -> Iterator[Engine]:
        """engine_session with `trace` (the command's choice: --trace, or its run folder's) and --warmup run."""
        with engine_session(model, config, trace, self.trace_scores, err) as engine:
            run_warmup(engine, self.warmup, err)
            yield engine


DEFAULT_FLAGS = EngineFlags()  # the default of a command's `flags` parameter (every flag left out)


def engine_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Decorator: `command(..., flags: EngineFlags, ...)` becomes a typer command with the engine flags
    in place of `flags`; typer's parsed values reach it as one EngineFlags."""
    # 1. the command's own parameters, annotations resolved (cli modules use postponed annotations)
    sig = inspect.signature(command, eval_str=True)
    if "flags" not in sig.parameters:
        raise TypeError(f"{command.__name__} has no `flags: EngineFlags` parameter")
    names = [f.name for f in fields(EngineFlags)]
    if clash := sorted(set(names) & set(sig.parameters)):
        raise TypeError(f"{command.__name__} declares engine flags itself: {', '.join(clash)}")
    # 2. one parameter per EngineFlags field where `flags` was
    hints = get_type_hints(EngineFlags, include_extras=True)
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if p.name != "flags":
            params.append(p)
            continue
        params += [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default,
                                     annotation=hints[f.name]) for f in fields(EngineFlags)]  # fmt: skip

    # 3. the wrapper typer calls: the engine values become one EngineFlags
    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        flags = EngineFlags(**{name: kwargs.pop(name) for name in names})
        command(**kwargs, flags=flags)

    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": sig.return_annotation}
    return run


__all__ = ["DEFAULT_FLAGS", "EngineFlags", "engine_flags", "engine_session", "run_warmup"]
