"""Fixtures of the runtime tests: the bundled trained model (models/tiny-shakespeare-moe) as an fp32 CPU engine.

`engine` is module-scoped: each test module gets its own engine (so what one module patches or runs never
reaches another's), loaded once for all of that module's tests and closed after them. A module that needs
another config (another dtype, budgets, lean off) loads its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import moetier
from moetier import EngineConfig, RuntimeConfig

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
FP32_CPU = EngineConfig(runtime=RuntimeConfig(device="cpu", dtype="fp32"))


@pytest.fixture(scope="module")
def engine() -> Iterator[moetier.Engine]:
    """The bundled model at fp32 on the CPU, every expert resident (the default budgets), lean decoder."""
    eng = moetier.load(BUNDLED, FP32_CPU)
    yield eng
    eng.close()
