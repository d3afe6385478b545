"""Failed expert reads under a running engine: EIO injected into one expert's reads, a checkpoint truncated in
place, restored by rename, replaced by another checkpoint.

What must hold (issue 18): the MoE call raises ExpertReadError naming the file and the expert, with `rows` the
flattened rows of that call routed to it; it propagates unchanged out of Engine.step (and SlotDecoder.decode);
no half-written slot stays registered (the key is neither resident nor in flight, the slot is free again); the
engine's health turns "degraded" and counts the error; the next forward that does not need the expert works, a
retry of the failed batch step without the failed rows gives the rows' clean logits; once the file reads again
the expert loads again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch

import moetier
from fault_inject import eio_on
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import ExpertReadError
from moetier.runtime import engine as engine_mod
from moetier.runtime.batch import SlotDecoder
from moetier.runtime.observers import Tap
from moetier.traces import load as load_trace
from moetier.types import ExpertKey

PROMPT = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
CASES = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")]  # (checkpoint variant, compute dtype)


def load(path: Path, dtype: str, slots: int | None) -> moetier.Engine:
    """An engine on `path` whose host tier holds `slots` experts (None: all), so every other access reads disk."""
    runtime = RuntimeConfig(device="cpu", dtype=dtype)  # type: ignore[arg-type]
    budget = None
    if slots is not None:
        probe = moetier.load(path, EngineConfig(runtime=runtime))
        budget = slots * probe.store.slot_bytes + probe.store.staging_bytes
        probe.close()
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime))


def routing(engine: moetier.Engine, run: Callable[[], Any]) -> dict[int, list[list[int]]]:
    """layer -> ids [T][k] of the MoE calls `run` makes (the last call per layer)."""
    seen: dict[int, list[list[int]]] = {}
    engine.observers.add(Tap(lambda r: seen.__setitem__(r.layer, r.ids.tolist())))
    run()
    return seen


def eio_for(engine: moetier.Engine, key: ExpertKey) -> AbstractContextManager[None]:
    """os.preadv fails with EIO on expert `key`'s byte ranges only."""
    return eio_on(engine.store.source.reader, key)


def assert_nothing_registered(engine: moetier.Engine, key: ExpertKey) -> None:
    store = engine.store
    assert key not in store.resident() and key not in store.inflight()  # type: ignore[union-attr]
    host = store.host  # type: ignore[union-attr]
    assert len(host.free) + len(host.slots) == host.pool.n_slots  # the failed slot is free again
    assert host.stats()["resident_bytes"] <= host.budget


@pytest.mark.parametrize(("variant", "dtype"), CASES)
def test_eio_fails_only_that_expert_names_it_and_recovers(tiny_ckpt, variant, dtype, monkeypatch):
    path = tiny_ckpt("qwen3_moe", variant)
    clean = load(path, dtype, None)
    ref = clean.logits(PROMPT)  # [1, T, V]
    ids = routing(clean, lambda: clean.logits(PROMPT))[1]  # last MoE layer: [T][k]
    # the fault: an expert of layer 1 that some, not all, prompt rows route to
    e = next(x for x in range(6) if 0 < sum(x in row for row in ids) < len(ids))
    key, rows = ExpertKey(1, e), tuple(t for t, row in enumerate(ids) if e in row)
    # a prompt that never routes to it, in any layer 1 row
    other = next(
        q for q in (torch.tensor([[t, t + 1]]) for t in range(3, 90))
        if all(e not in row for row in routing(clean, lambda q=q: clean.logits(q))[1])
    )  # fmt: skip
    other_ref = clean.logits(other)
    clean.close()

    engine = load(path, dtype, slots=1)  # every access of another expert reads the disk
    assert engine.health() == {"status": "ok", "read_errors": 0, "numerical_errors": 0, "last_error": None,
                               "last_error_time": None}  # fmt: skip
    with eio_for(engine, key):
        with pytest.raises(ExpertReadError) as err:
            engine.logits(PROMPT)
        exc = err.value
        file = str(path / "model.safetensors")
        assert exc.key == key and exc.path == file and exc.rows == rows
        assert file in str(exc) and f"expert {e} of layer 1" in str(exc) and "Input/output error" in str(exc)
        assert_nothing_registered(engine, key)
        health = engine.health()
        assert health["status"] == "degraded" and health["read_errors"] == 1
        assert file in health["last_error"] and health["last_error_time"] is not None
        assert engine.stats()["read_errors"] == 1
        # a forward that does not need the expert works, and is exact
        torch.testing.assert_close(engine.logits(other), other_ref, rtol=0, atol=0)
    # the disk reads again: so does the expert, exactly
    torch.testing.assert_close(engine.logits(PROMPT), ref, rtol=0, atol=0)
    assert key not in engine.store.inflight()  # type: ignore[union-attr]
    monkeypatch.setattr(engine_mod, "HEALTH_WINDOW_S", 0.0)  # the error is older than the window
    assert engine.health()["status"] == "ok" and engine.health()["read_errors"] == 1
    engine.close()


def test_batched_decode_error_names_the_row_and_a_retry_without_it_works(tiny_ckpt):
    """Two sequences decode together ([1, B, H] into each MoE block): the expert only sequence 0 routes to fails;
    the error carries rows (0,), passes Engine.step unchanged, moves no position, and sequence 1 retried alone
    gets its clean logits; later sequence 0 too."""
    path = tiny_ckpt("qwen3_moe")
    prompts, tokens = [[5, 17, 33], [41, 8, 60, 12]], [7, 9]
    clean = load(path, "fp32", None)
    ref_slots = SlotDecoder(clean.decoder, 2)  # type: ignore[arg-type]
    for s, p in enumerate(prompts):
        ref_slots.prefill(s, p)
    seen = routing(clean, lambda: ref_slots.decode([0, 1], tokens))  # layer -> [2][k]
    ref = SlotDecoder(clean.decoder, 2)  # type: ignore[arg-type]
    for s, p in enumerate(prompts):
        ref.prefill(s, p)
    ref_logits = ref.decode([0, 1], tokens)  # [2, V]
    clean.close()
    layer = 1
    e = next(x for x in seen[layer][0] if x not in seen[layer][1])  # routed by sequence 0 only (6 experts, k = 2)

    engine = load(path, "fp32", slots=1)
    slots = SlotDecoder(engine.decoder, 2)  # type: ignore[arg-type]
    for s, p in enumerate(prompts):
        slots.prefill(s, p)
    with eio_for(engine, ExpertKey(layer, e)):
        with pytest.raises(ExpertReadError) as err:
            engine.step(index=1, run=lambda: slots.decode([0, 1], tokens))
        assert type(err.value) is ExpertReadError and err.value.rows == (0,)
        assert slots.pos == [3, 4]  # nothing advanced: a retry writes the same KV positions
        assert_nothing_registered(engine, ExpertKey(layer, e))
        alone = engine.step(index=1, run=lambda: slots.decode([1], [tokens[1]]))  # [1, V]
        torch.testing.assert_close(alone[0], ref_logits[1], rtol=1e-5, atol=1e-5)
    again = engine.step(index=2, run=lambda: slots.decode([0], [tokens[0]]))
    torch.testing.assert_close(again[0], ref_logits[0], rtol=1e-5, atol=1e-5)
    engine.close()


def test_truncated_then_restored_by_rename_then_replaced(ckpt_copy, tiny_ckpt, tmp_path):
    """A real truncation in place; a restore by rename (a new inode: the reader must reopen the path); a file
    replaced by another checkpoint's while the old one is open (still read through the open descriptor: the
    bytes the index describes); after a failed read the path is reopened, and the other checkpoint is refused
    (its header differs), not read at stale offsets; the original back again reads as before."""
    path = ckpt_copy("qwen3_moe")
    file = path / "model.safetensors"
    original = file.read_bytes()
    engine = load(path, "fp32", slots=1)
    ref = engine.logits(PROMPT)
    with open(file, "r+b") as f:
        f.truncate(len(original) // 2)
    with pytest.raises(ExpertReadError, match="end of file") as err:
        engine.logits(PROMPT)
    assert err.value.path == str(file) and str(file) in str(err.value) and err.value.rows
    assert_nothing_registered(engine, err.value.key)

    def replace_with(data: bytes) -> None:
        tmp = tmp_path / "incoming.safetensors"
        tmp.write_bytes(data)
        os.replace(tmp, file)

    replace_with(original)
    torch.testing.assert_close(engine.logits(PROMPT), ref, rtol=0, atol=0)
    replace_with((tiny_ckpt("qwen3_moe", "bf16") / "model.safetensors").read_bytes())  # another header
    torch.testing.assert_close(engine.logits(PROMPT), ref, rtol=0, atol=0)  # the open file, as indexed
    with eio_for(engine, ExpertKey(0, 0)), pytest.raises(ExpertReadError, match="Input/output error"):
        engine.logits(PROMPT)  # drops the descriptor: the next read reopens the path
    with pytest.raises(ExpertReadError, match="replaced by a different file"):
        engine.logits(PROMPT)
    replace_with(original)
    torch.testing.assert_close(engine.logits(PROMPT), ref, rtol=0, atol=0)
    assert engine.health()["read_errors"] == 3
    engine.close()


def test_failed_read_in_generate_leaves_engine_usable(tiny_ckpt):
    """Engine.generate (the lean decoder's own cache) after a failed step: the next generate is exact."""
    path = tiny_ckpt("qwen3_moe")
    clean = load(path, "fp32", None)
    want = clean.generate(PROMPT[0].tolist(), 6).token_ids
    clean.close()
    engine = load(path, "fp32", slots=1)
    with eio_for(engine, ExpertKey(0, 3)), pytest.raises(ExpertReadError, match="expert 3 of layer 0"):
        engine.generate(PROMPT[0].tolist(), 6)
    assert engine.generate(PROMPT[0].tolist(), 6).token_ids == want
    engine.close()


def test_trace_of_a_failed_generate_holds_the_completed_steps_only(tiny_ckpt, tmp_path):
    """EIO on the layer-1 expert first routed latest in a clean run: generate fails at that decode step after
    layer 0 (and layer 1's routing) recorded; the saved trace holds the clean run's rows of the steps before it,
    none of the failed step, then the next generate's rows exactly."""
    path, prompt = tiny_ckpt("qwen3_moe"), PROMPT[0, :1].tolist()  # one token: few experts routed in the prefill

    def rows(out: Path) -> list[tuple[int, int, int, tuple[int, ...]]]:
        return [(r["step"], r["token"], r["layer"], tuple(r["experts"])) for r in load_trace(out).table.to_pylist()]

    clean = load(path, "fp32", None)
    clean.record_trace(tmp_path / "clean.parquet")
    clean.generate(prompt, 10, stop_at_eos=False)
    clean.close()
    want = rows(tmp_path / "clean.parquet")
    first: dict[int, int] = {}  # layer-1 expert -> the step that first routes it
    for step, _, layer, experts in want:
        for e in experts if layer == 1 else ():
            first.setdefault(e, step)
    expert, fail_at = max(first.items(), key=lambda kv: kv[1])
    assert fail_at >= 2 and 0 in clean.info.moe_layers  # a decode step, after layer 0 routed
    engine = load(path, "fp32", slots=1)
    engine.record_trace(tmp_path / "fault.parquet")
    with eio_for(engine, ExpertKey(1, expert)), pytest.raises(ExpertReadError, match=f"expert {expert} of layer 1"):
        engine.generate(prompt, 10, stop_at_eos=False)
    engine.generate(prompt, 10, stop_at_eos=False)
    engine.close()
    assert rows(tmp_path / "fault.parquet") == [r for r in want if r[0] < fail_at] + want
