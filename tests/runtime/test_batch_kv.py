"""KV admission of the batch runner (runtime/batch.py): a request reserves prompt + max_new_tokens - 1 tokens
of KV in the slot cache's KV_CHUNK rounding; it waits (first come, first served) while the budget cannot take
it, is refused by add() when it never could; under a budget the slots hold exactly the reserved bytes, so the
budget bounds the real KV memory at every step."""

from __future__ import annotations

from pathlib import Path

import pytest

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import ConfigError
from moetier.models.tiny import build_tiny_checkpoint
from moetier.runtime.batch import KV_CHUNK, BatchConfig, BatchRunner, SeqRequest, StepEvent
from moetier.runtime.lean import LeanDecoder, kv_token_bytes

NEVER: frozenset[int] = frozenset()


def _token_bytes(engine: moetier.Engine) -> int:
    """KV bytes per token measured on the lean decoder's allocated caches (k and v: [L, nkv, max_len, hd])."""
    lean = engine.decoder
    assert isinstance(lean, LeanDecoder)
    return sum(c[:, :, 0].numel() * c.element_size() for c in (lean.k_cache, lean.v_cache))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3_moe", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3}),
        ("mixtral", {"num_attention_heads": 8, "num_key_value_heads": 1}),  # head_dim from hidden_size // heads
    ],
)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_kv_size_per_token_whatever_the_head_counts(family: str, overrides: dict[str, int], dtype: str,
                                                         tmp_path: Path) -> None:  # fmt: skip
    """lean.kv_token_bytes is what the slots, the serial mode and the lean decoder's own cache all hold per token,
    on models whose key/value heads, head dim and layer count differ from the bundled one's."""
    path = build_tiny_checkpoint(family, tmp_path / family, **overrides)
    eng = moetier.load(path, EngineConfig(runtime=RuntimeConfig(device="cpu", dtype=dtype)))
    try:
        measured = _token_bytes(eng)
        cfg = eng.loaded.config
        heads, layers = overrides["num_key_value_heads"], cfg.num_hidden_layers
        head_dim = overrides.get("head_dim", cfg.hidden_size // overrides["num_attention_heads"])
        assert measured == 2 * layers * heads * head_dim * (4 if dtype == "fp32" else 2)
        assert kv_token_bytes(cfg, eng.dtype) == measured
        batched, serial = BatchRunner(eng), BatchRunner(eng, serial=True)
        assert batched.kv_bytes_for(3, 1) == KV_CHUNK * measured
        assert serial.kv_bytes_for(10, 5) == 14 * measured
        runner = BatchRunner(eng, BatchConfig(max_batch=1, kv_budget_bytes=KV_CHUNK * measured))
        runner.add(SeqRequest([5, 6, 7], 2, stop_ids=NEVER))
        runner.step()
        s = runner.stats()
        assert s["kv_cache_bytes"] == s["kv_reserved_bytes"] == KV_CHUNK * measured  # what a slot really allocated
    finally:
        eng.close()


def test_kv_bytes_for_is_what_a_slot_allocates(engine: moetier.Engine) -> None:
    runner, tb = BatchRunner(engine), _token_bytes(engine)
    assert runner.kv_bytes_for(3, 1) == KV_CHUNK * tb
    assert runner.kv_bytes_for(10, KV_CHUNK - 9) == KV_CHUNK * tb  # 10 + 246 cached tokens: one chunk
    assert runner.kv_bytes_for(10, KV_CHUNK - 8) == 2 * KV_CHUNK * tb
    assert runner.kv_bytes_for(5, 0) == KV_CHUNK * tb  # echo only: the prompt
    assert runner.kv_bytes_for(1, engine.max_len) == engine.max_len * tb  # capped at the model's limit
    serial = BatchRunner(engine, serial=True)
    assert serial.kv_bytes_for(10, 5) == 14 * tb  # serial: exactly the tokens, the same per-token size


def test_budget_admits_what_fits_and_bounds_the_caches(engine: moetier.Engine) -> None:
    tb = _token_bytes(engine)
    budget = 2 * KV_CHUNK * tb  # two one-chunk requests at a time, whatever max_batch says
    runner = BatchRunner(engine, BatchConfig(max_batch=4, kv_budget_bytes=budget))
    prompts = [engine.encode(t) for t in ("ROMEO:", "JULIET: O", "KING HENRY:", "Ay")]
    ref = [engine.generate(p, 6, stop_at_eos=False).token_ids for p in prompts]
    ids = [runner.add(SeqRequest(p, 6, stop_ids=NEVER)) for p in prompts]
    events: dict[int, list[StepEvent]] = {}
    most, waited = 0, 0
    while not runner.idle():
        for ev in runner.step():
            events.setdefault(ev.seq_id, []).append(ev)
        s = runner.stats()
        assert s["kv_cache_bytes"] == s["kv_reserved_bytes"] <= budget == s["kv_budget_bytes"]
        most, waited = max(most, s["running"]), max(waited, s["kv_waiting"])
    assert most == 2 and waited == 2  # two ran, two waited for KV (not for slots: 4 of them)
    assert [[e.token for e in events[i]] for i in ids] == ref
    s = runner.stats()
    assert s["kv_reserved_bytes"] == s["kv_cache_bytes"] == 0 and s["kv_waiting"] == 0


def test_first_come_first_served_and_cancel_returns_the_reservation(engine: moetier.Engine) -> None:
    tb = _token_bytes(engine)
    runner = BatchRunner(engine, BatchConfig(max_batch=4, kv_budget_bytes=3 * KV_CHUNK * tb))
    a = runner.add(SeqRequest([5, 6], 50, stop_ids=NEVER))  # one chunk
    big = runner.add(SeqRequest([5] * 10, 2 * KV_CHUNK, stop_ids=NEVER))  # three chunks: waits for a
    small = runner.add(SeqRequest([7], 3, stop_ids=NEVER))  # one chunk: would fit, but comes after big
    started = {ev.seq_id for ev in runner.step()}
    assert started == {a} and runner.stats()["kv_waiting"] == 2
    runner.cancel(a)
    assert runner.stats()["kv_reserved_bytes"] == 0
    events = runner.step()
    assert [e.finish_reason for e in events if e.seq_id == a] == ["cancelled"]
    assert {e.seq_id for e in events} == {a, big}  # big first; small still waits behind it
    assert runner.stats()["kv_reserved_bytes"] == 3 * KV_CHUNK * tb and runner.pending == 1
    runner.cancel(big)
    assert {e.seq_id for e in runner.step()} == {big, small}


def test_never_fits_is_refused_naming_both_numbers(engine: moetier.Engine) -> None:
    tb = _token_bytes(engine)
    budget = KV_CHUNK * tb
    for serial in (False, True):
        runner = BatchRunner(engine, BatchConfig(kv_budget_bytes=budget), serial=serial)
        need = runner.kv_bytes_for(200, 100)
        with pytest.raises(ConfigError, match=f"needs {need} bytes of KV cache, more than the whole KV budget of "
                                              f"{budget} bytes"):  # fmt: skip
            runner.add(SeqRequest([5] * 200, 100))
        assert runner.idle()
    runner = BatchRunner(engine, BatchConfig(kv_budget_bytes=budget))
    ok = runner.add(SeqRequest([5] * 200, KV_CHUNK - 199, stop_ids=NEVER))  # exactly one chunk
    while not runner.idle():
        for ev in runner.step():
            assert ev.seq_id == ok
    assert runner.stats()["tokens_generated"] == KV_CHUNK - 199


def test_without_a_budget_slots_keep_their_caches(engine: moetier.Engine) -> None:
    runner = BatchRunner(engine, BatchConfig(max_batch=2))
    runner.add(SeqRequest([5, 6], 2, stop_ids=NEVER))
    while not runner.idle():
        runner.step()
    s = runner.stats()
    assert s["kv_budget_bytes"] == 0 and s["kv_reserved_bytes"] == 0
    assert s["kv_cache_bytes"] == KV_CHUNK * _token_bytes(engine)  # kept for the slot's next sequence
