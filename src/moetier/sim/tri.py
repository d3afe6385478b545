"""Decode simulation on the three-domain TriMoE machine (GPU + AMX CPU + DIMM-NDP), paper 4-5.

`simulate_tri(spec, calls, config)` replays MoE layer calls (traces.Call, in order) through one three-domain
scheduler, named in policies.schedulers.TRI_SCHEDULERS (klotski, ktransformers-plus, monde, gpu-ndp, trimoe;
one file each in policies/). The simulator reads what a scheduler may do from its declared capabilities
(schedule_tri_base.TriScheduler), never from its name:
- `domains`: where it computes; with NDP among them the machine starts from the offline layout below;
- `refines`: it gets config.max_iters refinement moves when config.refinement is on, else 0;
- `prefetches`: hot experts prefetched into HBM over PCIe in the background;
- `relayouts` / `rebalances`: relayouts / cold migrations over the DIMM-Link, when config.relayout is on.
Schedulers with NDP start from an offline layout ("we set an optimized initial layout via offline trace analysis
(e.g., localizing cold experts onto single DIMMs)", 4.3): the experts cold in each layer's profile loads are
localised, spread over DIMMs by longest-processing-time first; the others are striped. A scheduler declaring
`localises_all` (MoNDE, whose experts live in the memory device that computes them) has every routed expert
localised the same way. Schedulers without NDP keep
every expert striped. All start with the same HBM set: per layer the floor(hbm_ratio * E) most loaded experts of
its profile loads. The profile loads (the offline trace analysis stand-in) come from a profiling window:
config.warmup_steps = W > 0 takes the first W distinct decode steps of `calls` (sorted by step) as the window, never
replayed or timed; a layer's profile loads are its mean loads over the window's calls, and the EMA predictor starts
from them (eq. 8's first value, not scored). W = 0 (the behaviour before the window): each layer's profile loads are
its first replayed call's, and the predictor starts empty. Every system gets the same window (baselines' HBM too).

Per call: (1) price it (sim/ndp.py, eq. 1-4, shared experts on the GPU); (2) the scheduler assigns domains
(its Plan), makespan (eq. 5-7) = the call's MoE time; (3) score the actions planned after the layer's previous
call (predictor.decision_right: the "migration decision accuracy" of 4.3) and update the EMA predictor (eq. 8);
(4) plan background actions (policies/predictor.plan_actions) hidden by the layer's GPU attention/dense time (the
window; 5.5: "masked by the ~0.68 ms concurrent GPU computation"), PCIe prefetches in the part of it the KV stream
leaves free. config.dimm_link prices the DIMM-Link: "calibrated" (the default, issue 30) on 5.5's "~0.63 ms cost
of migrating up to four experts": one shared fabric at NdpParams.link_fabric_bw (239.7 GB/s: four Qwen3-235B
experts in 0.63 ms), moves one after another within the window; "per-link" (Table 1's "25GB/s per Link", a
labelled variant): one expert over one 25 GB/s link, moves on disjoint DIMM ports in parallel
(predictor.link_ports: four Qwen3 experts in about 1.5-1.8 ms, 6.0 ms if serial); "all-links": each move
spread over every DIMM's link, cost / D; (5) apply them: the
actions the scheduler declares (prefetches, relayouts, rebalancing migrations): prefetches enter HBM
(evicting the least-predicted non-hot resident when the layer's HBM share is full), relayouts change layout
and home DIMM, migrations change the home DIMM. A decode step = sum of its calls' MoE time + every decoder
layer's attention/dense time (batched: non-expert weights read once, KV cache of `context` tokens per
sequence, an ESTIMATE, read by the GPU) + the LM head; throughput = batch / step time. The KV cache lives where
config.kv_home says: "host" (the default, 4.1: "the large KV Cache and all routed experts are offloaded to host
DIMMs"): each decoder layer's KV crosses PCIe from the host DIMMs to the GPU for its attention
(NdpMachine.kv_s), so the layer takes max(GPU work, KV stream) and PCIe prefetches get only the window the
stream leaves; the prefill writes the prompt's KV back the same way. "hbm": the KV stays in HBM (the labelled
variant, the model before issue 30). The result's `kv` counts the bytes, the PCIe time and the time it adds.
Klotski's multi-batch
pipeline (a scheduler declaring `pipelines = True` gets `schedule(..., window_s=...)`) gets the PCIe time of the
call's window that the previous call's prefetches left free.

Prefill (config.prefill_tokens > 0, paper 4.1: "During the prefill phase, it [the GPU] performs all inference
computations"; 2.2: "experts are widely activated, and GPU computation largely hides I/O overhead"): one prompt of
prefill_tokens per sequence, every layer once; each MoE layer's experts take the layer's mean decode routing times
prefill_tokens tokens, computed on the GPU from the offline HBM set with the others streamed over PCIe under the
compute: max(sum f_calc, sum max(T_PCIe, T_DRAM)); the dense work is one batched call of batch x prefill_tokens
tokens (attention within the prompt not counted: an ESTIMATE). The same phase for every system (the baselines
also run prefill on the GPU: a simplification for kTransformers, whose prefill may use the CPU).
End-to-end throughput = batch x output_len / (prefill_s + output_len x step_s) (output_len 0: the steps).

A measured CPU (config.cpu_profile, issue 17: "a profile measured there gives the CPU domain of TriMoE and
kTransformers from measurement, marked with the machine it came from"): the named profile's CPU compute section
(peak expert FLOP/s, its efficiency curve, per-expert overhead; `moetier profile` writes it, with the CPU model
and its AMX/AVX-512 flags in its source) replaces the profile's AMX CPU for every system; host-memory reads stay
the machine's (Table 1's 8 channels x 2 DIMMs, which the NDPs share), since a CPU measured elsewhere did not read
these DIMMs. The result's `extra["cpu_source"]` names where the CPU came from.

Utilisation: `busy` / `compute` are per MoE time (the study's columns since issue 6); `step_util` is per step
time, with the attention/dense work counted as GPU compute (it runs on the GPU in every system): the reading of
the paper's Table 3 "GPU Compute Utilization" as the fraction of wall time a GPU kernel runs.

Invariants (tests/sim/test_tri.py): every routed expert of a call is assigned exactly once; a scheduler only
uses its domains; HBM residency per layer never exceeds its share; link time per call never exceeds its
window; the run is a pure function of (spec, calls, config); the profiling window's calls are never timed and act
only through their mean loads (tests/sim/test_tri_window.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moetier.errors import ConfigError
from moetier.policies.costmodel import CostModel
from moetier.policies.hwprofile import HardwareProfile, load_profile
from moetier.policies.predictor import Action, ActionKind, ExpertState, FractionRule, Heat, LoadPredictor, plan_actions
from moetier.policies.schedule_trimoe import MAX_ITERS
from moetier.policies.schedulers import check_tri_scheduler, make_tri_scheduler
from moetier.sim.ndp import CONTENTION, DEFAULT_PROFILE, NdpMachine, load_ndp, price_call
from moetier.specs import ModelSpec
from moetier.types import Domain, ExpertKey, Layout

PAPER_DRIFT = 2.5  # the "paper" regime's drift (REGIMES): 78.1% of migration decisions right, Qwen3-235B, batch 512
DIMM_LINK = ("calibrated", "per-link", "all-links")
KV_HOMES = ("host", "hbm")
# Synthetic trace regimes (issue 30): name -> (drift: popularity rank swaps per layer per step, None: the preset's;
# step_noise). "paper" (the default) is calibrated on 4.3's "78% migration decision accuracy" (decision_accuracy)
# at batch 512 with every other default (docs/trimoe.md, "The regime"); the others are named options: "calm" (the
# presets), "drifting" (issue 17's drift 24, class accuracy ~75%), "stationary" (issue 17's second column).
REGIMES: dict[str, tuple[float | None, float]] = {
    "paper": (PAPER_DRIFT, 0.0),
    "calm": (None, 0.0),
    "drifting": (24.0, 0.0),
    "stationary": (0.0, 0.9),
}
NEVER = 1e30  # a finite action cost that never fits a window (actions a scheduler does not have)
_G, _C, _N = Domain.ACCEL, Domain.HOST, Domain.NDP


@dataclass(frozen=True)
class TriSimConfig:
    """One three-domain run. Frozen and checked on construction: a bad value is a ConfigError naming the field
    (the field names are the sweep's "tri" point parameters and the `moetier simulate-tri` flags)."""

    scheduler: str = "trimoe"  # a name in policies.schedulers.TRI_SCHEDULERS
    ndp_count: int = 16  # NDP DIMMs
    cpu_tflops_scale: float = 1.0  # CPU TFLOPS relative to the profile's AMX (paper 5.4.2)
    hbm_ratio: float = 0.1  # fraction of each layer's routed experts HBM holds
    batch_size: int = 512  # for synthetic calls; the simulation uses the calls' own token counts
    steps: int = 8
    seed: int = 0
    refinement: bool = True
    relayout: bool = True
    context: int = 1024  # KV length per sequence for the attention time
    profile: str = DEFAULT_PROFILE
    max_iters: int = MAX_ITERS
    regime: str = "paper"  # synthetic calls: a name in REGIMES (its drift and step noise, unless given below)
    drift: float | None = None  # synthetic calls: popularity rank swaps per layer per step (None: the regime's)
    step_noise: float | None = None  # synthetic calls: sd of the batch-shared logit offset per step
    # (synthetic.SynthParams; None: the regime's)
    contention: str | None = None  # eq. 6 reading, "channel" or "array" (None: the profile's NDP section)
    dimm_link: str = "calibrated"  # DIMM-Link move pricing: "calibrated", "per-link" or "all-links" (docstring)
    kv_home: str = "host"  # where the KV cache lives: "host" DIMMs (4.1, streamed over PCIe) or "hbm" (variant)
    prefill_tokens: int = 0  # prompt tokens per sequence for the prefill phase (0: no prefill)
    output_len: int = 0  # decode tokens per sequence for the end-to-end throughput (0: steps)
    warmup_steps: int = 0  # profiling window: decode steps before the replayed ones, never timed (0: first call)
    cpu_profile: str | None = None  # a measured profile (`moetier profile` on an AMX machine) whose CPU compute
    # replaces the profile's (module docstring); None: the profile's own CPU

    def __post_init__(self) -> None:
        check_tri_scheduler(self.scheduler)
        if self.drift is not None and not (_number(self.drift) and math.isfinite(self.drift) and self.drift >= 0):
            raise ConfigError(f"TriSimConfig: drift must be a number >= 0, got {self.drift!r}")
        if self.regime not in REGIMES:
            raise ConfigError(f"TriSimConfig: regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        if self.kv_home not in KV_HOMES:
            raise ConfigError(f"TriSimConfig: kv_home must be one of {', '.join(KV_HOMES)}, got {self.kv_home!r}")
        if self.step_noise is not None and not (
            _number(self.step_noise) and math.isfinite(self.step_noise) and self.step_noise >= 0
        ):
            raise ConfigError(f"TriSimConfig: step_noise must be a number >= 0, got {self.step_noise!r}")
        if self.dimm_link not in DIMM_LINK:
            raise ConfigError(f"TriSimConfig: dimm_link must be one of {', '.join(DIMM_LINK)}, got {self.dimm_link!r}")
        if self.contention is not None and self.contention not in CONTENTION:
            raise ConfigError(f"TriSimConfig: contention must be one of {', '.join(CONTENTION)}, "
                              f"got {self.contention!r}")  # fmt: skip
        for name in ("ndp_count", "batch_size", "steps"):
            v = getattr(self, name)
            if not _int(v) or v < 1:
                raise ConfigError(f"TriSimConfig: {name} must be an int >= 1, got {v!r}")
        for name in ("context", "max_iters", "prefill_tokens", "output_len", "warmup_steps"):
            v = getattr(self, name)
            if not _int(v) or v < 0:
                raise ConfigError(f"TriSimConfig: {name} must be an int >= 0, got {v!r}")
        if not _int(self.seed):
            raise ConfigError(f"TriSimConfig: seed must be an int, got {self.seed!r}")
        for name in ("refinement", "relayout"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TriSimConfig: {name} must be true or false, got {getattr(self, name)!r}")
        if not (_number(self.cpu_tflops_scale) and math.isfinite(self.cpu_tflops_scale) and self.cpu_tflops_scale > 0):
            raise ConfigError(f"TriSimConfig: cpu_tflops_scale must be a number > 0, got {self.cpu_tflops_scale!r}")
        if not (_number(self.hbm_ratio) and 0.0 <= self.hbm_ratio <= 1.0):
            raise ConfigError(f"TriSimConfig: hbm_ratio must be in [0, 1], got {self.hbm_ratio!r}")
        if not isinstance(self.profile, str):
            raise ConfigError(f"TriSimConfig: profile must be a profile name or path, got {self.profile!r}")
        if self.cpu_profile is not None and not (isinstance(self.cpu_profile, str) and self.cpu_profile):
            raise ConfigError(f"TriSimConfig: cpu_profile must be a profile name or path, got {self.cpu_profile!r}")

    def trace_regime(self) -> tuple[float | None, float]:
        """(drift, step_noise) of the synthetic calls: the fields when given, else the regime's (REGIMES)."""
        drift, noise = REGIMES[self.regime]
        return (drift if self.drift is None else float(self.drift),
                noise if self.step_noise is None else float(self.step_noise))  # fmt: skip


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class TriSimResult:
    scheduler: str
    model: str
    steps: int
    calls: int
    batch: float  # mean tokens per call
    moe_s: float  # sum of the calls' makespans
    greedy_moe_s: float  # the same with the greedy start's makespans (refining schedulers; else = moe_s)
    dense_s: float  # attention/dense/head time of all steps
    step_s: float  # mean decode step time
    throughput_tok_s: float
    busy: Mapping[str, float]  # domain busy time / MoE time: gpu, cpu, ndp (mean DIMM compute), dimm (incl. eq. 6)
    flop_util: Mapping[str, float]  # FLOPs done / (peak x MoE time): gpu, cpu, ndp
    compute: Mapping[str, float]  # time computing (f_calc, not waiting on PCIe/DRAM) / MoE time; ndp: mean DIMM
    experts: Mapping[str, int]  # routed (call, expert) pairs computed per domain
    routed: int  # routed (call, expert) pairs in the calls
    predictor: Mapping[str, float]
    migration: Mapping[str, float]
    moves: int  # refinement moves
    step_util: Mapping[str, float] = field(default_factory=dict)  # per step time (module docstring)
    prefill_s: float = 0.0  # the prefill phase (0 without one)
    e2e_tok_s: float = 0.0  # batch x output_len / (prefill_s + output_len x step_s)
    localised: Mapping[str, int] = field(default_factory=dict)  # routed experts computed per domain from a
    # localised layout (GPU: not resident), e.g. warm experts a stale layout left on one DIMM
    localised_read_s: Mapping[str, float] = field(default_factory=dict)  # their weight-read times, summed (eq. 2-4:
    # one channel's bandwidth for GPU and CPU, the DIMM's internal bandwidth for NDP)
    kv: Mapping[str, float] = field(default_factory=dict)  # the KV cache's traffic (module docstring): bytes and
    # pcie_s streamed over PCIe in decode (0 with kv_home "hbm"), exposed_s: step time it added beyond the GPU's work
    extra: dict[str, Any] = field(default_factory=dict)


def _dense_s(cm: CostModel, spec: ModelSpec, batch: int, context: int, moe: bool) -> float:
    """One decoder layer's non-expert work for a batch: weights once, each sequence's KV cache from HBM."""
    gpu = cm.profile.gpu
    assert gpu is not None
    kv = batch * context * spec.kv_bytes_per_token() / (gpu.dense_bw or gpu.mem_bw)
    return cm.dense_s("gpu", batch, 0, moe) + kv


def _initial(
    m: NdpMachine, loads: np.ndarray, cap: int, ndp_layout: bool, layer: int,
    layouts: dict[ExpertKey, Layout], homes: dict[ExpertKey, int], all_local: bool = False,
) -> set[int]:  # fmt: skip
    """Offline placement of one layer from its profile loads [E] (the window's mean or the first call's); returns
    its HBM set (expert ids). `all_local` (MoNDE's `localises_all`): every routed expert localised, not only the
    cold non-resident ones."""
    order = np.lexsort((np.arange(loads.shape[0]), -loads))  # by load desc, ties to the lower id
    resident = {int(e) for e in order[:cap]}
    if ndp_layout:
        cls = FractionRule().classify(loads)
        ndp = np.maximum(m.ndp_calc(loads), m.internal_s())  # [E]
        acc = np.zeros(m.ndp.n_dimms)
        for e in order:  # longest processing time first onto the least loaded DIMM
            if all_local or (cls[e] == Heat.COLD and int(e) not in resident):
                d = int(np.argmin(acc))
                acc[d] += ndp[e]
                layouts[ExpertKey(layer, int(e))], homes[ExpertKey(layer, int(e))] = Layout.LOCALISED, d
    return resident


def _states_link_s(m: NdpMachine, dimm_link: str) -> float:
    """One expert's DIMM-Link move (cost_s of a relayout or migration) under a DIMM_LINK reading."""
    if dimm_link == "calibrated":
        return m.link_s(fabric=True)
    return m.link_s() / (m.ndp.n_dimms if dimm_link == "all-links" else 1)


def _states(
    m: NdpMachine, layer: int, pred: np.ndarray, cls: np.ndarray, resident: set[int],
    layouts: Mapping[ExpertKey, Layout], homes: Mapping[ExpertKey, int], actions: tuple[bool, bool, bool],
    dimm_link: str = "calibrated",
) -> list[ExpertState]:  # fmt: skip
    """Planner inputs for the non-resident experts of one layer (resident ones take no action); `actions`:
    (prefetch, relayout, rebalance) allowed. Without DIMM-Link actions only hot experts (prefetch candidates).
    `dimm_link`: one expert over the calibrated fabric, over one link, or over all of them (module docstring)."""
    prefetch, relayout, rebalance = actions
    link = _states_link_s(m, dimm_link)
    pcie = m.pcie_s() if prefetch else NEVER
    relayout_s, migrate_s = (link if relayout else NEVER), (link if rebalance else NEVER)
    moves = relayout or rebalance
    ids = [e for e in range(pred.shape[0]) if not (e in resident or (not moves and cls[e] != Heat.HOT))]
    out = []
    for e, times in zip(ids, m.path_times(pred[ids]), strict=True):
        key = ExpertKey(layer, e)
        lay = layouts.get(key, Layout.STRIPED)
        out.append(ExpertState(key, Heat(int(cls[e])), False, lay, homes.get(key, -1) if lay == Layout.LOCALISED
                               else -1, times, pcie, relayout_s, migrate_s))  # fmt: skip
    return out


def _prefill_s(
    m: NdpMachine, cm: CostModel, spec: ModelSpec, cfg: TriSimConfig, batch: int,
    mean_loads: Mapping[int, np.ndarray], hbm: Mapping[int, set[int]],
) -> float:  # fmt: skip
    """The prefill phase (module docstring): every MoE layer's experts on the GPU, weights streamed under compute."""
    if cfg.prefill_tokens <= 0:
        return 0.0
    tokens = batch * cfg.prefill_tokens
    total = cm.head_s("gpu", batch)
    kv_write = m.kv_s(batch, cfg.prefill_tokens)[0] if cfg.kv_home == "host" else 0.0  # the prompt's KV to the DIMMs
    for i in range(spec.num_layers):
        total += max(cm.dense_s("gpu", tokens, 0, i in spec.moe_layers), kv_write)
    for layer, loads in mean_loads.items():
        n = np.ceil(loads * cfg.prefill_tokens)  # [E] tokens per expert over the prompts
        routed = n > 0
        calc = float(m.gpu_calc(n[routed]).sum())
        if spec.num_shared:
            calc += spec.num_shared * float(m.gpu_calc(np.asarray([tokens]), shared=True)[0])
        miss = int(sum(1 for e in np.flatnonzero(routed) if int(e) not in hbm[layer]))
        stream = miss * max(m.pcie_s(), m.dram_s(Layout.STRIPED))
        total += max(calc, stream)
    return total


def _split_window(calls: Sequence[Any], w: int) -> tuple[list[Any], list[Any]]:
    """(window calls, replayed calls): the calls of the first `w` distinct steps (sorted) and the rest."""
    if w == 0:
        return [], list(calls)
    order = sorted({int(c.step) for c in calls})
    if w >= len(order):
        raise ConfigError(f"simulate_tri: warmup_steps {w} leaves no step to replay (the calls hold {len(order)} "
                          "distinct steps)")  # fmt: skip
    window = set(order[:w])
    return [c for c in calls if int(c.step) in window], [c for c in calls if int(c.step) not in window]


def profile_loads(calls: Sequence[Any], warmup_steps: int, num_experts: int) -> tuple[dict[int, np.ndarray], list[Any]]:
    """(profile loads per layer [E], replayed calls): with warmup_steps W > 0 each layer's mean load per expert over
    the calls of the first W distinct steps (the profiling window, dropped from the replayed calls); with W = 0 each
    layer's first call's loads, every call replayed. A layer absent from the window has no profile loads (it is
    placed at its first replayed call)."""
    window, replayed = _split_window(calls, warmup_steps)
    tot: dict[int, np.ndarray] = {}
    n: dict[int, int] = {}
    for c in window or replayed:
        layer = int(c.layer)
        if not window and layer in tot:
            continue  # W = 0: the first call only
        tot[layer] = tot.get(layer, 0.0) + np.bincount(np.asarray(c.ids).ravel(), minlength=num_experts)
        n[layer] = n.get(layer, 0) + 1
    return {layer: np.asarray(v, dtype=np.float64) / n[layer] for layer, v in tot.items()}, replayed


@dataclass(frozen=True)
class OfflineLayout:
    """The starting state of a run (simulate_tri's, before its first replayed call)."""

    profile: dict[int, np.ndarray]  # layer -> profile loads [E]
    hbm: dict[int, frozenset[int]]  # layer -> HBM-resident expert ids
    localised: dict[ExpertKey, int]  # localised expert -> home DIMM (the others striped)


def _place(
    m: NdpMachine, prof: Mapping[int, np.ndarray], cap: int, ndp_layout: bool, all_local: bool = False
) -> tuple[dict[int, set[int]], dict[ExpertKey, Layout], dict[ExpertKey, int]]:
    """`_initial` over every layer with profile loads: (HBM set per layer, layouts, homes)."""
    layouts: dict[ExpertKey, Layout] = {}
    homes: dict[ExpertKey, int] = {}
    resident = {layer: _initial(m, v, cap, ndp_layout, layer, layouts, homes, all_local)
                for layer, v in sorted(prof.items())}  # fmt: skip
    return resident, layouts, homes


def machine_profile(cfg: TriSimConfig) -> HardwareProfile:
    """cfg.profile, with its CPU compute section taken from cfg.cpu_profile when one is named (the module
    docstring): ConfigError when that profile cannot be read."""
    profile = load_profile(cfg.profile)
    if cfg.cpu_profile is None:
        return profile
    cpu = load_profile(cfg.cpu_profile)
    return replace(profile, cpu=cpu.cpu, cpu_threads=cpu.cpu_threads,
                   source=f"{profile.source}; CPU compute from {cpu.name}: {cpu.source}")  # fmt: skip


def cpu_source(cfg: TriSimConfig) -> str:
    """Where the simulated CPU's compute comes from: "name: source" of cfg.cpu_profile, else of cfg.profile."""
    p = load_profile(cfg.cpu_profile or cfg.profile)
    return f"{p.name}: {p.source}"


def _machine(spec: ModelSpec, cfg: TriSimConfig) -> tuple[NdpMachine, CostModel]:
    profile = machine_profile(cfg)
    ndp = replace(load_ndp(cfg.profile), n_dimms=cfg.ndp_count)
    m = NdpMachine(spec, profile, ndp if cfg.contention is None else replace(ndp, contention=cfg.contention),
                   cfg.cpu_tflops_scale)  # fmt: skip
    return m, CostModel(profile, spec)


def offline_layout(spec: ModelSpec, calls: Sequence[Any], config: TriSimConfig) -> OfflineLayout:
    """The offline placement simulate_tri starts config.scheduler from (module docstring): per layer the HBM set
    and, for a scheduler with NDP, the localised cold experts and their DIMMs, from `profile_loads`."""
    m, _ = _machine(spec, config)
    sched = make_tri_scheduler(config.scheduler)
    ndp_layout = Domain.NDP in sched.domains
    cap = int(config.hbm_ratio * spec.num_experts)
    prof, _ = profile_loads(calls, config.warmup_steps, spec.num_experts)
    resident, _, homes = _place(m, prof, cap, ndp_layout, bool(getattr(sched, "localises_all", False)))
    return OfflineLayout(prof, {layer: frozenset(r) for layer, r in resident.items()}, homes)


def simulate_tri(spec: ModelSpec, calls: Sequence[Any], config: TriSimConfig) -> TriSimResult:
    """Replay `calls` (traces.Call: step, layer, ids [T, k]) through config.scheduler, the first
    config.warmup_steps distinct steps being the untimed profiling window; see the module docstring."""
    # 1. Machine, cost model, scheduler, checks
    cfg, sched = config, make_tri_scheduler(config.scheduler)
    m, cm = _machine(spec, cfg)
    if not calls:
        raise ConfigError("simulate_tri: no layer calls to replay")
    E, layers = spec.num_experts, set(spec.moe_layers)
    for c in calls:
        ids = np.asarray(c.ids)
        if c.layer not in layers:
            raise ConfigError(f"simulate_tri: call of layer {c.layer}, not an MoE layer of {spec.name!r}")
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.min() < 0 or ids.max() >= E:
            raise ConfigError(f"simulate_tri: layer {c.layer} step {c.step}: ids must be [T > 0, k] in [0, {E})")
    refine = cfg.max_iters if (sched.refines and cfg.refinement) else 0
    actions = (sched.prefetches, sched.relayouts and cfg.relayout, sched.rebalances and cfg.relayout)
    ndp_layout = Domain.NDP in sched.domains
    all_local = bool(getattr(sched, "localises_all", False))  # declared by a scheduler that localises every expert
    cap = int(cfg.hbm_ratio * E)
    pred = LoadPredictor(sorted(layers), E)
    kv_host = cfg.kv_home == "host"
    # 2. State: HBM set per layer, layouts and homes (offline placement from the profiling window's mean loads,
    # or, without a window, at a layer's first call); the predictor starts from the window's mean loads
    prof, calls = profile_loads(calls, cfg.warmup_steps, E)
    resident, layouts, homes = _place(m, prof, cap, ndp_layout, all_local)
    initial_hbm = {layer: set(r) for layer, r in resident.items()}
    if cfg.warmup_steps:
        for layer, v in sorted(prof.items()):
            pred.update(layer, v)  # eq. 8's first value (no prediction stands yet, so nothing is scored)
    moe = greedy_moe = win_total = 0.0
    busy = dict.fromkeys(("gpu", "cpu", "ndp", "dimm"), 0.0)
    flops = dict.fromkeys(("gpu", "cpu", "ndp"), 0.0)
    calc = dict.fromkeys(("gpu", "cpu", "ndp"), 0.0)  # compute time (eq. 1-4's f_calc parts; NDP: per DIMM)
    n_exp = dict.fromkeys(("gpu", "cpu", "ndp"), 0)
    loc_n = dict.fromkeys(("gpu", "cpu", "ndp"), 0)  # routed experts computed per domain from a localised layout
    loc_read = dict.fromkeys(("gpu", "cpu", "ndp"), 0.0)  # their weight reads (one channel; NDP: in-DIMM)
    mig: dict[str, float] = {"prefetch": 0, "relayout": 0, "migrate": 0, "pcie_s": 0.0, "dimm_link_s": 0.0}
    routed = moves = 0
    last_pcie = 0.0  # PCIe time the previous call's prefetches took from the next window
    layer_loads: dict[int, np.ndarray] = {}
    pending: dict[int, tuple[Action, ...]] = {}  # layer -> the actions planned after its last call (scored next)
    moved_per_call: list[int] = []  # DIMM-Link moves per layer call (relayouts + migrations)
    kv = {"bytes": 0.0, "pcie_s": 0.0}
    name = {_G: "gpu", _C: "cpu", _N: "ndp"}
    for c in calls:
        ids = np.asarray(c.ids)
        T, layer = int(ids.shape[0]), int(c.layer)
        loads = np.bincount(ids.ravel(), minlength=E).astype(np.float64)  # [E]
        if layer not in resident:
            resident[layer] = _initial(m, loads, cap, ndp_layout, layer, layouts, homes, all_local)
            initial_hbm[layer] = set(resident[layer])
        layer_loads[layer] = layer_loads.get(layer, 0.0) + loads
        res = resident[layer]
        # 3. Price and assign
        counts = {int(e): int(loads[e]) for e in np.flatnonzero(loads)}
        experts = price_call(m, layer, counts, {ExpertKey(layer, e) for e in res}, layouts, homes, shared_tokens=T)
        hot = frozenset(int(e) for e in np.flatnonzero(pred.classes(layer) == Heat.HOT))  # none before a call or window
        window = _dense_s(cm, spec, T, cfg.context, True)  # the GPU's attention/dense work: the DIMM-Link's window
        kv_s, kv_b = m.kv_s(T, cfg.context) if kv_host else (0.0, 0)  # this layer's KV over PCIe (4.1)
        kv["bytes"] += kv_b
        kv["pcie_s"] += kv_s
        pcie_window = max(0.0, window - kv_s)  # PCIe left free in the window by the KV stream
        if getattr(sched, "pipelines", False):  # declared by a scheduler that streams under the window (klotski)
            out = sched.schedule(experts, cfg.ndp_count, hot, refine, window_s=max(0.0, pcie_window - last_pcie))  # type: ignore[call-arg]
        else:
            out = sched.schedule(experts, cfg.ndp_count, hot, refine)
        doms, tot, gtot, mv = out.plan.domains, out.totals, out.greedy, out.moves
        moe, greedy_moe = moe + tot.makespan, greedy_moe + gtot.makespan
        moves, routed = moves + mv, routed + len(counts)
        busy["gpu"] += tot.gpu_s
        busy["cpu"] += tot.cpu_s
        busy["dimm"] += float(np.mean(tot.dimm_s))
        busy["ndp"] += float(np.mean(np.subtract(tot.dimm_s, tot.contention_s)))
        for e in experts:
            d = name[doms[e.key]]
            flops[d] += e.tokens * (m.shared_flops_tok if e.key.expert < 0 else m.flops_tok)
            calc[d] += e.gpu_calc_s if d == "gpu" else e.cpu_calc_s if d == "cpu" else e.ndp_calc_s / cfg.ndp_count
            n_exp[d] += e.key.expert >= 0
            if e.layout is Layout.LOCALISED and not (d == "gpu" and e.resident):  # read from its one DIMM
                loc_n[d] += 1
                loc_read[d] += e.dram_s if d != "ndp" else e.internal_s
        # 4. Score the last call's decisions, the predictor, then background actions hidden by this layer's window
        if layer in pending:
            pred.stats.record_decisions(pending[layer], pred.rule.classify(loads))
        pred.update(layer, loads)
        win_total += window
        p, cls = pred.predict(layer), pred.classes(layer)
        states = _states(m, layer, p, cls, res, layouts, homes, actions, cfg.dimm_link)
        evictable = sorted((e for e in res if cls[e] != Heat.HOT), key=lambda e: (p[e], e))
        plan = plan_actions(states, cfg.ndp_count, window, dimm_base_s=tot.contention_s or None,
                            hbm_free_slots=max(0, cap - len(res)) + len(evictable), pcie_window_s=pcie_window,
                            fabric=cfg.dimm_link == "calibrated")  # fmt: skip
        pending[layer] = plan.actions
        moved_per_call.append(sum(a.kind is not ActionKind.PREFETCH for a in plan.actions))
        # 5. Apply them
        for a in plan.actions:
            mig[a.kind.value] += 1
            if a.kind is ActionKind.PREFETCH:
                if len(res) >= cap:
                    res.discard(evictable.pop(0))
                res.add(a.key.expert)
            elif a.kind is ActionKind.RELAYOUT and a.layout is Layout.STRIPED:
                layouts[a.key] = Layout.STRIPED
                homes.pop(a.key, None)
            else:
                assert a.dst_dimm is not None
                layouts[a.key], homes[a.key] = Layout.LOCALISED, a.dst_dimm
        last_pcie = plan.pcie_s
        mig["pcie_s"] += plan.pcie_s
        mig["dimm_link_s"] += plan.dimm_link_s
    # 6. Step time: MoE + every decoder layer's dense work + head, per distinct step
    steps = len({c.step for c in calls})
    batch = sum(int(np.asarray(c.ids).shape[0]) for c in calls) / len(calls)
    b = max(1, round(batch))
    kv_layer = m.kv_s(b, cfg.context)[0] if kv_host else 0.0  # each decoder layer's KV stream (all layers attend)
    gpu_layer = [_dense_s(cm, spec, b, cfg.context, i in layers) for i in range(spec.num_layers)]
    dense_layer = [max(g, kv_layer) for g in gpu_layer]  # the GPU's work, or the KV stream feeding it
    dense = steps * (sum(dense_layer) + cm.head_s("gpu", b))
    kv_out = {"bytes": kv["bytes"], "pcie_s": kv["pcie_s"], "host": float(kv_host),
              "exposed_s": steps * (sum(dense_layer) - sum(gpu_layer))}  # fmt: skip
    step_s = (moe + dense) / steps
    run = moe + dense
    step_util = {
        "busy_gpu": (busy["gpu"] + dense) / run,
        "compute_gpu": (calc["gpu"] + dense) / run,
        "busy_cpu": busy["cpu"] / run,
        "compute_cpu": calc["cpu"] / run,
        "compute_ndp": calc["ndp"] / run,
    }
    prefill = _prefill_s(m, cm, spec, cfg, b, {k: v / (steps or 1) for k, v in layer_loads.items()}, initial_hbm)
    out_len = cfg.output_len or steps
    e2e = b * out_len / (prefill + out_len * step_s)
    peak = {"gpu": m.gpu.peak_flops, "cpu": m.cpu.peak_flops * cfg.cpu_tflops_scale,
            "ndp": m.ndp.ndp_flops * cfg.ndp_count}  # fmt: skip
    link_s = mig["pcie_s"] + mig["dimm_link_s"]
    mig.update(pcie_bytes=mig["prefetch"] * m.nbytes, dimm_link_bytes=(mig["relayout"] + mig["migrate"]) * m.nbytes,
               window_s=win_total, link_frac=link_s / max(moe + dense, 1e-30),
               moves_max=float(max(moved_per_call, default=0)),
               moves_mean=float(np.mean(moved_per_call)) if moved_per_call else 0.0,
               move_s=_states_link_s(m, cfg.dimm_link))  # fmt: skip
    return TriSimResult(
        scheduler=cfg.scheduler, model=spec.name, steps=steps, calls=len(calls), batch=batch, moe_s=moe,
        greedy_moe_s=greedy_moe, dense_s=dense, step_s=step_s, throughput_tok_s=b / step_s,
        busy={k: v / moe for k, v in busy.items()}, flop_util={k: flops[k] / (peak[k] * moe) for k in flops},
        compute={k: v / moe for k, v in calc.items()},
        experts=n_exp, routed=routed, predictor=pred.stats.as_dict(), migration=mig, moves=moves,
        step_util=step_util, prefill_s=prefill, e2e_tok_s=e2e, localised=loc_n, localised_read_s=loc_read,
        kv=kv_out, extra={"cpu_source": cpu_source(cfg)},
    )  # fmt: skip


__all__ = ["DIMM_LINK", "KV_HOMES", "PAPER_DRIFT", "REGIMES", "OfflineLayout", "TriSimConfig", "TriSimResult",
           "cpu_source", "machine_profile", "offline_layout", "profile_loads", "simulate_tri"]  # fmt: skip
