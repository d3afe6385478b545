"""`moetier profile`: measure this machine into a HardwareProfile (policies/costmodel.py).

What is measured, in order (one progress step each):
1. per-expert compute time against token load, per precision (full = the model dtype, int8, int4), on
   synthetic experts of a reference shape (default the benchmark model's H=1024, I=256), and again on a
   small 128x128 expert (the fixed per-call cost; see costmodel's small_luts), in the engine's
   own layouts (SlotPool rows for full precision, ExpertFormat/QuantPool slots for int8/int4) through
   the engine's expert function (kernels/experts.SwiGLU, whose matmuls pick their kernel per call),
   rotating over enough experts
   to leave the CPU caches, as the engine's decode path does -> `luts`, `lut_shape`;
2. streaming bandwidth of a GEMV over a large bf16 matrix (dense weights) -> `mem_bw`, `dense_bw`;
3. the engine's own overheads beyond the weights it reads, from its decode time on tiny random
   checkpoints (runtime/profile_engine.py) -> `layer_overhead_s`, `token_overhead_s`, `dispatch_s`,
   and the disk link's `latency_s` (its per-miss cost);
4. disk read bandwidth of a temp file (runtime/profile_disk.py), cold (O_DIRECT, or posix_fadvise
   DONTNEED where O_DIRECT is refused) and through the page cache; `disk` holds the page-cache figure
   (the engine reads experts from memory-mapped safetensors, which stay in the page cache after first
   touch), notes hold both;
5. the extra time of the first expert of a layer call on the CPU (HybriMoE Fig. 3e), at decode load (1 token
   per expert) on `first_experts` experts of the reference shape in the LUT's precision (full when measured),
   over `first_rounds` calls with a `flush_mb` MiB read between them (runtime/profile_first_expert.py) ->
   `first_expert_s`, recorded only when beyond the noise of the later positions (else 0; the note says why);
6. host -> GPU copy bandwidth and the same expert LUTs on the GPU when CUDA is present (written, but
   unverified: the machine this was written on has no GPU).
`peak_flops` is the best expert FLOP rate measured in step 1 and `overhead_s` the small expert's
1-token time. Timing is the best of rounds of a mean over a minimum duration.
Invariants: the temp file is removed; torch's thread count is restored; no process-wide flag is
changed (the projections use kernels/matmul.linear, as the engine does).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moetier.errors import ConfigError
from moetier.formats.layout import ExpertLayout
from moetier.formats.quant import QuantSpec, quantize_expert
from moetier.kernels import native
from moetier.kernels.experts import SwiGLU
from moetier.kernels.matmul import linear
from moetier.kernels.qformat import ExpertFormat
from moetier.policies.costmodel import ComputeProfile, HardwareProfile, LinkProfile
from moetier.runtime.profile_disk import disk_bandwidth
from moetier.runtime.profile_engine import EngineOverheads, engine_overheads
from moetier.runtime.profile_first_expert import MIN_EXPERTS, FirstExpert, first_expert_estimate, position_times
from moetier.store.pool import QuantPool, SlotPool
from moetier.types import Precision

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PRECISIONS = ("full", "int8", "int4")
ROTATE_BYTES = 96 << 20  # experts rotated over per timing: beyond a 32 MiB L3
SMALL_SHAPE = (128, 128)  # second LUT shape: the fixed per-call cost (costmodel: time linear in params)


@dataclass(frozen=True)
class ProfileOptions:
    name: str = "this-machine"
    threads: int | None = None  # None: torch's current setting
    quick: bool = False  # few points, tiny sizes: seconds (tests)
    hidden: int = 1024
    inter: int = 256
    counts: tuple[int, ...] = COUNTS
    precisions: tuple[str, ...] = PRECISIONS
    disk_mb: int = 256
    gemv_mb: int = 96
    tmp_dir: Path | None = None
    min_s: float = 0.003  # per timing round: short, so some rounds fall between other processes
    rounds: int = 25
    first_experts: int = 8  # experts per layer call in the first-expert step (step 5)
    first_rounds: int = 40  # layer calls it times (medians per position over them)
    flush_mb: int = ROTATE_BYTES >> 20  # buffer read before each of those calls (the work between MoE layers)

    def resolved(self) -> ProfileOptions:
        """Quick mode shrinks every size and count; validates the rest."""
        for p in self.precisions:
            if p not in PRECISIONS:
                raise ConfigError(f"profile: unknown precision {p!r}; expected some of {', '.join(PRECISIONS)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"profile: --threads must be >= 1, got {self.threads}")
        if self.first_experts < MIN_EXPERTS or self.first_rounds < 1 or self.flush_mb < 0:
            raise ConfigError(
                f"profile: the first-expert step needs >= {MIN_EXPERTS} experts, >= 1 round and flush_mb >= 0, "
                f"got {self.first_experts}, {self.first_rounds}, {self.flush_mb}"
            )
        if (
            min(self.hidden, self.inter) < 128
            or self.hidden % 128
            or self.inter % 128
            or self.hidden == 128 == self.inter
        ):
            raise ConfigError(
                f"profile: expert shape must be multiples of 128 and larger than {SMALL_SHAPE}, got "
                f"H={self.hidden}, I={self.inter}"
            )
        if not self.quick:
            return self
        return ProfileOptions(
            name=self.name, threads=self.threads, quick=True, hidden=256, inter=128, counts=(1, 4, 16),
            precisions=self.precisions, disk_mb=4, gemv_mb=4, tmp_dir=self.tmp_dir, min_s=0.002, rounds=1,
            first_experts=4, first_rounds=3, flush_mb=4,
        )  # fmt: skip


def n_steps(opts: ProfileOptions) -> int:
    """Progress steps `measure` reports (GPU steps included when CUDA is present)."""
    cpu = len(opts.precisions) + 4
    return cpu + (len(opts.precisions) + 2 if torch.cuda.is_available() else 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, min_s: float, rounds: int) -> float:
    """Best over `rounds` of the mean time of fn() over at least `min_s` seconds (after one warm-up). The best,
    not the median: on a shared machine other processes only ever add time."""
    fn()
    _sync(device)
    res = []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            if n % 4 == 0 or device.type != "cuda":
                _sync(device)
                el = time.perf_counter() - t0
                if el >= min_s:
                    break
        res.append(el / n)
    return min(res)


# 1. Experts ---------------------------------------------------------------------------------------------------
def synthetic_experts(precision: str, hidden: int, inter: int, device: torch.device, n_max: int = 64) -> list[Any]:
    """Slot views of random experts in the engine's layout (enough of them to exceed ROTATE_BYTES, 2..n_max).
    Quantised slots are packed once from an RTN-quantised random expert and copied (same bytes, same cost)."""
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout(hidden=hidden, inter=inter, has_bias=False)
    pieces = {
        "gate": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,  # [I, H]
        "up": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,  # [I, H]
        "down": torch.randn(hidden, inter, generator=gen) * inter**-0.5,  # [H, I]
    }
    if precision == "full":
        slot = layout.slot_bytes(2)
        pool = SlotPool(layout, max(2, min(n_max, ROTATE_BYTES // slot)), torch.bfloat16, device)
        flat = torch.cat([pieces["gate"].flatten(), pieces["up"].flatten(), pieces["down"].flatten()])  # [numel]
        pool.buf.copy_(flat.to(torch.bfloat16).expand_as(pool.buf))
        return list(pool.views)
    spec = QuantSpec(Precision(precision))
    fmt = ExpertFormat(layout, spec, torch.bfloat16, device)
    qpool = QuantPool(fmt, max(2, min(n_max, ROTATE_BYTES // fmt.slot_bytes)), device)
    canonical = {k: v.to(device) for k, v in quantize_expert(pieces, spec, method="rtn").items()}
    fmt.pack_into(canonical, qpool.views[0])
    qpool.buf[1:].copy_(qpool.buf[0].expand_as(qpool.buf[1:]))
    return list(qpool.views)


def expert_lut(
    precision: str, opts: ProfileOptions, device: torch.device, shape: tuple[int, int] | None = None
) -> tuple[tuple[int, float], ...]:  # fmt: skip
    """(tokens, seconds) of one expert call (expert function + weighted accumulate, as the engine's loop) on
    experts of `shape` (hidden, inter), default the options' reference shape."""
    hidden, inter = shape or (opts.hidden, opts.inter)
    experts = synthetic_experts(precision, hidden, inter, device)
    fn = SwiGLU(F.silu)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(max(opts.counts), hidden, generator=gen).to(device, torch.bfloat16)  # [N, H]
    it = [0]
    out: list[tuple[int, float]] = []
    with torch.inference_mode():
        for c in opts.counts:
            x = x_all[:c].contiguous()  # [c, H]
            acc = torch.zeros_like(x)  # [c, H]

            def call(x: torch.Tensor = x, acc: torch.Tensor = acc) -> None:
                it[0] = (it[0] + 1) % len(experts)
                acc.add_(fn(x, experts[it[0]]), alpha=0.5)

            out.append((c, best_time(call, device, opts.min_s, opts.rounds)))
    return tuple(out)


# 2. Dense streaming bandwidth ---------------------------------------------------------------------------------
def gemv_bandwidth(opts: ProfileOptions, device: torch.device) -> float:
    """Bytes/s of y = W x for one token over a bf16 W of about gemv_mb MiB (cache-cold)."""
    k = 4096 if opts.gemv_mb >= 64 else 1024
    n = max(64, (opts.gemv_mb << 20) // (2 * k))
    w = torch.randn(n, k, device=device).to(torch.bfloat16)  # [N, K]
    x = torch.randn(1, k, device=device).to(torch.bfloat16)  # [1, K]
    with torch.inference_mode():
        t = best_time(lambda: linear(x, w), device, opts.min_s, opts.rounds)
    return w.numel() * w.element_size() / t


# 3. Per-layer fixed overhead ----------------------------------------------------------------------------------
def layer_overhead(opts: ProfileOptions, device: torch.device, context: int = 16) -> float:
    """Seconds of one decode step of a tiny decoder layer (H=64, 4 heads, 8 experts): norms, q/k/v/o, attention
    over `context` keys, router softmax and top-2. Its weights are ~70 KB, so this is the fixed dispatch cost."""
    h, nh, e = 64, 4, 8
    g = torch.Generator().manual_seed(2)

    def mk(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(device, torch.bfloat16)

    wq, wk, wv, wo, wr = mk(h, h), mk(h, h), mk(h, h), mk(h, h), mk(e, h)
    n1, n2 = torch.ones(h, device=device, dtype=torch.bfloat16), torch.ones(h, device=device, dtype=torch.bfloat16)
    kc, vc = mk(1, nh, context, h // nh), mk(1, nh, context, h // nh)  # [B, nh, S, hd]
    x = mk(1, 1, h)  # [B, T, H]

    def step() -> torch.Tensor:
        a = F.rms_norm(x, (h,), n1)
        q = linear(a, wq).view(1, 1, nh, -1).transpose(1, 2)  # [B, nh, 1, hd]
        k = torch.cat([kc, linear(a, wk).view(1, 1, nh, -1).transpose(1, 2)], dim=2)  # [B, nh, S+1, hd]
        v = torch.cat([vc, linear(a, wv).view(1, 1, nh, -1).transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 1, h)  # [B, 1, H]
        y = x + linear(o, wo)
        r = torch.softmax(linear(F.rms_norm(y, (h,), n2), wr).float(), dim=-1)  # [B, 1, E]
        torch.topk(r, 2, dim=-1)
        return y

    with torch.inference_mode():
        return best_time(step, device, opts.min_s, opts.rounds)


# 5. The first expert of a layer call (HybriMoE Fig. 3e) -----------------------------------------------------------
def first_expert(opts: ProfileOptions) -> tuple[FirstExpert, str]:
    """The CPU's first-expert figure at decode load (1 token per expert) in the LUT's precision (full when
    measured) on the reference shape, and the note that says how it was measured and why it is what it is."""
    precision = "full" if "full" in opts.precisions else opts.precisions[0]
    experts = synthetic_experts(precision, opts.hidden, opts.inter, torch.device("cpu"), n_max=opts.first_experts)
    if len(experts) < opts.first_experts:  # synthetic_experts caps the count at ROTATE_BYTES of experts
        raise ConfigError(
            f"profile: {opts.first_experts} experts of H={opts.hidden}, I={opts.inter} exceed "
            f"{ROTATE_BYTES >> 20} MiB; use fewer (first_experts)"
        )
    times = position_times(experts, opts.hidden, (1,), opts.first_rounds, opts.flush_mb << 20)[1]
    est = first_expert_estimate(times)
    note = (
        f"{est.reason}. Extra time of the first expert of a layer call on the CPU (HybriMoE Fig. 3e): "
        f"{opts.first_experts} {precision} experts of H={opts.hidden}, I={opts.inter} at 1 token each, "
        f"{opts.first_rounds} calls with a {opts.flush_mb} MiB read before each; median per position; recorded "
        "only when the first position's median exceeds the later positions' median by more than their spread "
        "(runtime/profile_first_expert.py)"
    )
    return est, note


# 6. Host -> GPU ---------------------------------------------------------------------------------------------------
def pcie_bandwidth(opts: ProfileOptions) -> tuple[float, float]:
    """(bytes/s, latency s) of pinned host -> GPU copies (unverified: written without a GPU)."""
    dev = torch.device("cuda")
    src = torch.empty(max(1, opts.disk_mb) << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    t = best_time(lambda: dst.copy_(src, non_blocking=True), dev, opts.min_s, opts.rounds)
    s_src, s_dst = src[:4096], dst[:4096]
    lat = best_time(lambda: s_dst.copy_(s_src, non_blocking=True), dev, opts.min_s, opts.rounds)
    return src.numel() / t, lat


# 7. All together --------------------------------------------------------------------------------------------------
Luts = dict[str, tuple[tuple[int, float], ...]]


def _luts(opts: ProfileOptions, device: torch.device, say: Callable[[str], None]) -> tuple[Luts, Luts]:
    """Per precision: the LUT on the reference shape and on SMALL_SHAPE (one progress step each)."""
    luts: Luts = {}
    small: Luts = {}
    for p in opts.precisions:
        say(f"{device.type} expert {p}")
        luts[p] = expert_lut(p, opts, device)
        small[p] = expert_lut(p, opts, device, SMALL_SHAPE)
    return luts, small


def _engine_overheads(opts: ProfileOptions, luts: Luts, small: Luts, bw: float, disk_bw: float) -> EngineOverheads:
    """Overheads measured on the engine itself (runtime/profile_engine.py)."""
    draft = HardwareProfile(
        name="draft", source="", cpu=_compute_profile(luts, small, bw, 0.0, opts), gpu=None, pcie=None,
        disk=LinkProfile(bandwidth=disk_bw), cpu_threads=torch.get_num_threads(), host_mem_bytes=1, gpu_mem_bytes=None,
    )  # fmt: skip
    return engine_overheads(draft, tokens=8 if opts.quick else 48, rounds=1 if opts.quick else 3)


def _compute_profile(luts: Luts, small: Luts, bw: float, layer_s: float, opts: ProfileOptions) -> ComputeProfile:
    """peak_flops: best FLOP rate of the full-precision LUT; overhead_s: the small expert's 1-token time."""
    flops_per_token = 2 * 3 * opts.hidden * opts.inter
    full = luts.get("full") or next(iter(luts.values()))
    peak = max(flops_per_token * n / t for n, t in full)
    tiny = small.get("full") or next(iter(small.values()))
    overhead = tiny[0][1] if tiny[0][0] == 1 else 0.0
    return ComputeProfile(peak_flops=peak, mem_bw=bw, overhead_s=overhead, luts=luts,
                          lut_shape=(opts.hidden, opts.inter), dense_bw=bw, layer_overhead_s=layer_s,
                          small_luts=small, small_shape=SMALL_SHAPE)  # fmt: skip


def _cpu_model() -> str:
    """The CPU model and the matrix ISAs the expert kernels can use, e.g. "Intel Xeon ... (AMX: yes, AVX-512: yes)"
    (a profile records the machine it came from; the simulators' --cpu-profile says which it used)."""
    model, flags = native.cpu_info()
    model = model or platform.processor() or platform.machine()
    if not flags:
        return model
    amx, avx512 = any(f.startswith("amx") for f in flags), any(f.startswith("avx512") for f in flags)
    return f"{model} (AMX: {'yes' if amx else 'no'}, AVX-512: {'yes' if avx512 else 'no'})"


def measure(
    opts: ProfileOptions, step: Callable[[str], None] | None = None
) -> tuple[HardwareProfile, dict[str, Any]]:  # fmt: skip
    """Measure this machine. `step(description)` is called before each of `n_steps(opts)` steps.
    Returns the profile and notes (sources, both disk figures, the machine)."""
    opts = opts.resolved()
    say = step or (lambda _d: None)
    old_threads = torch.get_num_threads()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    try:
        cpu = torch.device("cpu")
        luts, small = _luts(opts, cpu, say)
        say("cpu GEMV bandwidth")
        bw = gemv_bandwidth(opts, cpu)
        say("disk read bandwidth")
        disk = disk_bandwidth(opts)
        say("engine overheads (decoding tiny checkpoints)")
        eng = _engine_overheads(opts, luts, small, bw, disk["cached_bw"])
        say("cpu first expert of a layer call")
        first, first_note = first_expert(opts)
        gpu, pcie, gpu_mem, gpu_notes = _measure_gpu(opts, say) if torch.cuda.is_available() else (None, None, None, {})
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    host_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = HardwareProfile(
        name=opts.name, source=f"measured by `moetier profile` on {_cpu_model()} ({time.strftime('%Y-%m-%d')})",
        cpu=replace(_compute_profile(luts, small, bw, eng.layer_overhead_s, opts),
                    token_overhead_s=eng.token_overhead_s, dispatch_s=eng.dispatch_s,
                    first_expert_s=first.first_expert_s),
        gpu=gpu, pcie=pcie,
        disk=LinkProfile(bandwidth=disk["cached_bw"], latency_s=max(disk["cached_latency_s"], eng.miss_latency_s)),
        cpu_threads=threads, host_mem_bytes=host_mem, gpu_mem_bytes=gpu_mem,
    )  # fmt: skip
    notes = {
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {threads} threads",
        "luts": f"one expert call (SwiGLU + weighted accumulate) of shape H={opts.hidden}, I={opts.inter} in the "
        f"engine's layouts, rotating over >= {ROTATE_BYTES >> 20} MiB of experts; tokens: {list(opts.counts)}",
        "cpu.mem_bw": "bf16 GEMV of one token over a cache-cold matrix (dense_bw is the same figure)",
        "cpu.peak_flops": "best expert FLOP rate in the full-precision LUT (2*3*H*I*tokens / time)",
        "cpu.overhead_s": f"1-token full-precision call of a {SMALL_SHAPE} expert (its weights sit in L2)",
        "cpu.small_luts": f"the same LUTs on a {SMALL_SHAPE} expert: with luts they make time linear in expert params "
        "(keeps the fixed per-call cost for small experts)",
        "cpu.layer_overhead_s": "the engine's own per-layer cost beyond the priced weights: slope of its decode time "
        f"over depth on tiny random Qwen3-MoE checkpoints, minus the priced dense part and experts "
        f"(runtime/profile_engine.py): {eng.raw}",
        "cpu.token_overhead_s": "the engine's fixed cost per forward beyond the layers and the LM head (same runs)",
        "cpu.dispatch_s": "the engine's bookkeeping per expert call: decode time per extra expert (top-8 vs top-4) "
        "minus the LUT's expert call",
        "cpu.first_expert_s": first_note,
        "disk.latency_s": "the engine's own cost of one miss beyond its bytes (a quarter-budget run against the "
        f"resident one), or the 4 KiB read latency ({disk['cached_latency_s'] * 1e6:.1f} us) if larger",
        "disk": f"page-cache read of a {disk['file_bytes'] >> 20} MiB temp file in {disk['folder']} "
        f"({disk['cached_bw'] / 1e9:.2f} GB/s; latency = mean 4 KiB read): what the engine sees once an expert's "
        "safetensors pages were touched",
        "disk_cold": f"{disk['cold_bw'] / 1e9:.3f} GB/s reading the same file with {disk['cold_method']} "
        "(first touch of an expert)",
        "load_avg": _load_note(threads),
        "quick": opts.quick,
    } | gpu_notes  # fmt: skip
    return profile, notes


def _load_note(threads: int) -> str:
    """The 1-minute load average when measured; a warning when other processes competed for the cores."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    busy = load > max(1, cores - threads) + 0.5
    warn = "; other processes competed for the cores, re-run on an idle machine for cleaner figures" if busy else ""
    return f"{load:.2f} on {cores} logical CPUs at the end of the run{warn}"


def _measure_gpu(
    opts: ProfileOptions, say: Callable[[str], None]
) -> tuple[ComputeProfile, LinkProfile, int, dict[str, str]]:  # fmt: skip
    """GPU expert LUTs, HBM GEMV bandwidth and pinned host -> GPU copies (unverified: written without a GPU)."""
    dev = torch.device("cuda")
    luts, small = _luts(opts, dev, say)
    say("gpu GEMV bandwidth")
    bw = gemv_bandwidth(opts, dev)
    say("host -> gpu copies")
    pbw, plat = pcie_bandwidth(opts)
    prof = _compute_profile(luts, small, bw, layer_overhead(opts, dev), opts)
    notes = {
        "gpu": f"{torch.cuda.get_device_name(dev)}; GPU path of `moetier profile` is UNVERIFIED "
        "(written on a machine without CUDA)",
        "pcie": "pinned host -> device copy_ of disk_mb MiB; latency: 4 KiB",
    }
    return prof, LinkProfile(bandwidth=pbw, latency_s=plat), torch.cuda.get_device_properties(dev).total_memory, notes
