"""`--memory`: fit the experts into what the rest of the process leaves, and the process's memory figures.

The parts besides the experts (policies/memory.py MemoryNeeds) are measured by runtime/memory_needs.py before any
pool is allocated; `fit(cfg, needs, min_expert_bytes)` returns the config with the host expert budget set from the
plan (runtime/precision.py build_store calls it where the smallest expert budget is known), and the plan.
`drop_page_cache(paths)` asks the kernel to drop the page cache of files the load has read (posix_fadvise
DONTNEED), so that reading the dense weights does not leave their pages charged to the process; `process_rss`
and `peak_rss` read /proc/self/status.

Invariants: only a config with Budgets.memory_bytes set is changed; an explicit host expert budget under
--memory must fit in what the plan leaves (ConfigError otherwise), and is then kept as given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from moetier.config import EngineConfig, format_size
from moetier.errors import ConfigError
from moetier.policies.memory import MemoryNeeds, MemoryPlan, fit_memory


def _status(field: str) -> int:
    """A byte count of /proc/self/status (`field`: VmRSS, VmHWM), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def process_rss() -> int:
    """This process's resident bytes now (VmRSS), 0 where /proc is missing."""
    return _status("VmRSS")


def peak_rss() -> int:
    """This process's peak resident bytes so far (VmHWM), 0 where /proc is missing."""
    return _status("VmHWM")


def fit(cfg: EngineConfig, needs: MemoryNeeds, min_expert_bytes: int) -> tuple[EngineConfig, MemoryPlan]:
    """`cfg` with its host expert budget set from --memory, and the plan (BudgetError: too small);
    `min_expert_bytes`: the smallest expert budget the store runs with (runtime/precision.py build_store)."""
    budget = cfg.budgets.memory_bytes
    assert budget is not None
    plan = fit_memory(budget, needs, min_expert_bytes)
    given = cfg.budgets.host_expert_bytes
    if given is not None:
        if given > plan.experts:
            raise ConfigError(
                f"--host-expert-mem {format_size(given)} does not fit in --memory {format_size(budget)}: "
                f"{plan.describe()} leaves {format_size(plan.experts)} for experts (leave --host-expert-mem out "
                "and --memory sizes it)"
            )
        plan = replace(plan, experts=given)
    return replace(cfg, budgets=replace(cfg.budgets, host_expert_bytes=plan.experts)), plan


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """posix_fadvise(DONTNEED) on each regular file: its clean pages leave the page cache. Returns the files
    advised (errors are ignored: the advice is an optimisation, never required)."""
    done = 0
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files a checkpoint folder (or a single GGUF file) holds."""
    p = Path(path)
    if p.is_file():
        return [p]
    return [f for f in p.iterdir() if f.is_file()] if p.is_dir() else []


__all__ = ["checkpoint_files", "drop_page_cache", "fit", "peak_rss", "process_rss"]
