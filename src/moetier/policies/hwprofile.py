"""Hardware profiles: the measured machine data the cost model (policies/costmodel.py) prices work with,
as frozen dataclasses (ComputeProfile per compute domain, LinkProfile per link, HardwareProfile for
the machine), and their JSON files: shipped ones inside the package (moetier/data/profiles/, read through
importlib.resources) and the user's own in `user_profiles_dir()` ($XDG_CONFIG_HOME/moetier/profiles, default
~/.config/moetier/profiles), where `moetier profile` writes (runtime/profile.py measures).

Torch-free. Invariants: every profile is checked on construction (times, bandwidths and LUT points
finite and >= 0; peak_flops, mem_bw and bandwidths > 0; LUTs only for known precisions and with the
shape they were measured on; a GPU comes with its memory and a PCIe link), so a bad file is one
ConfigError naming the field; profiles round-trip through save_profile/load_profile unchanged; a profile
NAME is looked up in the user's folder first, then among the shipped ones (a user file shadows a shipped one).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError
from moetier.types import PRECISION_BITS

SHIPPED_PROFILES: Traversable = resources.files("moetier") / "data" / "profiles"
PROFILES_DIR = Path(str(SHIPPED_PROFILES))  # the shipped profiles as a folder (the package is installed as files)
PRECISIONS = tuple(PRECISION_BITS)  # full, int8, int4, int2
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


def interp(pts: Points, x: float, extrapolate: bool) -> float:
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


def shape_params(shape: tuple[int, int]) -> int:
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
    first_expert_s: float = 0.0  # extra time of the first expert of a layer call on this domain (HybriMoE Fig. 3e:
    # "the first expert computation on the CPU is slower, but subsequent tasks are processed faster"); 0: off

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
            first_expert_s=self.first_expert_s,
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
        if self.small_shape and (not self.lut_shape or shape_params(self.small_shape) >= shape_params(self.lut_shape)):
            raise ConfigError(
                f"ComputeProfile: small_shape {self.small_shape} needs fewer params than lut_shape {self.lut_shape}"
            )
        eff = _points(self.efficiency, "ComputeProfile efficiency") if self.efficiency else ()
        if any(y <= 0 or y > 1 for _, y in eff):
            raise ConfigError(f"ComputeProfile: efficiency fractions must be in (0, 1], got {self.efficiency!r}")
        object.__setattr__(self, "efficiency", eff)

    def eff(self, tokens: float) -> float:
        return interp(self.efficiency, tokens, extrapolate=False) if self.efficiency else 1.0


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


# Profile files -------------------------------------------------------------------------------------------------
def section_from_dict(d: Any, cls: type, where: str) -> Any:
    """One JSON object as dataclass `cls`: unknown keys (other than source/notes) and bad fields are a ConfigError."""
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
        cpu=section_from_dict(d["cpu"], ComputeProfile, f"{where}: cpu"),
        gpu=None if d.get("gpu") is None else section_from_dict(d["gpu"], ComputeProfile, f"{where}: gpu"),
        pcie=None if d.get("pcie") is None else section_from_dict(d["pcie"], LinkProfile, f"{where}: pcie"),
        disk=section_from_dict(d["disk"], LinkProfile, f"{where}: disk"),
        cpu_threads=int(d["cpu_threads"]), host_mem_bytes=int(d["host_mem_bytes"]),
        gpu_mem_bytes=None if d.get("gpu_mem_bytes") is None else int(d["gpu_mem_bytes"]),
    )  # fmt: skip


def user_profiles_dir() -> Path:
    """The user's profiles: $XDG_CONFIG_HOME/moetier/profiles (an unset or relative XDG_CONFIG_HOME means
    ~/.config). `moetier profile` writes here; a profile name is looked up here first."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".config") / "moetier" / "profiles"


def _json_names(folder: Traversable) -> set[str]:
    if not folder.is_dir():
        return set()
    return {e.name[: -len(".json")] for e in folder.iterdir() if e.name.endswith(".json") and e.is_file()}


def profile_names() -> list[str]:
    """Names of the profiles found by name: the user's and the shipped ones."""
    return sorted(_json_names(user_profiles_dir()) | _json_names(SHIPPED_PROFILES))


def find_profile(name: str) -> Path | None:
    """The file of profile NAME: the user's NAME.json, else the shipped one; None when neither exists."""
    for folder in (user_profiles_dir(), SHIPPED_PROFILES):
        entry = folder / f"{name}.json"
        if entry.is_file():
            return Path(str(entry))
    return None


def read_profile_json(name_or_path: str | Path) -> tuple[Path, Any]:
    """(path, parsed JSON) of a profile by name (`find_profile`) or of a profile .json path."""
    s = str(name_or_path)
    named = find_profile(s) if ("/" not in s and not s.endswith(".json")) else None
    path = named if named is not None else Path(s)
    if not path.is_file():
        raise ConfigError(f"unknown hardware profile {s!r}; known: {', '.join(profile_names())} (or a .json path)")
    try:
        return path, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read profile {path}: {e}") from None


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A profile by name (the user's, else a shipped one: `find_profile`) or a path to a profile .json."""
    path, d = read_profile_json(name_or_path)
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
        "small_shape": list(c.small_shape) if c.small_shape else None, "first_expert_s": c.first_expert_s,
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


__all__ = [
    "PRECISIONS", "PROFILES_DIR", "SHIPPED_PROFILES", "ComputeProfile", "HardwareProfile", "LinkProfile", "Points",
    "find_profile", "load_profile", "profile_from_dict", "profile_names", "profile_to_dict", "save_profile",
    "user_profiles_dir",
]  # fmt: skip
