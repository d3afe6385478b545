"""SlotDecoder KV caches (runtime/batch.py): sized per sequence (reserve rounded to KV_CHUNK), grown
when a longer sequence takes the slot, never written past; both attention variants stay exact."""

from __future__ import annotations

import pytest
import torch

import moetier
from moetier.errors import ConfigError
from moetier.runtime.batch import KV_CHUNK, BatchConfig, BatchRunner, SeqRequest, SlotDecoder
from moetier.runtime.lean import LeanDecoder


@pytest.fixture(scope="module")
def lean(engine: moetier.Engine) -> LeanDecoder:
    dec = engine.decoder
    assert isinstance(dec, LeanDecoder) and dec.max_len > 2 * KV_CHUNK  # 1024 on the bundled model
    return dec


def _slot_bytes(lean: LeanDecoder, tokens: int) -> int:
    return tokens * lean.token_bytes  # lean.kv_token_bytes (test_batch_kv checks it against the allocation)


def test_cache_sized_to_the_reserve_and_regrown(lean: LeanDecoder) -> None:
    slots = SlotDecoder(lean, 3)
    assert slots.cache_bytes() == 0  # nothing before a prefill
    slots.prefill(0, [5, 6, 7], reserve=10)
    slots.prefill(1, [5] * 5, reserve=KV_CHUNK + 1)
    assert slots.cap[:2] == [KV_CHUNK, 2 * KV_CHUNK]
    assert slots.cache_bytes() == _slot_bytes(lean, 3 * KV_CHUNK)
    slots.prefill(0, [5, 6], reserve=3)  # a shorter sequence reuses the slot's cache
    assert slots.cap[0] == KV_CHUNK
    slots.prefill(0, [5, 6], reserve=lean.max_len + 0)  # a longer one grows it, never past max_len
    assert slots.cap[0] == lean.max_len
    slots.prefill(2, list(range(3, 3 + 300)), reserve=1)  # at least the prompt
    assert slots.cap[2] == 2 * KV_CHUNK and slots.pos[2] == 300
    slots.prefill(2, [4])  # no reserve: the model's limit
    assert slots.cap[2] == lean.max_len


def test_never_written_past_the_cache(lean: LeanDecoder) -> None:
    slots = SlotDecoder(lean, 2)
    slots.prefill(0, [5] * (KV_CHUNK - 1), reserve=1)  # cap KV_CHUNK: one decode step fits
    slots.decode([0], [7])
    with pytest.raises(ConfigError, match=f"slot 0: sequence of {KV_CHUNK + 1} tokens exceeds its KV cache"):
        slots.decode([0], [7])
    with pytest.raises(ConfigError, match="slot 1 has no sequence"):
        slots.decode([1], [7])
    with pytest.raises(ConfigError, match="exceeds the KV cache of"):
        slots.prefill(1, [5], reserve=lean.max_len + 1)
    with pytest.raises(ConfigError, match="slot 2 out of range"):
        slots.prefill(2, [5])


def test_padded_equals_loop_over_caches_of_different_sizes(lean: LeanDecoder) -> None:
    """Padded attention stacks caches of unequal capacity (zero padding), rows equal the loop's."""
    outs = {}
    for attention in ("loop", "padded"):
        slots = SlotDecoder(lean, 3, attention)  # type: ignore[arg-type]
        slots.prefill(0, [5, 6], reserve=4)  # cap KV_CHUNK
        slots.prefill(1, list(range(3, 3 + KV_CHUNK + 20)), reserve=KV_CHUNK + 30)  # cap 2 * KV_CHUNK, longer
        slots.prefill(2, [9], reserve=lean.max_len)
        outs[attention] = torch.stack([slots.decode([0, 1, 2], [7, 8, 9]) for _ in range(3)])  # [3, B, V]
    assert torch.isfinite(outs["padded"]).all()
    torch.testing.assert_close(outs["padded"], outs["loop"], rtol=1e-5, atol=1e-5)


def test_runner_reserves_prompt_plus_max_new_tokens_minus_one(engine: moetier.Engine, lean: LeanDecoder) -> None:
    runner = BatchRunner(engine, BatchConfig(max_batch=4))
    for n in (3, 5):
        runner.add(SeqRequest([5, 6, 7], n, stop_ids=frozenset()))
    runner.add(SeqRequest([5] * 10, KV_CHUNK, stop_ids=frozenset()))  # 10 + 255 cached: two chunks
    runner.add(SeqRequest([5] * 7, KV_CHUNK - 6, stop_ids=frozenset()))  # 7 + 249 cached: one chunk
    runner.step()
    assert runner.stats()["kv_cache_bytes"] == _slot_bytes(lean, 5 * KV_CHUNK)  # not 4 x max_len
    while not runner.idle():
        runner.step()
    assert runner.stats()["tokens_generated"] == 3 + 5 + KV_CHUNK + KV_CHUNK - 6
