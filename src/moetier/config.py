"""Frozen, composed configuration. The CLI only maps flags onto these.

EngineConfig = Budgets + CacheConfig + RuntimeConfig. Later sections (precision,
sparsity, prefetch, scheduler) join as their own dataclasses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from moetier.errors import ConfigError

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
    """Expert memory per tier, in bytes. None means 'room for every expert'."""

    host_expert_bytes: int | None = None
    accel_expert_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("host_expert_bytes", "accel_expert_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """Which eviction policy each tier uses (a name in moetier.policies.CACHE_POLICIES)."""

    policy: str = "lru"


@dataclass(frozen=True)
class RuntimeConfig:
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    lean: bool = True  # use the engine's own decoder where the family supports it
    max_seq_len: int = 0  # KV-cache length for the lean decoder; 0 = the model's own limit, capped at 4096

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise ConfigError(f"dtype must be auto, bf16, fp32 or fp16, got {self.dtype!r}")
        if self.max_seq_len < 0:
            raise ConfigError(f"max_seq_len must not be negative, got {self.max_seq_len}")


@dataclass(frozen=True)
class EngineConfig:
    budgets: Budgets = field(default_factory=Budgets)
    cache: CacheConfig = field(default_factory=CacheConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


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
