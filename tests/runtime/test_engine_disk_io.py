"""The engine's disk reads (RuntimeConfig.disk_io / io_depth, --disk-io / --io-depth): O_DIRECT and buffered reads
generate the same tokens as each other with experts read from disk on most accesses; Engine.stats()["disk_io"]
says how the reads went (mode, fallback, requests); the config and the flags refuse bad values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.cli.engine_flags import EngineFlags
from moetier.errors import ConfigError
from moetier.formats.diskio import DiskIO
from moetier.models.open import open_checkpoint
from moetier.runtime import precision
from moetier.store.source import FullSource


def _run(path: Path, disk_io: str, depth: int, slots: int) -> tuple[list[int], dict[str, Any]]:
    """Tokens and stats of a short generation whose host tier holds `slots` experts besides its staging."""
    runtime = RuntimeConfig(device="cpu", dtype="fp32", disk_io=disk_io, io_depth=depth)
    io = DiskIO(direct=disk_io == "direct", depth=depth)  # the engine's bounce buffers
    opened = open_checkpoint(path, "fp32", torch.device("cpu"))
    opened.reader.set_io(io)
    slot = FullSource(opened.reader, torch.float32).slot_bytes
    budget = slots * slot + opened.reader.staging_bytes
    opened.reader.close()
    with moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime)) as engine:
        assert engine.store.capacity == slots
        tokens = engine.generate([5, 9, 14, 3], 6, stop_at_eos=False).token_ids
        return tokens, engine.stats()


def test_direct_and_buffered_reads_generate_the_same(tiny_ckpt: Callable[..., Path]) -> None:
    path = tiny_ckpt("qwen3_moe")
    direct, sd = _run(path, "direct", 4, slots=3)  # 3 of 12 experts: most accesses read the disk
    buffered, sb = _run(path, "buffered", 1, slots=3)
    assert direct == buffered
    io_d, io_b = sd["disk_io"], sb["disk_io"]
    assert isinstance(io_d, dict) and isinstance(io_b, dict)
    assert io_d["mode"] in ("O_DIRECT", "buffered+DONTNEED") and io_b["mode"] == "buffered"
    assert io_d["requests"] > 0 and io_d["bytes"] > 0 and io_d["depth"] == 4 and io_b["depth"] == 1
    assert io_d["staging_bytes"] > 0 and io_b["staging_bytes"] == 0
    assert sd["staging_bytes"] == io_d["staging_bytes"]  # fp32 slots from fp32 tensors: nothing else staged
    assert sd["misses"] > 12  # experts were read again after eviction


def test_config_and_flags_map_and_refuse() -> None:
    with pytest.raises(ConfigError, match="disk_io"):
        RuntimeConfig(disk_io="mmap")
    with pytest.raises(ConfigError, match="io_depth"):
        RuntimeConfig(io_depth=0)
    runtime = EngineFlags(disk_io="buffered", io_depth=2).config().runtime
    assert (runtime.disk_io, runtime.io_depth) == ("buffered", 2)
    with pytest.raises(ConfigError, match="disk_io"):
        EngineFlags(disk_io="fast").config()


def test_auto_reads_small_experts_buffered(tiny_ckpt: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """--disk-io auto (the default): O_DIRECT for experts of at least runtime/precision.py AUTO_DIRECT_BYTES (1 MiB),
    buffered reads (no bounce buffers, the reason in stats) for smaller ones, whatever the budget."""
    path = tiny_ckpt("qwen3_moe")
    assert RuntimeConfig().disk_io == "auto"
    runtime = RuntimeConfig(device="cpu", dtype="fp32")
    with moetier.load(path, EngineConfig(runtime=runtime)) as engine:
        io = engine.stats()["disk_io"]
        assert io["mode"] == "buffered" and "auto" in io["fallback"] and io["staging_bytes"] == 0
    monkeypatch.setattr(precision, "AUTO_DIRECT_BYTES", 1)  # every expert counts as large
    with moetier.load(path, EngineConfig(runtime=runtime)) as engine:
        io = engine.stats()["disk_io"]
        assert io["mode"] in ("O_DIRECT", "buffered+DONTNEED") and io["staging_bytes"] > 0


def test_preload_fills_the_host_tier_at_load(tiny_ckpt: Callable[..., Path]) -> None:
    """--preload (RuntimeConfig.preload): the host tier is full before the first token (reads counted as misses),
    the first generation reads nothing more when every expert fits, and the tokens are those of a lazy engine."""
    path = tiny_ckpt("qwen3_moe")
    runtime = RuntimeConfig(device="cpu", dtype="fp32")
    with moetier.load(path, EngineConfig(runtime=runtime)) as lazy:
        want = lazy.generate([5, 9, 14, 3], 6, stop_at_eos=False).token_ids
        every = lazy.stats()["tiers"]["host"]["slots"]
    with moetier.load(path, EngineConfig(runtime=replace(runtime, preload=True))) as eager:
        s0 = eager.stats()
        assert s0["misses"] == every and s0["tiers"]["host"]["resident_bytes"] == every * eager.store.slot_bytes
        got = eager.generate([5, 9, 14, 3], 6, stop_at_eos=False).token_ids
        assert eager.stats()["misses"] == every  # nothing read on first use
    assert got == want
    assert EngineFlags(preload=True).config().runtime.preload
