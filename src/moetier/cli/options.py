"""Command-line flags: the typed options of `moetier` and their mapping onto the config dataclasses.

Declarations only (typer `Annotated` option types shared by the command modules of cli/; the engine ones
are gathered into engine_flags.EngineFlags) and
the pure functions that turn flag values into EngineConfig / PrecisionConfig. Bad values
raise typer.BadParameter or ConfigError, which console.user_errors reports in one line with exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetier.config import (
    Budgets,
    CacheConfig,
    DeviceName,
    DtypeName,
    EngineConfig,
    PrecisionConfig,
    PrefetchConfig,
    RuntimeConfig,
    SchedulerConfig,
    SparsityConfig,
    parse_size,
)
from moetier.errors import ConfigError
from moetier.policies import AUTO, CACHE_POLICIES, cache_policy_for_batch
from moetier.policies.costmodel import load_profile
from moetier.policies.schedulers import check_scheduler


# -- flag parsing ------------------------------------------------------------------
def size_flag(text: str) -> int:
    """A byte count or a number with a unit (512MiB, 2GiB, 1.5GB); never negative."""
    if text.strip().startswith("-"):
        raise typer.BadParameter(f"a size must not be negative, got {text!r}")
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


_SIZE_HELP = "Bytes, or a number with a unit: 512MiB, 2GiB, 1.5GB."
_ENGINE = "Engine"
Model = Annotated[
    str,
    typer.Argument(metavar="MODEL",
                   help="A local Hugging Face checkpoint folder (config.json + *.safetensors), or a hub id "
                        "owner/name[@revision] fetched into the Hugging Face cache (a GGUF repository with :QUANT, "
                        "e.g. :Q4_K_M, or :FILE.gguf); an existing path always wins. Offline (HF_HUB_OFFLINE=1) "
                        "only the cache is read."),
]  # fmt: skip
HostMem = Annotated[
    int | None,
    typer.Option("--host-expert-mem", parser=size_flag, metavar="SIZE", rich_help_panel=_ENGINE,
                 help=f"Host (CPU RAM) budget for expert weights; default: every expert. {_SIZE_HELP}"),
]  # fmt: skip
Memory = Annotated[
    int | None,
    typer.Option("--memory", parser=size_flag, metavar="SIZE", rich_help_panel=_ENGINE,
                 help="Everything the process may hold (dense weights, experts of every tier, KV cache, scratch): "
                      "moetier sizes its host expert budget from what the rest leaves and says what it chose; "
                      f"default: no limit. {_SIZE_HELP}"),
]  # fmt: skip
GpuMem = Annotated[
    int | None,
    typer.Option("--gpu-expert-mem", parser=size_flag, metavar="SIZE", rich_help_panel=_ENGINE,
                 help=f"Accelerator (CUDA) budget for expert weights; default: every expert. {_SIZE_HELP}"),
]  # fmt: skip
Device = Annotated[
    DeviceName,
    typer.Option(rich_help_panel=_ENGINE, help="Compute device; auto picks cuda when torch sees one."),
]
Dtype = Annotated[
    DtypeName,
    typer.Option(rich_help_panel=_ENGINE, help="Compute dtype; auto uses the checkpoint's (fp16 becomes bf16 on CPU)."),
]
CachePolicy = Annotated[
    str,
    typer.Option(rich_help_panel=_ENGINE,
                 help=f"Expert eviction policy of every tier; one of: {', '.join(sorted(CACHE_POLICIES))} "
                      "(belady needs the future: `moetier replay` only), or auto: lru for one sequence, mrs-admit "
                      "for `serve` with --max-batch above 1 (docs/hybrid.md)."),
]  # fmt: skip
_SCHED = "Prefetch and scheduling"
Prefetch = Annotated[
    bool,
    typer.Option("--prefetch/--no-prefetch", rich_help_panel=_SCHED,
                 help="Predict the next MoE layers' experts (with their routers, or from the routing seen so far: "
                      "--prefetch-predictor; the seam runs the latter only) and load the most useful ones in the "
                      "background (disk -> host on a CPU machine, host -> GPU on a GPU)."),
]  # fmt: skip
PrefetchDepth = Annotated[
    int, typer.Option(min=1, max=3, rich_help_panel=_SCHED, help="MoE layers ahead to predict and prefetch (1-3).")
]
PrefetchMax = Annotated[
    int, typer.Option(min=1, rich_help_panel=_SCHED, help="Most experts prefetched per MoE layer call.")
]
Scheduler = Annotated[
    str | None,
    typer.Option(rich_help_panel=_SCHED,
                 help="Expert scheduler (hybrimoe, ktransformers, llamacpp, gpu-lru, fiddler): on CUDA it splits each "
                      "layer's experts between GPU and CPU; on a CPU machine it only prices prefetch choices."),
]  # fmt: skip
Profile = Annotated[
    str | None,
    typer.Option(metavar="NAME|FILE", rich_help_panel=_SCHED,
                 help="Hardware profile for the cost model: a name (yours, written by `moetier profile`, else a "
                      "shipped one) or a .json path; default this-machine if present, else a built-in conservative "
                      "CPU profile."),
]  # fmt: skip
MaxSeqLen = Annotated[
    int,
    typer.Option(min=0, rich_help_panel=_ENGINE,
                 help="KV-cache length of the lean decoder; 0 = the model's limit, capped at 4096."),
]  # fmt: skip
NoLean = Annotated[
    bool,
    typer.Option("--no-lean", rich_help_panel=_ENGINE,
                 help="Use the transformers modules (with tiered MoE blocks) instead of the lean decoder."),
]  # fmt: skip
Seam = Annotated[
    bool,
    typer.Option("--seam", rich_help_panel=_ENGINE,
                 help="Run transformers' own MoE blocks with moetier's experts (the experts seam) even for a "
                      "family that has a row (families without a row always do)."),
]  # fmt: skip
TraceFile = Annotated[
    Path | None,
    typer.Option(metavar="FILE.parquet", rich_help_panel=_ENGINE,
                 help="Record the routing of every MoE layer call to this Parquet trace."),
]  # fmt: skip
TraceScores = Annotated[
    bool,
    typer.Option(
        "--trace-scores",
        rich_help_panel=_ENGINE,
        help="Also record all router probabilities (needs --trace).",
    ),
]
_PREC = "Precision"
PrecisionMode = Annotated[
    str,
    typer.Option("--precision", rich_help_panel=_PREC,
                 help="Expert precision: auto (stored where the native kernels compute the checkpoint's experts "
                      "as stored: GGUF blocks, GPTQ/AWQ/compressed-tensors int4, FP8, MXFP4; else full), full, "
                      "int8, int4, int2 or a ggml block type q6_k, q5_k, q4_k, iq4_xs, q3_k, q2_k (static; "
                      "quantized tiers from `moetier quantize`), stored (a quantized "
                      "checkpoint's experts kept in slots as stored, computed natively where the kernels read "
                      "them, else decoded per call), or dynamic (hot experts at --hi, cold at --lo, under the "
                      "expert budget)."),
]  # fmt: skip
HiPrecision = Annotated[
    str,
    typer.Option("--hi", rich_help_panel=_PREC,
                 help="dynamic: precision of hot experts (full, stored, int8, q6_k, q5_k, q4_k, int4 ...)."),
]
LoPrecision = Annotated[
    str,
    typer.Option("--lo", rich_help_panel=_PREC,
                 help="dynamic: precision of cold experts (stored, int4, iq4_xs, q3_k, q2_k, int2 ...)."),
]
Groups = Annotated[
    list[str] | None,
    typer.Option("--group", metavar="PREC=SIZE", rich_help_panel=_PREC,
                 help="Quantisation group size of a precision, e.g. --group int4=64 (repeatable); must match the "
                      "quantized tier."),
]  # fmt: skip
QuantDir = Annotated[
    Path | None,
    typer.Option(metavar="DIR", rich_help_panel=_PREC,
                 help="Where quantized tiers live; default MODEL/moetier-quant (for a hub id: "
                      "CACHE/hub/OWNER--NAME/moetier-quant, CACHE = --kernel-cache, $MOETIER_CACHE or "
                      "~/.cache/moetier)."),
]  # fmt: skip
Warmup = Annotated[
    Path | None,
    typer.Option(metavar="FILE", rich_help_panel=_PREC,
                 help="dynamic: text whose first --warmup-tokens tokens seed expert hotness before serving."),
]  # fmt: skip
WarmupTokens = Annotated[int, typer.Option(min=1, rich_help_panel=_PREC, help="dynamic: tokens of --warmup used.")]
Period = Annotated[int, typer.Option(min=1, rich_help_panel=_PREC, help="dynamic: tokens between precision decisions.")]
SyncSwitches = Annotated[
    bool,
    typer.Option("--sync-switches", rich_help_panel=_PREC,
                 help="dynamic: wait for each decision's switches before the next forward (reproducible runs)."),
]  # fmt: skip
_SPARSE = "Sparsity"
Sparsity = Annotated[
    float,
    typer.Option("--sparsity", min=0.0, max=0.95, rich_help_panel=_SPARSE,
                 help="Activation sparsity to reach, 0 = off, up to 0.95: by default the total over every active "
                      "neuron of a token, shared experts counted dense, as the paper defines it (see "
                      "--sparsity-scope); through the calibrated thresholds of `moetier calibrate`."),
]  # fmt: skip
SparsityTable = Annotated[
    Path | None,
    typer.Option("--sparsity-table", metavar="FILE", rich_help_panel=_SPARSE,
                 help="Threshold table; default MODEL/moetier-sparsity/thresholds.json (for a hub id: "
                      "CACHE/hub/OWNER--NAME/moetier-sparsity/thresholds.json)."),
]  # fmt: skip
SparsityBlock = Annotated[
    int,
    typer.Option("--sparsity-block", rich_help_panel=_SPARSE,
                 help="Mask neurons in blocks of 1 (per neuron), 4, 8, 16 or 32."),
]  # fmt: skip
SparsityTipping = Annotated[
    int | None,
    typer.Option("--sparsity-tipping", min=0, metavar="TOKENS", rich_help_panel=_SPARSE,
                 help="Tokens per expert from which the masked dense path runs; default: measured at start "
                      "(cached). 0 = always dense."),
]  # fmt: skip
JsonOut = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON object as the last line of stdout; the rest goes to stderr."),
]


def engine_config(
    host: int | None,
    gpu: int | None,
    device: DeviceName,
    dtype: DtypeName,
    policy: str,
    max_seq_len: int,
    no_lean: bool,
    precision: PrecisionConfig | None = None,
    sparsity: SparsityConfig | None = None,
    prefetch: PrefetchConfig | None = None,
    scheduler: SchedulerConfig | None = None,
) -> EngineConfig:
    policy = cache_policy_for_batch(1) if policy == AUTO else policy  # serve resolves auto by its --max-batch
    if policy not in CACHE_POLICIES:
        raise ConfigError(f"unknown cache policy {policy!r}; known: {', '.join(sorted(CACHE_POLICIES))}")
    return EngineConfig(
        budgets=Budgets(host_expert_bytes=host, accel_expert_bytes=gpu),
        cache=CacheConfig(policy=policy),
        prefetch=prefetch or PrefetchConfig(),
        scheduler=scheduler or SchedulerConfig(),
        precision=precision or PrecisionConfig(),
        sparsity=sparsity or SparsityConfig(),
        runtime=RuntimeConfig(device=device, dtype=dtype, lean=not no_lean, max_seq_len=max_seq_len),
    )


def parse_groups(items: list[str] | None) -> tuple[tuple[str, int], ...]:
    """['int4=64', 'int2=32'] -> (('int4', 64), ('int2', 32)); a bad item raises ConfigError naming it."""
    out = []
    for item in items or []:
        prec, sep, size = item.partition("=")
        if not sep or not size.strip().isdigit():
            raise ConfigError(f"--group takes PREC=SIZE such as int4=64, got {item!r}")
        out.append((prec.strip(), int(size)))
    return tuple(out)


def precision_config(
    mode: str, hi: str, lo: str, groups: list[str] | None, quant_dir: Path | None, warmup_tokens: int, period: int,
    sync: bool,
) -> PrecisionConfig:  # fmt: skip
    return PrecisionConfig(
        mode=mode, hi=hi, lo=lo, groups=parse_groups(groups), quant_dir=str(quant_dir) if quant_dir else None,
        warmup_tokens=warmup_tokens, period=period, sync=sync,
    )  # fmt: skip


def sparsity_config(target: float, table: Path | None, block: int, tipping: int | None) -> SparsityConfig:
    return SparsityConfig(target=target, table=str(table) if table else None, block=block, tipping=tipping)


def prefetch_config(enabled: bool, depth: int, max_experts: int) -> PrefetchConfig:
    return PrefetchConfig(enabled=enabled, depth=depth, max_experts=max_experts)


def scheduler_config(name: str | None, profile: str | None) -> SchedulerConfig:
    """--scheduler and --profile; an unknown scheduler or profile is a ConfigError naming the known ones."""
    if name is not None:
        check_scheduler(name)
    if profile is not None:
        load_profile(profile)  # fails early, naming the known profiles
    return SchedulerConfig(name=name, profile=profile)
