"""The three-domain machine of TriMoE (GPU + AMX CPU + DIMM-NDP) and its per-expert pricer (paper 4.1, 4.2).

`NdpParams` (frozen): the near-data tier that no shipped profile measures. Defaults are TriMoE Table 1:
16 DIMM-NDPs, each a GEMV unit of 256 GFLOPS bf16 reading its own DIMM at 153.6 GB/s internal bandwidth;
DIMM-Link 25 GB/s per link (Table 1; the "per-link" reading, one link port per DIMM, policies/predictor.link_ports)
and `link_fabric_bw`, the DIMM-Link's aggregate rate calibrated on 5.5 ("the ~0.63 ms cost of migrating up to four
experts", on the Qwen3-235B-A22B experts of that paragraph: 4 x 37,748,736 B / 0.63 ms = 239.7 GB/s, about 9.6 links
of 25 GB/s moving at once: the "calibrated" reading, sim/tri.py's default); host DRAM of 8 channels at
307.2 GB/s (`channels`: a localised expert is read at its DIMM's channel rate,
307.2 / 8 = 38.4 GB/s, the "single-DIMM bandwidth" of eq. 2-3).
`load_ndp` reads the optional "ndp" section of a profile JSON (moetier/data/profiles/*.json), defaults otherwise; the
profile loader in policies/hwprofile.py ignores that section, so old profiles stay valid.

`NdpMachine` = a HardwareProfile (GPU, CPU, PCIe: the shipped profile h100-8470 holds Table 1's numbers) +
NdpParams + a CPU TFLOPS scale (the sensitivity sweep of paper 5.4.2). Compute time against token load
(the paper's lookup tables): f_calc(n) = 6*H*I*n / (peak * eff(n)) + overhead for the GPU and CPU, eff(n)
the profile's efficiency curve (flat beyond its ends: about 30% at 256 tokens per expert on an H100);
for an NDP unit f_calc = 6*H*I*n / ndp_flops (a GEMV unit, no batching gain) plus the activations moved
to and from the DIMM (2 * n * H * dtype bytes at one DIMM's share of host bandwidth, MoNDE's
"activation migration"). Weight reads: T_PCIe = latency + W / pcie_bw, T_DRAM = schedule_tri_base.dram_read_s,
T_Internal = W / ndp_bw; DIMM-Link moves of one expert (relayout or migration): W / link_bw over one link, or
W / link_fabric_bw on the calibrated fabric (`link_s`).

Eq. 6 contention, `busy_s` (how long a host read of an expert keeps each DIMM it touches busy), has two
readings, picked by NdpParams.contention:
- "channel" (default, issue 30): eq. 6 defines T_contention^d as "the accumulated DRAM access latency caused by
  striped or localized weight reads from the host processors targeting DIMM d": the DIMM serves a host read for
  the whole channel transfer, busy_s = T_DRAM (W / B on every DIMM for a striped expert, W * channels / B on its
  home for a localised one). Every DIMM's T_DIMM then holds at least (striped host bytes) / B, so through eq. 7
  the GPU's and CPU's host reads together never exceed the channels' 307.2 GB/s. Under it a host read always
  keeps a DIMM busier than the NDP would (W * 8 / B > W / ndp_bw). Simplification: a localised read charges
  its home DIMM only, not the other DIMM of its channel.
- "array" (labelled variant, the default before issue 30): the DIMM's DRAM arrays are the shared resource. They
  deliver ndp_bw (4 ranks in parallel); a host read of b bytes from the DIMM takes b / ndp_bw of that capacity,
  the rest of the transfer is the channel's time, already in T_DRAM (eq. 2-3). Striped: W / D / ndp_bw on every
  DIMM; localised: W / ndp_bw on its home. Host reads are then not capped at B across the GPU and CPU.

`price_call` turns one layer call (expert -> tokens), the HBM residency, layouts and home DIMMs into
schedule_tri_base.TriExpert costs (eq. 1-4); shared experts (ids -1, -2, ...) are resident and GPU-only
(their CPU cost is `GPU_ONLY`, a finite stand-in for "never").

Invariants: every time is finite and >= 0; more tokens never cost less; a striped expert has no home DIMM.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetier.errors import ConfigError
from moetier.policies.hwprofile import (
    ComputeProfile,
    HardwareProfile,
    load_profile,
    read_profile_json,
    section_from_dict,
)
from moetier.policies.predictor import PathTimes
from moetier.policies.schedule_tri_base import TriExpert, dram_read_s
from moetier.specs import ModelSpec
from moetier.types import ExpertKey, Layout

CONTENTION = ("channel", "array")
QWEN3_EXPERT_BYTES = 37_748_736  # one Qwen3-235B-A22B routed expert, bf16 (3 x 4096 x 1536 x 2 B): 5.5's model
MIGRATE4_S = 0.63e-3  # 5.5: "the ~0.63 ms cost of migrating up to four experts"
GPU_ONLY = 1e30  # a finite "never" for paths a shared expert may not take
DEFAULT_PROFILE = "h100-8470"


@dataclass(frozen=True)
class NdpParams:
    """DIMM-NDP tier, TriMoE Table 1 (see the module docstring)."""

    n_dimms: int = 16
    ndp_flops: float = 256e9  # per DIMM, bf16
    ndp_bw: float = 153.6e9  # per DIMM internal bandwidth, bytes/s
    link_bw: float = 25e9  # DIMM-Link, bytes/s per link (Table 1)
    link_fabric_bw: float = 4 * QWEN3_EXPERT_BYTES / MIGRATE4_S  # DIMM-Link, aggregate bytes/s calibrated on 5.5
    host_bw: float = 307.2e9  # 8 channels DDR5-4800
    channels: int = 8  # memory channels (Table 1: "8 Channels x 2 DIMM"); single-DIMM reads run at host_bw / channels
    contention: str = "channel"  # eq. 6 reading: "channel" or "array" (module docstring)

    def __post_init__(self) -> None:
        if self.contention not in CONTENTION:
            raise ConfigError(f"NdpParams: contention must be one of {', '.join(CONTENTION)}, got {self.contention!r}")
        if isinstance(self.n_dimms, bool) or not isinstance(self.n_dimms, int) or self.n_dimms < 1:
            raise ConfigError(f"NdpParams: n_dimms must be an int >= 1, got {self.n_dimms!r}")
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) or self.channels < 1:
            raise ConfigError(f"NdpParams: channels must be an int >= 1, got {self.channels!r}")
        for name in ("ndp_flops", "ndp_bw", "link_bw", "link_fabric_bw", "host_bw"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"NdpParams: {name} must be a finite number > 0, got {v!r}")


def ndp_from_dict(d: Mapping[str, Any] | None, where: str = "ndp") -> NdpParams:
    """NdpParams from a profile's "ndp" section (None -> defaults); unknown keys are a ConfigError."""
    if d is None:
        return NdpParams()
    params: NdpParams = section_from_dict(d, NdpParams, where)
    return params


def load_ndp(name_or_path: str | Path = DEFAULT_PROFILE) -> NdpParams:
    """The "ndp" section of a shipped profile (by name) or a profile .json path; Table 1 defaults without one."""
    path, d = read_profile_json(name_or_path)
    return ndp_from_dict(d.get("ndp") if isinstance(d, dict) else None, f"{path}: ndp")


def _calc(c: ComputeProfile, flops: np.ndarray, tokens: np.ndarray, scale: float) -> np.ndarray:
    """Roofline-LUT compute time of matmuls of `flops` at `tokens` tokens each (0 tokens -> 0)."""
    if c.efficiency:
        xs, ys = zip(*c.efficiency, strict=True)
        eff = np.interp(tokens, xs, ys)  # flat beyond the ends, as ComputeProfile.eff
    else:
        eff = np.ones_like(tokens)
    out = flops / (c.peak_flops * scale * eff) + c.overhead_s
    return np.where(tokens > 0, out, 0.0)


class NdpMachine:
    """GPU + AMX CPU + DIMM-NDP pricing for one model (see the module docstring)."""

    def __init__(
        self, spec: ModelSpec, profile: HardwareProfile | None = None, ndp: NdpParams | None = None,
        cpu_scale: float = 1.0,
    ) -> None:  # fmt: skip
        # 1. Check and keep the parts
        self.profile = profile if profile is not None else load_profile(DEFAULT_PROFILE)
        if self.profile.gpu is None or self.profile.pcie is None:
            raise ConfigError(f"profile {self.profile.name!r} has no GPU; the three-domain machine needs one")
        if not (math.isfinite(cpu_scale) and cpu_scale > 0):
            raise ConfigError(f"cpu_scale must be a finite number > 0, got {cpu_scale!r}")
        self.spec, self.ndp, self.cpu_scale = spec, ndp if ndp is not None else NdpParams(), float(cpu_scale)
        self.gpu: ComputeProfile = self.profile.gpu
        self.cpu: ComputeProfile = self.profile.cpu
        # 2. Per-expert constants: weight bytes and FLOPs per token (3 matrices, 2 FLOPs per MAC)
        self.nbytes = spec.expert_bytes("full")
        self.shared_nbytes = spec.shared_bytes("full")
        self.flops_tok = 6 * spec.hidden * spec.moe_inter
        self.shared_flops_tok = 6 * spec.hidden * spec.shared_inter
        self.act_bytes_tok = 2 * spec.hidden * spec.dtype_bytes  # in and out, per token

    # Compute (vectorised over token counts) -------------------------------------------------------------------
    def gpu_calc(self, tokens: np.ndarray, shared: bool = False) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        return _calc(self.gpu, t * (self.shared_flops_tok if shared else self.flops_tok), t, 1.0)

    def cpu_calc(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        return _calc(self.cpu, t * self.flops_tok, t, self.cpu_scale)

    def ndp_calc(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        share = self.ndp.host_bw / self.ndp.n_dimms
        return t * self.flops_tok / self.ndp.ndp_flops + t * self.act_bytes_tok / share

    # Weight movement ------------------------------------------------------------------------------------------
    def pcie_s(self, nbytes: int | None = None) -> float:
        assert self.profile.pcie is not None
        n = self.nbytes if nbytes is None else nbytes
        return self.profile.pcie.latency_s + n / self.profile.pcie.bandwidth if n > 0 else 0.0

    def dram_s(self, layout: Layout, nbytes: int | None = None) -> float:
        n = self.nbytes if nbytes is None else nbytes
        return dram_read_s(n, layout, self.ndp.host_bw, self.ndp.n_dimms, self.ndp.channels)

    def busy_s(self, layout: Layout) -> float:
        """Eq. 6: how long a host read of one expert keeps each DIMM it touches busy (module docstring)."""
        if self.ndp.contention == "channel":
            return self.dram_s(layout)
        per_dimm = self.nbytes / self.ndp.n_dimms if layout == Layout.STRIPED else self.nbytes
        return per_dimm / self.ndp.ndp_bw

    def internal_s(self) -> float:
        return self.nbytes / self.ndp.ndp_bw

    def link_s(self, fabric: bool = False) -> float:
        """One expert (a relayout or a migration) over one DIMM-Link, or over the calibrated fabric (5.5)."""
        return self.nbytes / (self.ndp.link_fabric_bw if fabric else self.ndp.link_bw)

    def kv_s(self, batch: int, context: int) -> tuple[float, int]:
        """(seconds, bytes) of one layer's KV cache for `batch` sequences of `context` tokens, read from the host
        DIMMs over PCIe to the GPU (TriMoE 4.1: "the large KV Cache and all routed experts are offloaded to host
        DIMMs"): max(PCIe, host DRAM) for the bytes, striped over the channels."""
        assert self.profile.pcie is not None
        n = int(batch * context * self.spec.kv_bytes_per_token())
        if n <= 0:
            return 0.0, 0
        return max(self.profile.pcie.latency_s + n / self.profile.pcie.bandwidth, n / self.ndp.host_bw), n

    def path_times(self, tokens: np.ndarray) -> list[PathTimes]:
        """Eq. 1-4 of routed experts at (predicted) loads `tokens` [n] (each at least 1), for the background
        planner: one compute pass per path."""
        n = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)  # [n]
        g, c, nd = self.gpu_calc(n).tolist(), self.cpu_calc(n).tolist(), self.ndp_calc(n).tolist()
        p, ds, dl = self.pcie_s(), self.dram_s(Layout.STRIPED), self.dram_s(Layout.LOCALISED)
        i = self.internal_s()
        return [PathTimes(gj, max(gj, p, ds), max(gj, p, dl), max(cj, ds), max(cj, dl), max(nj, i))
                for gj, cj, nj in zip(g, c, nd, strict=True)]  # fmt: skip


def price_call(
    machine: NdpMachine,
    layer: int,
    counts: Mapping[int, int],
    resident: Collection[ExpertKey],
    layouts: Mapping[ExpertKey, Layout],
    homes: Mapping[ExpertKey, int],
    shared_tokens: int = 0,
) -> list[TriExpert]:
    """One layer call as TriExperts: routed experts (id -> tokens > 0, ids ascending; missing layout = striped)
    then, when shared_tokens > 0, the spec's shared experts (ids -1, -2, ...: resident, GPU only)."""
    # 1. Check the call
    spec = machine.spec
    ids = sorted(int(e) for e, n in counts.items() if n > 0)
    bad = [e for e in ids if not 0 <= e < spec.num_experts]
    if bad:
        raise ConfigError(f"price_call: expert {bad[0]} of layer {layer} outside [0, {spec.num_experts})")
    # 2. Vectorised compute parts
    tok = np.asarray([int(counts[e]) for e in ids], dtype=np.float64)  # [n]
    g, c, nd = machine.gpu_calc(tok), machine.cpu_calc(tok), machine.ndp_calc(tok)
    pcie, internal = machine.pcie_s(), machine.internal_s()
    d_str, d_loc = machine.dram_s(Layout.STRIPED), machine.dram_s(Layout.LOCALISED)
    b_str, b_loc = machine.busy_s(Layout.STRIPED), machine.busy_s(Layout.LOCALISED)
    # 3. One TriExpert per routed expert
    out: list[TriExpert] = []
    for j, e in enumerate(ids):
        key = ExpertKey(layer, e)
        lay = layouts.get(key, Layout.STRIPED)
        home = int(homes[key]) if lay == Layout.LOCALISED else -1
        out.append(TriExpert(
            key=key, tokens=int(tok[j]), resident=key in resident, layout=lay, dimm=home,
            gpu_calc_s=float(g[j]), cpu_calc_s=float(c[j]), ndp_calc_s=float(nd[j]), pcie_s=pcie,
            dram_s=d_str if lay == Layout.STRIPED else d_loc, internal_s=internal,
            busy_s=b_str if lay == Layout.STRIPED else b_loc,
        ))  # fmt: skip
    # 4. Shared experts: resident in HBM, computed on the GPU only
    if shared_tokens > 0 and spec.num_shared:
        gs = float(machine.gpu_calc(np.asarray([shared_tokens]), shared=True)[0])
        for j in range(spec.num_shared):
            out.append(TriExpert(
                key=ExpertKey(layer, -(j + 1)), tokens=int(shared_tokens), resident=True, layout=Layout.STRIPED,
                dimm=-1, gpu_calc_s=gs, cpu_calc_s=GPU_ONLY, ndp_calc_s=GPU_ONLY, pcie_s=0.0, dram_s=0.0,
                internal_s=0.0, busy_s=0.0,
            ))  # fmt: skip
    return out


__all__ = [
    "CONTENTION",
    "DEFAULT_PROFILE",
    "GPU_ONLY",
    "MIGRATE4_S",
    "QWEN3_EXPERT_BYTES",
    "NdpMachine",
    "NdpParams",
    "load_ndp",
    "ndp_from_dict",
    "price_call",
]  # fmt: skip
