"""runtime/memory.py and --memory through runtime/wire.py: the engine sizes its host expert budget from one
process budget, says how it spent it, refuses one too small with the smallest that runs, and a fresh process
stays within it while it generates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import BudgetError, ConfigError
from moetier.runtime.loader import open_skeleton
from moetier.runtime.memory_needs import memory_needs

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"

MIB = 1024**2


def cfg(memory: int, **budgets: int) -> EngineConfig:
    return EngineConfig(budgets=Budgets(memory_bytes=memory, **budgets), runtime=RuntimeConfig(device="cpu"))


def test_needs_of_the_bundled_model() -> None:
    c = cfg(1024 * MIB)
    sk = open_skeleton(BUNDLED, c)
    try:
        n = memory_needs(sk, c)
        info = sk.info
        assert n.process > 50 * MIB  # this interpreter with torch loaded
        assert n.dense == sum(p.numel() for name, p in sk.opened.model.named_parameters()
                              if ".experts." not in name) * sk.opened.dtype.itemsize  # fmt: skip
        mc = sk.opened.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        max_len = min(mc.max_position_embeddings, 4096)
        assert n.kv == 2 * info.num_layers * mc.num_key_value_heads * head_dim * sk.opened.dtype.itemsize * max_len
        kv_one = memory_needs(sk, EngineConfig(budgets=Budgets(memory_bytes=1, kv_bytes=12345)))
        assert kv_one.kv == 12345  # serving's KV budget replaces one full sequence
        short = memory_needs(sk, EngineConfig(runtime=RuntimeConfig(max_seq_len=64)))
        assert short.kv * 4 == memory_needs(sk, EngineConfig(runtime=RuntimeConfig(max_seq_len=256))).kv
    finally:
        sk.close()


def test_memory_sizes_the_expert_budget() -> None:
    probe = cfg(1 << 40)  # a budget larger than anything: every expert fits
    moetier.load(BUNDLED, probe).close()  # the first load in a process imports and allocates for good
    with moetier.load(BUNDLED, probe) as eng:
        plan = eng.loaded.memory
        assert plan is not None
        fixed = plan.needs.fixed
        total = eng.loaded.info.total_expert_bytes
        every = len(eng.loaded.info.moe_layers) * eng.loaded.info.num_experts
        assert eng.store.stats()["host"]["slots"] == every  # no budget shortage: every expert gets a slot
    # a budget leaving room for 16 MiB above what the rest took: the store gets exactly what is left
    budget = fixed + 16 * MIB  # the experts take 24 MiB: some are held back (the process may grow a few MiB)
    with moetier.load(BUNDLED, cfg(budget)) as eng:
        stats = eng.stats()["memory"]
        host = eng.store.stats()["host"]
        assert stats["budget_bytes"] == budget
        assert stats["expert_bytes"] == budget - eng.loaded.memory.needs.fixed  # type: ignore[union-attr]
        assert stats["expert_bytes"] < total  # the process was measured again (a little apart from the probe)
        assert host["budget_bytes"] == stats["expert_bytes"]
        assert 0 < host["slots"] * eng.loaded.info.expert_bytes <= stats["expert_bytes"]
        assert host["slots"] < len(eng.loaded.info.moe_layers) * eng.loaded.info.num_experts
        eng.generate(list(range(1, 9)), max_new_tokens=4)
        assert "experts" in stats["plan"] and stats["rss_bytes"] > 0


def test_too_small_names_the_smallest_that_runs() -> None:
    with pytest.raises(BudgetError, match="smallest budget that runs") as exc:
        moetier.load(BUNDLED, cfg(64 * MIB))
    smallest = int(re.search(r"\((\d+) bytes\)", str(exc.value)).group(1))  # type: ignore[union-attr]
    with moetier.load(BUNDLED, cfg(smallest + 32 * MIB)) as eng:  # what it names runs (the process may grow a bit)
        assert eng.store.stats()["host"]["slots"] >= eng.loaded.info.top_k


def test_explicit_expert_budget_must_fit() -> None:
    with pytest.raises(ConfigError, match="does not fit in --memory"):
        moetier.load(BUNDLED, cfg(2048 * MIB, host_expert_bytes=4096 * MIB))


def test_a_fresh_process_stays_within_the_budget(tmp_path: Path) -> None:
    """A new interpreter (its peak is its own) loads with --memory 16 MiB above what the rest
    takes, generates, and its peak resident set stays under the budget."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "import moetier\n"
        "from moetier import Budgets, EngineConfig, RuntimeConfig\n"
        "from moetier.runtime.memory import peak_rss\n"
        f"path = {str(BUNDLED)!r}\n"
        "probe = EngineConfig(budgets=Budgets(memory_bytes=1 << 40), runtime=RuntimeConfig(device='cpu'))\n"
        "moetier.load(path, probe).close()\n"
        "with moetier.load(path, probe) as e:\n"
        "    fixed, total = e.loaded.memory.needs.fixed, e.loaded.info.total_expert_bytes\n"
        "budget = fixed + 16 * 1024**2\n"
        "c = EngineConfig(budgets=Budgets(memory_bytes=budget), runtime=RuntimeConfig(device='cpu'))\n"
        "with moetier.load(path, c) as e:\n"
        "    e.generate(list(range(1, 65)), max_new_tokens=64)\n"
        "    s = e.stats()\n"
        "print(json.dumps({'budget': budget, 'peak': peak_rss(), 'misses': s['misses']}))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["misses"] > 0  # the budget held back experts: they were read on demand
    assert got["peak"] <= got["budget"], got
