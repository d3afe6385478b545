"""ExpertStore invariants: budgets, one slot per key, pins, LRU order, counters, slot contents.

The store is built directly (CheckpointIndex + ExpertReader + ExpertStore) on the tiny
checkpoints; expected slot contents come from safetensors.torch.load_file following the
families' conventions by hand (conftest.canonical_experts_of).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.errors import BudgetError, CheckpointError
from moetier.formats.checkpoint import CheckpointIndex
from moetier.formats.layout import ExpertLayout
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import read_config
from moetier.store.source import FullSource
from moetier.store.store import ExpertStore
from moetier.types import ExpertKey, Tier

CPU = torch.device("cpu")


def make_store(path: Path, budget: int | None, dtype: torch.dtype = torch.float32) -> ExpertStore:
    config, family = read_config(path)
    index = CheckpointIndex(path)
    block = family.ckpt_block
    layers = sorted({int(n.split(".")[2]) for n in index.names() if f".{block}.experts." in n})
    experts = {n.split(".")[5] for n in index.names() if n.startswith(f"model.layers.{layers[0]}.{block}.experts.")}
    num_experts = len([e for e in experts if e.isdigit()]) or int(config.num_local_experts)
    layout = ExpertLayout(
        int(config.hidden_size), int(getattr(config, family.intermediate_attr)), "down_bias" in family.sources
    )
    prefixes = {layer: f"model.layers.{layer}.{block}." for layer in layers}
    reader = ExpertReader(index, family.sources, layout, prefixes, num_experts, dtype)
    return ExpertStore(FullSource(reader, dtype), list(reader.plans), CPU, budget, None)


def budget_for(path: Path, slots: int) -> int:
    """The host budget that holds exactly `slots` expert slots of `path` (plus its staging buffer)."""
    probe = make_store(path, None)
    budget = slots * probe.slot_bytes + probe.staging_bytes
    probe.close()
    return budget


def stored_bytes(pieces: dict[str, torch.Tensor], itemsize: int) -> int:
    """Bytes one expert occupies in the checkpoint files."""
    return sum(t.numel() for t in pieces.values()) * itemsize


def assert_slot_holds(store: ExpertStore, key: ExpertKey, expected: dict[str, torch.Tensor]) -> None:
    views = store.views(key)
    assert set(views.pieces) == set(expected)
    for piece, want in expected.items():
        got = views.pieces[piece]
        assert got.shape == want.shape, (key, piece)
        assert torch.equal(got.float(), want), f"{key} {piece} differs from the checkpoint"
    # the compute views see the same bytes: w13 = [gate; up], w2 = down
    assert torch.equal(views.w13.float(), torch.cat([expected["gate"], expected["up"]]))
    assert torch.equal(views.w2.float(), expected["down"])
    if "gate_bias" in expected:
        assert views.b13 is not None and views.b2 is not None
        assert torch.equal(views.b13.float(), torch.cat([expected["gate_bias"], expected["up_bias"]]))
        assert torch.equal(views.b2.float(), expected["down_bias"])


# -- sizing and budgets ----------------------------------------------------------------------


@pytest.mark.parametrize(("family", "hidden", "inter", "bias"), [
    ("qwen3_moe", 32, 16, False), ("mixtral", 32, 48, False), ("gpt_oss", 32, 16, True),
])  # fmt: skip
def test_slot_bytes_follow_layout(tiny_ckpt, family, hidden, inter, bias):
    store = make_store(tiny_ckpt(family), None)
    numel = 3 * hidden * inter + ((2 * inter + hidden) if bias else 0)
    assert store.slot_bytes == numel * 4
    assert store.host.pool.slot_bytes == numel * 4
    store.close()


@pytest.mark.parametrize(("family", "variant"), [("qwen3_moe", "fp32"), ("qwen3_moe", "bf16"), ("gpt_oss", "fp32")])
def test_pool_size_from_budget(tiny_ckpt, canonical_experts, family, variant):
    path = tiny_ckpt(family, variant)
    total = len(canonical_experts(family, variant))
    probe = make_store(path, None)
    slot, staging = probe.slot_bytes, probe.staging_bytes
    assert probe.host.pool.n_slots == total
    probe.close()
    for n in (1, 2, total - 1, total, total + 5):
        for extra in (0, slot - 1):
            budget = n * slot + staging + extra
            store = make_store(path, budget)
            assert store.host.pool.n_slots == min(n, total)
            assert store.host.pool.nbytes + store.staging_bytes <= budget
            store.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_budget_below_one_expert_names_the_numbers(tiny_ckpt, family):
    probe = make_store(tiny_ckpt(family), None)
    need = probe.slot_bytes + probe.staging_bytes
    probe.close()
    for budget in (0, need - 1):
        with pytest.raises(BudgetError) as err:
            make_store(tiny_ckpt(family), budget)
        msg = str(err.value)
        assert str(budget) in msg and str(need) in msg


# -- pins, LRU, counters ---------------------------------------------------------------------


def test_pinned_expert_is_never_evicted(tiny_ckpt):
    budget = budget_for(tiny_ckpt("qwen3_moe"), 1)
    store = make_store(tiny_ckpt("qwen3_moe"), budget)
    a, b = ExpertKey(0, 1), ExpertKey(0, 2)
    store.acquire(a)
    with pytest.raises(BudgetError, match=r"1 expert slots"):
        store.acquire(b)
    assert store.resident() == {a}  # the failed acquire left the pinned expert in place
    assert len(store.host.free) + len(store.host.slots) == store.host.pool.n_slots
    store.release(a)
    store.acquire(b)  # now a is evictable
    assert store.resident() == {b}
    assert store.host.evictions == 1
    store.release(b)
    store.close()


def test_nested_pins_need_matching_releases(tiny_ckpt):
    budget = budget_for(tiny_ckpt("qwen3_moe"), 1)
    store = make_store(tiny_ckpt("qwen3_moe"), budget)
    a, b = ExpertKey(1, 0), ExpertKey(1, 3)
    store.acquire(a)
    store.acquire(a)
    store.release(a)
    with pytest.raises(BudgetError):
        store.acquire(b)  # a is still pinned once
    store.release(a)
    store.acquire(b)
    assert store.resident() == {b}
    store.close()


def test_lru_evicts_least_recently_used(tiny_ckpt):
    budget = budget_for(tiny_ckpt("qwen3_moe"), 2)
    store = make_store(tiny_ckpt("qwen3_moe"), budget)
    a, b, c = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(1, 0)
    for key in (a, b, a, c):
        store.acquire(key)
        store.release(key)
    assert store.resident() == {a, c}  # B was touched longest ago
    assert (store.host.hits, store.host.misses, store.host.evictions) == (1, 3, 1)
    store.acquire(b)
    store.release(b)
    assert store.resident() == {c, b}  # then A (accessed before C) goes
    store.close()


def test_hits_misses_and_disk_bytes(tiny_ckpt, canonical_experts):
    experts = canonical_experts("qwen3_moe")
    store = make_store(tiny_ckpt("qwen3_moe"), None)
    keys = [ExpertKey(0, 0), ExpertKey(0, 5), ExpertKey(0, 0), ExpertKey(1, 2), ExpertKey(0, 5)]
    per_expert = stored_bytes(experts[(0, 0)], 4)
    for key in keys:
        store.acquire(key)
        store.release(key)
    s = store.stats()
    assert (s["host"]["hits"], s["host"]["misses"]) == (2, 3)
    assert s["disk_bytes"] == 3 * per_expert
    assert s["host"]["resident_bytes"] == 3 * store.slot_bytes
    store.close()


# -- slot contents ---------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "variant"), [
    ("qwen3_moe", "fp32"), ("mixtral", "fp32"), ("gpt_oss", "fp32"), ("deepseek_v3", "fp32"),
    ("gpt_oss", "bf16"), ("qwen2_moe", "bf16"),
])  # fmt: skip
def test_slot_contents_equal_checkpoint(tiny_ckpt, canonical_experts, family, variant):
    """Load several experts through one reused slot: each must equal its checkpoint tensors."""
    path = tiny_ckpt(family, variant)
    experts = canonical_experts(family, variant)
    budget = budget_for(path, 1)
    store = make_store(path, budget)
    keys = sorted(experts)
    chosen = [keys[0], keys[len(keys) // 2], keys[-1], keys[1]]
    itemsize = 2 if variant == "bf16" else 4
    for key in map(ExpertKey._make, chosen):
        before = store.disk_bytes
        store.acquire(key)
        assert store.disk_bytes - before == stored_bytes(experts[key], itemsize)
        assert_slot_holds(store, key, experts[key])
        store.release(key)
    store.close()


def test_failed_read_registers_nothing(ckpt_copy):
    """A read that fails half way (file truncated after open) leaves no expert registered."""
    path = ckpt_copy("qwen3_moe")
    store = make_store(path, None)
    good = ExpertKey(0, 0)
    store.acquire(good)
    store.release(good)
    file = path / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    bad = max((k for k in store.source.reader.plans), key=lambda k: store.source.reader.plans[k][0].offset)
    for _ in range(2):  # the second try must fail again, not "hit" a half-written slot
        with pytest.raises(CheckpointError, match=r"model\.safetensors"):
            store.acquire(bad)
        assert bad not in store.resident()
        assert store.resident() == {good}
        assert len(store.host.free) + len(store.host.slots) == store.host.pool.n_slots
    store.close()


# -- property test ---------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "variant"), [("qwen3_moe", "fp32"), ("gpt_oss", "fp32"), ("olmoe", "bf16")])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_store_matches_lru_model(tiny_ckpt, canonical_experts, family, variant, data):
    """Random acquire/release sequences under random budgets against a plain LRU-with-pins model."""
    path = tiny_ckpt(family, variant)
    experts = canonical_experts(family, variant)
    keys = [ExpertKey._make(k) for k in sorted(experts)]
    itemsize = 2 if variant == "bf16" else 4
    probe = make_store(path, None)
    slot, staging = probe.slot_bytes, probe.staging_bytes
    probe.close()
    n_slots = data.draw(st.integers(1, len(keys)), label="slots")
    budget = n_slots * slot + staging + data.draw(st.integers(0, slot - 1), label="slack")
    store = make_store(path, budget)
    host = store.host
    assert host.pool.n_slots == n_slots

    lru: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
    pins: dict[ExpertKey, int] = {}
    acquires = 0
    n_ops = data.draw(st.integers(1, 30), label="ops")
    for _ in range(n_ops):
        pinned = sorted(k for k, n in pins.items() if n > 0)
        if pinned and data.draw(st.booleans(), label="release?"):
            key = data.draw(st.sampled_from(pinned), label="release")
            store.release(key)
            pins[key] -= 1
        else:
            key = keys[data.draw(st.integers(0, len(keys) - 1), label="acquire")]
            acquires += 1  # undone below for a refused acquire: a failed load is neither hit nor miss
            before = store.disk_bytes
            if key in lru:
                lru.move_to_end(key)
                store.acquire(key)
                assert store.disk_bytes == before
            else:
                evictable = [k for k in lru if pins.get(k, 0) == 0]
                if len(lru) >= n_slots and not evictable:
                    with pytest.raises(BudgetError):
                        store.acquire(key)
                    assert store.disk_bytes == before
                    acquires -= 1
                    continue
                if len(lru) >= n_slots:
                    del lru[evictable[0]]
                lru[key] = None
                store.acquire(key)
                assert store.disk_bytes - before == stored_bytes(experts[key], itemsize)
                assert_slot_holds(store, key, experts[key])
            pins[key] = pins.get(key, 0) + 1
        # invariants after every operation
        assert store.resident(Tier.HOST) == set(lru)
        assert len(host.slots) * slot + staging <= budget
        assert len(set(host.slots.values())) == len(host.slots)  # one slot holds at most one key
        assert not set(host.free) & set(host.slots.values())
        assert len(host.free) + len(host.slots) == n_slots
        assert all(k in host.slots for k, n in pins.items() if n > 0)  # pinned keys stay resident
        assert host.hits + host.misses == acquires
    assert store.stats()["host"]["peak_resident_bytes"] + staging <= budget
    store.close()


def test_unset_budget_must_fit_free_memory(tiny_ckpt, monkeypatch):
    import moetier.store.store as store_mod

    monkeypatch.setattr(store_mod, "available_bytes", lambda device: 50_000)
    with pytest.raises(BudgetError) as err:
        make_store(tiny_ckpt("qwen3_moe"), None)  # 12 experts x 6144 bytes > 50 000
    assert "12" in str(err.value) and "host" in str(err.value)
    store = make_store(tiny_ckpt("qwen3_moe"), 3 * 6144)  # an explicit budget is the user's call
    assert store.host.pool.n_slots == 3
    store.close()
