"""Cost model: a HardwareProfile (data in profiles/) and a ModelSpec turned into per-domain time functions.

Torch-free; the engine, the schedulers and the simulator price work with the same functions.

Expert compute time of `n` tokens on a domain ("gpu" | "cpu"):
- the ComputeProfile has a LUT for the precision: piecewise-linear interpolation in tokens
  (linear extrapolation beyond the last point and below the first, never below 0), scaled by
  the ratio of expert params (target H*I over the LUT's lut_shape H*I). When it also has a
  `small_luts` entry measured on a second, small shape (`small_shape`), time is linear in params
  through the two measured shapes instead: t(n, P) = small(n) + (lut(n) - small(n)) *
  (P - P_small) / (P_ref - P_small), which keeps the fixed per-call cost that plain scaling
  would shrink with the expert (it matters for small experts: 2x on the bundled model);
- else a roofline: max(weight bytes / mem_bw, 2*3*H*I*n / (peak_flops * eff(n))) + overhead_s,
  where eff(n) is the profile's `efficiency` curve ((tokens, fraction of peak) points, piecewise
  linear, flat beyond the ends; empty = 1.0). It models GPUs whose matmul utilisation rises
  slowly with tokens per expert (TriMoE: about 30% at 256 tokens on an H100).
Routed experts add the domain's `dispatch_s`, the runtime's own bookkeeping per expert call.
Move time over a link ("pcie" | "disk"): latency_s + bytes / bandwidth.
Dense time of one decoder layer (`dense_s`): a roofline over the non-expert weights read at
dense_bw (attention, norms, router; the dense MLP when moe=False) plus the KV cache read once
(context x kv bytes per token), against 2 x params x tokens + attention score FLOPs; plus
layer_overhead_s.
Head time of one decode step (`head_s`): the LM head (vocab x hidden weights) and final norm for the
step's new tokens (one per sequence) on the same roofline, plus token_overhead_s, the engine's fixed
cost per forward (embedding lookup, sampling, its Python loop).

Invariants: every time is >= 0 and finite; zero tokens / zero bytes cost 0; more tokens never
cost less on the roofline; profiles round-trip through save_profile/load_profile unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError
from moetier.policies.schedule_base import ExpertWork
from moetier.specs import ModelSpec
from moetier.types import ExpertKey

PROFILES_DIR = Path(__file__).resolve().parents[3] / "profiles"
PRECISIONS = ("full", "int8", "int4", "int2")
Points = tuple[tuple[int, float], ...]


def _points(raw: Any, where: str) -> Points:
    """((x, y), ...) sorted by x, x > 0 distinct, y >= 0 and finite."""
    try:
        pts = tuple((int(x), float(y)) for x, y in raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a list of [tokens, value] pairs, got {raw!r}") from None
    xs = [x for x, _ in pts]
    if not pts or xs != sorted(set(xs)) or xs[0] <= 0 or any(not math.isfinite(y) or y < 0 for _, y in pts):
        raise ConfigError(f"{where}: points need distinct increasing tokens > 0 and finite values >= 0, got {raw!r}")
    return pts


def _interp(pts: Points, x: float, extrapolate: bool) -> float:
    """Piecewise-linear y(x); beyond the ends: the end segment's line (extrapolate) or the end value."""
    if len(pts) == 1:
        return pts[0][1]
    if x <= pts[0][0] or x >= pts[-1][0]:
        if not extrapolate:
            return pts[0][1] if x <= pts[0][0] else pts[-1][1]
        (x0, y0), (x1, y1) = (pts[0], pts[1]) if x <= pts[0][0] else (pts[-2], pts[-1])
    else:
        i = next(j for j in range(1, len(pts)) if pts[j][0] >= x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _params(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _positive(where: str, **vals: float) -> None:
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{where}: {k} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class ComputeProfile:
    peak_flops: float  # FLOP/s of expert matmuls (bf16)
    mem_bw: float  # bytes/s streaming expert weights
    overhead_s: float  # fixed cost per expert call
    luts: Mapping[str, Points] = field(default_factory=dict)  # precision -> ((tokens, seconds), ...) measured
    lut_shape: tuple[int, int] | None = None  # (hidden, inter) the LUTs were measured on
    dense_bw: float = 0.0  # bytes/s for non-expert weight reads; 0 -> mem_bw
    layer_overhead_s: float = 0.0  # fixed non-expert cost per decoder layer call
    token_overhead_s: float = 0.0  # fixed cost per forward beyond the layers (embedding, sampling, loop)
    dispatch_s: float = 0.0  # the runtime's bookkeeping per expert call (plan, acquire/release, combine)
    efficiency: Points = ()  # (tokens, fraction of peak_flops reached) for the roofline; () -> 1.0
    small_luts: Mapping[str, Points] = field(default_factory=dict)  # as luts, measured on small_shape
    small_shape: tuple[int, int] | None = None  # (hidden, inter) of small_luts, fewer params than lut_shape

    def __post_init__(self) -> None:
        _positive(
            "ComputeProfile",
            peak_flops=self.peak_flops,
            mem_bw=self.mem_bw,
            overhead_s=self.overhead_s,
            dense_bw=self.dense_bw,
            layer_overhead_s=self.layer_overhead_s,
            token_overhead_s=self.token_overhead_s,
            dispatch_s=self.dispatch_s,
        )
        if self.peak_flops <= 0 or self.mem_bw <= 0:
            raise ConfigError(
                f"ComputeProfile: peak_flops and mem_bw must be > 0, got {self.peak_flops}, {self.mem_bw}"
            )
        for attr, shape_attr in (("luts", "lut_shape"), ("small_luts", "small_shape")):
            luts = {str(p): _points(v, f"ComputeProfile {attr} {p!r}") for p, v in dict(getattr(self, attr)).items()}
            for p in luts:
                if p not in PRECISIONS:
                    raise ConfigError(
                        f"ComputeProfile: {attr} for unknown precision {p!r}; known: {', '.join(PRECISIONS)}"
                    )
            shape = getattr(self, shape_attr)
            if luts and shape is None:
                raise ConfigError(f"ComputeProfile: {attr} given without {shape_attr} (hidden, inter)")
            if shape is not None:
                shape = tuple(int(x) for x in shape)
                if len(shape) != 2 or min(shape) <= 0:
                    raise ConfigError(f"ComputeProfile: {shape_attr} must be (hidden, inter) > 0, got {shape!r}")
                object.__setattr__(self, shape_attr, shape)
            object.__setattr__(self, attr, luts)
        if self.small_shape and (not self.lut_shape or _params(self.small_shape) >= _params(self.lut_shape)):
            raise ConfigError(
                f"ComputeProfile: small_shape {self.small_shape} needs fewer params than lut_shape {self.lut_shape}"
            )
        eff = _points(self.efficiency, "ComputeProfile efficiency") if self.efficiency else ()
        if any(y <= 0 or y > 1 for _, y in eff):
            raise ConfigError(f"ComputeProfile: efficiency fractions must be in (0, 1], got {self.efficiency!r}")
        object.__setattr__(self, "efficiency", eff)

    def eff(self, tokens: float) -> float:
        return _interp(self.efficiency, tokens, extrapolate=False) if self.efficiency else 1.0


@dataclass(frozen=True)
class LinkProfile:
    bandwidth: float  # bytes/s
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("LinkProfile", bandwidth=self.bandwidth, latency_s=self.latency_s)
        if self.bandwidth <= 0:
            raise ConfigError(f"LinkProfile: bandwidth must be > 0, got {self.bandwidth}")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    cpu: ComputeProfile
    gpu: ComputeProfile | None
    pcie: LinkProfile | None
    disk: LinkProfile
    cpu_threads: int
    host_mem_bytes: int
    gpu_mem_bytes: int | None

    def __post_init__(self) -> None:
        if self.cpu_threads <= 0 or self.host_mem_bytes <= 0:
            raise ConfigError(f"profile {self.name!r}: cpu_threads and host_mem_bytes must be > 0")
        if (self.gpu is None) != (self.gpu_mem_bytes is None):
            raise ConfigError(f"profile {self.name!r}: gpu and gpu_mem_bytes must both be given or both null")
        if self.gpu is not None and self.pcie is None:
            raise ConfigError(f"profile {self.name!r}: a GPU needs a pcie link")


# 1. Profile files -------------------------------------------------------------------------------------------------
def _section(d: Any, cls: type, where: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {d!r}")
    allowed = {f.name for f in fields(cls)}
    extra = set(d) - allowed - {"source", "notes"}
    if extra:
        raise ConfigError(f"{where}: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
    kw = {k: v for k, v in d.items() if k in allowed}
    for k in ("lut_shape", "small_shape"):
        if kw.get(k) is not None:
            kw[k] = tuple(kw[k])
    try:
        return cls(**kw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def profile_from_dict(d: Mapping[str, Any], where: str = "profile") -> HardwareProfile:
    need = ("name", "cpu", "disk", "cpu_threads", "host_mem_bytes")
    missing = [k for k in need if k not in d]
    if missing:
        raise ConfigError(f"{where}: missing keys {missing}")
    return HardwareProfile(
        name=str(d["name"]), source=str(d.get("source", "")),
        cpu=_section(d["cpu"], ComputeProfile, f"{where}: cpu"),
        gpu=None if d.get("gpu") is None else _section(d["gpu"], ComputeProfile, f"{where}: gpu"),
        pcie=None if d.get("pcie") is None else _section(d["pcie"], LinkProfile, f"{where}: pcie"),
        disk=_section(d["disk"], LinkProfile, f"{where}: disk"),
        cpu_threads=int(d["cpu_threads"]), host_mem_bytes=int(d["host_mem_bytes"]),
        gpu_mem_bytes=None if d.get("gpu_mem_bytes") is None else int(d["gpu_mem_bytes"]),
    )  # fmt: skip


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json")) if PROFILES_DIR.is_dir() else []


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (profiles/NAME.json) or a path to a profile .json."""
    s = str(name_or_path)
    named = PROFILES_DIR / f"{s}.json"
    path = named if ("/" not in s and not s.endswith(".json") and named.is_file()) else Path(s)
    if not path.is_file():
        raise ConfigError(f"unknown hardware profile {s!r}; known: {', '.join(profile_names())} (or a .json path)")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read profile {path}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"profile {path}: expected a JSON object")
    return profile_from_dict(d, str(path))


def _compute_dict(c: ComputeProfile) -> dict[str, Any]:
    return {
        "peak_flops": c.peak_flops, "mem_bw": c.mem_bw, "overhead_s": c.overhead_s,
        "luts": {p: [list(pt) for pt in pts] for p, pts in c.luts.items()},
        "lut_shape": list(c.lut_shape) if c.lut_shape else None, "dense_bw": c.dense_bw,
        "layer_overhead_s": c.layer_overhead_s, "token_overhead_s": c.token_overhead_s,
        "dispatch_s": c.dispatch_s,
        "efficiency": [list(pt) for pt in c.efficiency],
        "small_luts": {p: [list(pt) for pt in pts] for p, pts in c.small_luts.items()},
        "small_shape": list(c.small_shape) if c.small_shape else None,
    }  # fmt: skip


def profile_to_dict(profile: HardwareProfile, notes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    def link(x: LinkProfile | None) -> dict[str, float] | None:
        return None if x is None else {"bandwidth": x.bandwidth, "latency_s": x.latency_s}

    d: dict[str, Any] = {
        "name": profile.name, "source": profile.source, "cpu": _compute_dict(profile.cpu),
        "gpu": None if profile.gpu is None else _compute_dict(profile.gpu), "pcie": link(profile.pcie),
        "disk": link(profile.disk), "cpu_threads": profile.cpu_threads, "host_mem_bytes": profile.host_mem_bytes,
        "gpu_mem_bytes": profile.gpu_mem_bytes,
    }  # fmt: skip
    if notes:
        d["notes"] = dict(notes)
    return d


def save_profile(profile: HardwareProfile, path: str | Path, notes: Mapping[str, Any] | None = None) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile_to_dict(profile, notes), indent=2) + "\n")
    return out


# 2. The cost model ------------------------------------------------------------------------------------------------
class CostModel:
    """Per-domain time functions of one model on one machine. Domains: "gpu" | "cpu"; links: "pcie" | "disk"."""

    def __init__(self, profile: HardwareProfile, spec: ModelSpec, precision: str = "full") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
        self.profile, self.spec, self.precision = profile, spec, precision
        self.expert_nbytes = spec.expert_bytes(precision)
        self.shared_nbytes = spec.shared_bytes("full")

    def _domain(self, domain: str) -> ComputeProfile:
        if domain == "cpu":
            return self.profile.cpu
        if domain == "gpu":
            if self.profile.gpu is None:
                raise ConfigError(f"profile {self.profile.name!r} has no GPU; use domain 'cpu'")
            return self.profile.gpu
        raise ConfigError(f"unknown compute domain {domain!r}; expected 'gpu' or 'cpu'")

    def _link(self, link: str) -> LinkProfile:
        if link == "disk":
            return self.profile.disk
        if link == "pcie":
            if self.profile.pcie is None:
                raise ConfigError(f"profile {self.profile.name!r} has no PCIe link (no GPU); use link 'disk'")
            return self.profile.pcie
        raise ConfigError(f"unknown link {link!r}; expected 'pcie' or 'disk'")

    def ffn_s(self, domain: str, tokens: int, inter: int, precision: str, nbytes: int) -> float:
        """One SwiGLU MLP of intermediate size `inter` (hidden = the spec's) over `tokens` tokens."""
        if tokens <= 0:
            return 0.0
        c = self._domain(domain)
        lut = c.luts.get(precision)
        if lut and c.lut_shape:
            params, ref = self.spec.hidden * inter, _params(c.lut_shape)
            y_ref = _interp(lut, tokens, extrapolate=True)
            small = c.small_luts.get(precision)
            if small and c.small_shape:
                y_small, p_small = _interp(small, tokens, extrapolate=True), _params(c.small_shape)
                return max(0.0, y_small + (y_ref - y_small) * (params - p_small) / (ref - p_small))
            return y_ref * params / ref
        flops = 2 * 3 * self.spec.hidden * inter * tokens
        return max(nbytes / c.mem_bw, flops / (c.peak_flops * c.eff(tokens))) + c.overhead_s

    def expert_s(self, domain: str, tokens: int, shared: bool = False) -> float:
        """Compute time of one routed (or shared, always full precision) expert with `tokens` tokens."""
        if shared:
            if not self.spec.num_shared:
                raise ConfigError(f"spec {self.spec.name!r} has no shared experts")
            return self.ffn_s(domain, tokens, self.spec.shared_inter, "full", self.shared_nbytes)
        dispatch = self._domain(domain).dispatch_s if tokens > 0 else 0.0
        return self.ffn_s(domain, tokens, self.spec.moe_inter, self.precision, self.expert_nbytes) + dispatch

    def move_s(self, link: str, nbytes: int) -> float:
        """Time to move `nbytes` over the link (0 for nothing)."""
        if nbytes <= 0:
            return 0.0
        lk = self._link(link)
        return lk.latency_s + nbytes / lk.bandwidth

    def dense_s(self, domain: str, tokens: int, context: int, moe: bool = True) -> float:
        """One decoder layer's non-expert work for `tokens` new tokens of ONE sequence at KV length `context`
        (the KV cache is read once per call; a batch of independent sequences is one call per sequence)."""
        if tokens <= 0:
            return 0.0
        c, s = self._domain(domain), self.spec
        if not moe and s.dense_inter == 0:
            raise ConfigError(f"spec {s.name!r} has no dense (non-MoE) layers; dense_s(moe=False) has no MLP to price")
        params = s.layer_dense_params(moe)
        nbytes = params * s.dtype_bytes + max(0, context) * s.kv_bytes_per_token()
        flops = 2 * params * tokens + s.attention_flops(tokens, max(0, context))
        bw = c.dense_bw or c.mem_bw
        return max(nbytes / bw, flops / (c.peak_flops * c.eff(tokens))) + c.layer_overhead_s

    def head_s(self, domain: str, tokens: int = 1) -> float:
        """One forward's LM head (logits of `tokens` positions) plus the domain's fixed per-forward cost."""
        if tokens <= 0:
            return 0.0
        c, s = self._domain(domain), self.spec
        params = s.vocab * s.hidden
        return max(params * s.dtype_bytes / (c.dense_bw or c.mem_bw), 2 * params * tokens / c.peak_flops) + (
            c.token_overhead_s
        )

    def work(
        self,
        layer: int,
        token_counts: Mapping[int, int],
        cached: Collection[ExpertKey],
        fast: str = "gpu",
        slow: str | None = "cpu",
        link: str = "pcie",
        shared_tokens: int = 0,
    ) -> list[ExpertWork]:
        """Price one layer call: routed experts (id -> tokens, ids ascending; zero-token entries skipped) and,
        when shared_tokens > 0, the spec's shared experts (ids -1, -2, ..., cached=True)."""
        self._domain(fast)
        if slow is not None:
            self._domain(slow)
        move_routed = self.move_s(link, self.expert_nbytes)
        out: list[ExpertWork] = []
        for e in sorted(token_counts):
            n = int(token_counts[e])
            if n < 0 or not 0 <= e < self.spec.num_experts:
                raise ConfigError(
                    f"work: expert {e} with {n} tokens is outside the spec "
                    f"({self.spec.num_experts} experts, tokens >= 0)"
                )
            if n == 0:
                continue
            key = ExpertKey(layer, e)
            out.append(ExpertWork(
                key=key, tokens=n, cached=key in cached, fast_s=self.expert_s(fast, n),
                slow_s=None if slow is None else self.expert_s(slow, n), move_s=move_routed,
                nbytes=self.expert_nbytes,
            ))  # fmt: skip
        if shared_tokens > 0:
            move_shared = self.move_s(link, self.shared_nbytes)
            for j in range(self.spec.num_shared):
                out.append(ExpertWork(
                    key=ExpertKey(layer, -(j + 1)), tokens=shared_tokens, cached=True,
                    fast_s=self.expert_s(fast, shared_tokens, shared=True),
                    slow_s=None if slow is None else self.expert_s(slow, shared_tokens, shared=True),
                    move_s=move_shared, nbytes=self.shared_nbytes,
                ))  # fmt: skip
        return out


def token_counts(ids: Sequence[Sequence[int]]) -> dict[int, int]:
    """Tokens per expert of one layer call from its top-k ids [T][k]."""
    out: dict[int, int] = {}
    for row in ids:
        for e in row:
            out[int(e)] = out.get(int(e), 0) + 1
    return out
