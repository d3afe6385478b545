"""Frozen, composed configuration. The CLI only maps flags onto these.

EngineConfig = Budgets + CacheConfig + PrefetchConfig + SchedulerConfig + PrecisionConfig +
SparsityConfig + RuntimeConfig + RoutingConfig. Each section validates its own values on construction; names
that live in a registry (cache policies, schedulers, hardware profiles) are checked where
the registry is (the engine, the CLI).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from moetier.errors import ConfigError
from moetier.types import GGML_PRECISIONS, PRECISION_BITS, precision_bits

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bf16", "fp32", "fp16"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'512MiB' -> 536870912; '2GiB', '1.5GB', '4096' and plain ints are accepted."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative, got {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot parse size {text!r}: use a byte count or a number with a unit "
            "(B, KB, MB, GB, KiB, MiB, GiB, TiB), e.g. 512MiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(nbytes: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Budgets:
    """Expert memory per tier, in bytes. None means 'room for every expert'. `memory_bytes` (--memory) is
    the whole process's budget instead: the engine measures what it holds besides experts and gives the
    host expert tier the rest (runtime/memory.py)."""

    host_expert_bytes: int | None = None
    accel_expert_bytes: int | None = None
    # host DRAM caching experts' bytes (both precisions) between their disk tiers and the compute pools of
    # dynamic precision (DynaExq's SSD -> DRAM -> HBM hierarchy); 0 = no such cache
    host_cache_bytes: int = 0
    memory_bytes: int | None = None  # everything the process holds (dense, experts, KV, scratch); None: no limit
    kv_bytes: int | None = None  # KV cache bytes --memory sets aside (serving's KV budget); None: one full sequence

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError(f"memory_bytes must be positive (or None: no limit), got {self.memory_bytes}")
        for name in ("host_expert_bytes", "accel_expert_bytes", "host_cache_bytes", "kv_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """Which eviction policy each tier uses (a name in moetier.policies.CACHE_POLICIES)."""

    policy: str = "lru"


PREFETCH_MAX_DEPTH = 3
PREFETCH_PREDICTORS = ("gate", "history")  # runtime/prefetch.py PREDICTORS


@dataclass(frozen=True)
class PrefetchConfig:
    """Cross-layer expert prefetch (HybriMoE IV-C). After MoE layer l routes, the experts of the
    next `depth` MoE layers (1..3) are predicted by `predictor`: "gate" applies their routers to
    layer l's input; "history" is the simulator's predictor (policies/route_history.py), learning
    online from the routing the engine has seen. The cost model prices them and
    policies.prefetch.choose_prefetch picks at most `max_experts` per layer call to load in the
    background (disk -> host on a CPU machine, host -> GPU on a GPU)."""

    enabled: bool = False
    depth: int = 1
    max_experts: int = 4
    predictor: str = "gate"

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= PREFETCH_MAX_DEPTH:
            raise ConfigError(f"prefetch depth must be between 1 and {PREFETCH_MAX_DEPTH} layers, got {self.depth}")
        if self.max_experts < 1:
            raise ConfigError(f"prefetch max experts per layer call must be at least 1, got {self.max_experts}")
        if self.predictor not in PREFETCH_PREDICTORS:
            raise ConfigError(f"prefetch predictor must be one of {', '.join(PREFETCH_PREDICTORS)}, "
                              f"got {self.predictor!r}")  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    """Which domain computes each expert (a name in moetier.policies.schedulers.SCHEDULERS; None:
    everything on the compute device), and the hardware profile the cost model prices work with
    (a profile name, yours (`moetier profile`) or a shipped one, or a path; None: this-machine
    if present, else a built-in conservative CPU profile). Hybrid CPU-GPU execution needs a CUDA
    device; on a CPU machine the scheduler only prices prefetch choices."""

    name: str | None = None
    profile: str | None = None


PRECISION_MODES = ("auto", "full", "int8", "int4", "int2", *GGML_PRECISIONS, "stored", "dynamic")
STORED = "stored"  # slots hold the checkpoint's own (quantised) bytes; its bits depend on the checkpoint
TIER_PRECISIONS = (*PRECISION_BITS, *GGML_PRECISIONS)  # what --hi / --lo take besides "stored"


@dataclass(frozen=True)
class PrecisionConfig:
    """Expert precision. A static mode keeps every expert at one precision; "dynamic" keeps
    hot experts at `hi` and cold ones at `lo` under the compute tier's expert budget (DynaExq).
    "auto" (the default) is "stored" for a checkpoint whose experts the native kernels compute as stored (GGUF
    block types: kernels/ggml.py; GPTQ / AWQ / compressed-tensors int4: store/source.py StoredIntSource; block-scaled
    FP8: StoredFp8Source), else
    "full"; runtime/wire.py resolves it when a model is opened.

    `groups` overrides the quantisation group size per precision, e.g. (("int4", 64),); the
    quantized disk tiers are looked up under `quant_dir` (default MODEL/moetier-quant).
    Controller: EMA factor `alpha` per token, a decision every `period` tokens, `hysteresis`
    (a challenger must beat an incumbent's score by this factor), `warmup_tokens` of the first
    text seed the hot set before serving. `spare_slots` extra low-precision slots let a
    demotion start before a promotion frees one (counted in the budget). `sync` waits for every
    switch to finish before the next forward (reproducible experiments).
    `transient_slots` high-precision slots beyond the hot quota are the transient buffer (paper 3.4):
    up to that many promotions are in flight before the demotions that make room for them have run
    (counted in the budget; 0 = one switch at a time). `lookahead` > 0 ranks experts by their EMA
    extrapolated that many periods ahead (promote ahead of need; 0 = Algorithm 1). `prefetch` stages
    the high-precision bytes of experts predicted to be promoted at the next decision from disk into
    the host DRAM cache (Budgets.host_cache_bytes) between decisions.
    """

    mode: str = "auto"
    hi: str = "full"
    lo: str = "int4"
    groups: tuple[tuple[str, int], ...] = ()
    quant_dir: str | None = None
    alpha: float = 0.99
    period: int = 128
    hysteresis: float = 0.1
    warmup_tokens: int = 256
    spare_slots: int = 1
    sync: bool = False
    transient_slots: int = 0
    lookahead: float = 0.0
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.mode not in PRECISION_MODES:
            raise ConfigError(f"precision must be one of {', '.join(PRECISION_MODES)}, got {self.mode!r}")
        for name in ("hi", "lo"):
            if getattr(self, name) not in TIER_PRECISIONS and getattr(self, name) != STORED:
                value = getattr(self, name)
                raise ConfigError(
                    f"--{name} precision must be one of {', '.join(TIER_PRECISIONS)}, stored, got {value!r}"
                )
        # "stored" has no fixed bits: with it, hi above lo is checked by slot bytes when the store is built
        hi_bits, lo_bits = precision_bits(self.hi), precision_bits(self.lo)
        below = self.hi == self.lo or (hi_bits is not None and lo_bits is not None and hi_bits <= lo_bits)
        if self.mode == "dynamic" and below:
            raise ConfigError(f"dynamic precision needs hi above lo, got hi={self.hi} lo={self.lo}")
        for prec, group in self.groups:
            if prec not in ("int8", "int4", "int2"):
                why = " (a ggml block type: its blocks are its groups)" if prec in GGML_PRECISIONS else ""
                raise ConfigError(f"group size given for {prec!r}{why}; only int8, int4 and int2 have groups")
            if group not in (32, 64, 128, 256) and not (prec == "int8" and group == 0):
                raise ConfigError(f"{prec} group size must be 32, 64, 128 or 256, got {group}")
        if not 0 < self.alpha < 1:
            raise ConfigError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.period < 1:
            raise ConfigError(f"period must be at least 1 token, got {self.period}")
        if self.hysteresis < 0:
            raise ConfigError(f"hysteresis must not be negative, got {self.hysteresis}")
        if self.warmup_tokens < 0 or self.spare_slots < 1:
            raise ConfigError(
                f"warmup_tokens must be >= 0 and spare_slots >= 1, got {self.warmup_tokens}, {self.spare_slots}"
            )
        if self.transient_slots < 0:
            raise ConfigError(f"transient_slots must be >= 0, got {self.transient_slots}")
        if not 0 <= self.lookahead <= 16:
            raise ConfigError(f"lookahead must be between 0 and 16 periods, got {self.lookahead}")

    def group(self, precision: str) -> int | None:
        """The configured group size of `precision`, None for its default (0 = per row for int8)."""
        return next((g for p, g in self.groups if p == precision), None)

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions this config reads: one static, or (hi, lo)."""
        return (self.hi, self.lo) if self.mode == "dynamic" else (self.mode,)


SPARSITY_MAX = 0.95
SPARSITY_BLOCKS = (1, 4, 8, 16, 32)


@dataclass(frozen=True)
class SparsityConfig:
    """Intra-expert activation sparsity: routed experts are masked, shared experts stay dense (the paper's
    system, its 4.1). `target` is the fraction of neurons skipped (0 = off, up to 0.95). With `scope`
    "total" (the paper's Table 2 target) it is the total activation sparsity: skipped (token, neuron)
    pairs over every active neuron of a token, the shared experts' counted (as active); the routed
    experts then skip target * (k*I + S) / (k*I) of theirs (k routed experts of I neurons, S shared
    neurons per token). With "routed" it is the routed experts' own sparsity (the same when a model has
    no shared experts). The routed fraction maps to a per-layer threshold through the calibrated table
    at `table` (default MODEL/moetier-sparsity/thresholds.json, written by `moetier calibrate`).
    `block` > 1 masks neurons in groups of that many (beyond the paper). `tipping` is the token
    count per expert from which the dense path runs instead of the gather path; None measures it at
    start (cached per machine and shape; on CUDA from the --profile's GPU roofline when one is named),
    0 always uses the dense path. `dense` is what that path computes: "original", the unmasked dense
    expert (the paper's switch: exact), or "masked", the dense matmuls with the same mask (the sparse
    model's function at every batch size, for measuring its quality).
    """

    target: float = 0.0
    table: str | None = None
    block: int = 1
    tipping: int | None = None
    scope: Literal["total", "routed"] = "total"
    dense: Literal["original", "masked"] = "original"

    def __post_init__(self) -> None:
        if not 0 <= self.target <= SPARSITY_MAX:
            raise ConfigError(f"sparsity must be between 0 and {SPARSITY_MAX}, got {self.target}")
        if self.block not in SPARSITY_BLOCKS:
            raise ConfigError(f"sparsity block must be one of {', '.join(map(str, SPARSITY_BLOCKS))}, got {self.block}")
        if self.tipping is not None and self.tipping < 0:
            raise ConfigError(f"sparsity tipping point must be >= 0 tokens, got {self.tipping}")
        if self.scope not in ("total", "routed"):
            raise ConfigError(f"sparsity scope must be 'total' or 'routed', got {self.scope!r}")
        if self.dense not in ("original", "masked"):
            raise ConfigError(f"sparsity dense path must be 'original' or 'masked', got {self.dense!r}")

    @property
    def enabled(self) -> bool:
        return self.target > 0


@dataclass(frozen=True)
class RoutingConfig:
    """Overrides of the router's decision (policies/routing.py, runtime/route_override.py), applied where a MoE
    layer has routed, before its observers and experts. Fewer active experts per token: `max_k` caps the experts a
    token computes (0 = the model's top-k), `threshold` drops a pair whose renormalised weight is below it (the
    heaviest pair always kept), `renormalize` scales the kept weights back to the top-k's sum. `prune` is a file
    of pruned experts per layer (`moetier prune`): the router chooses among the others. `follow_trace` is a
    routing trace whose ids and weights replace the router's (a benchmark mode: the text output is meaningless,
    the I/O is the engine's own under that routing)."""

    threshold: float = 0.0
    max_k: int = 0
    renormalize: bool = True
    prune: str | None = None
    follow_trace: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise ConfigError(f"expert weight threshold must be in [0, 1), got {self.threshold}")
        if self.max_k < 0:
            raise ConfigError(f"experts-per-token cap must be at least 1 (0 = off), got {self.max_k}")
        for name in ("prune", "follow_trace"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ConfigError(f"routing {name} must be a file or None, got an empty string")

    @property
    def reduces(self) -> bool:
        """Whether the per-token reduction is on (the cap is checked against top-k when a model is opened)."""
        return self.threshold > 0.0 or self.max_k > 0

    @property
    def enabled(self) -> bool:
        return self.reduces or self.prune is not None or self.follow_trace is not None


DENSE_PRECISIONS = ("full", "int8", "int4")


@dataclass(frozen=True)
class RuntimeConfig:
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    lean: bool = True  # use the engine's own decoder where the family supports it
    seam: bool = False  # run transformers' own MoE blocks with moetier's experts even where a family row exists
    max_seq_len: int = 0  # KV-cache length for the lean decoder; 0 = the model's own limit, capped at 4096
    native_kernels: bool = True  # build and use the C sparse kernel (kernels/native.py); False: torch ops
    kernel_cache: str | None = None  # folder of kernel builds and tipping profiles; None = ~/.cache/moetier
    dense_precision: str = "full"  # non-expert weights (attention, output head): full, int8 (Q8_0) or int4 (Q4_0)
    native_step: bool = True  # the lean decoder's layers as two native calls each (runtime/native_step.py)
    step_rows: int = 128  # rows per native step call (prompts run in chunks of this many tokens; its scratch)
    # expert reads from disk (formats/diskio.py): "direct" = O_DIRECT (bypassing the page cache; buffered +
    # fadvise DONTNEED where the filesystem refuses it), "buffered" = through the page cache, "auto" = direct for
    # experts of at least 1 MiB, buffered for smaller ones (runtime/precision.py); io_depth reads in flight
    disk_io: str = "auto"
    io_depth: int = 8
    preload: bool = False  # fill the host expert tier at load (as llama.cpp populates its mapping), not on first use
    # the native decode step's numerics (runtime/native_step.py, csrc/step.h mt_step.xw): "bf16" rounds the residual
    # stream, projection outputs, attention and router as transformers' bf16 model does; "fp32" keeps them in fp32
    # with fp16 KV caches and returns fp32 logits, as llama.cpp does (only what a matmul reads takes the weights'
    # activation form); "auto": fp32 for a GGUF file (llama.cpp's own format and reference) where the native step
    # runs, bf16 otherwise
    residual: str = "auto"

    def wide(self, gguf: bool) -> bool:
        """Whether the native step runs wide (`residual`: fp32, or auto for a GGUF file, `gguf`)."""
        return self.residual == "fp32" or (self.residual == "auto" and gguf)

    def __post_init__(self) -> None:
        if self.dense_precision not in DENSE_PRECISIONS:
            raise ConfigError(
                f"dense_precision must be one of {', '.join(DENSE_PRECISIONS)}, got {self.dense_precision!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise ConfigError(f"dtype must be auto, bf16, fp32 or fp16, got {self.dtype!r}")
        if self.max_seq_len < 0:
            raise ConfigError(f"max_seq_len must not be negative, got {self.max_seq_len}")
        if self.residual not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"residual must be auto, bf16 or fp32, got {self.residual!r}")
        if self.disk_io not in ("auto", "direct", "buffered"):
            raise ConfigError(f"disk_io must be auto, direct or buffered, got {self.disk_io!r}")
        if not 1 <= self.io_depth <= 64:
            raise ConfigError(f"io_depth must be in 1..64, got {self.io_depth}")
        if not 1 <= self.step_rows <= 4096:
            raise ConfigError(f"step_rows must be in 1..4096, got {self.step_rows}")
        if self.kernel_cache is not None and not self.kernel_cache.strip():
            raise ConfigError("kernel_cache must be a folder or None (the default), got an empty string")


@dataclass(frozen=True)
class EngineConfig:
    budgets: Budgets = field(default_factory=Budgets)
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy when temperature == 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
