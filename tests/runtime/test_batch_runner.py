"""BatchRunner / SlotDecoder (runtime/batch.py): batched decoding equals decoding each sequence alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetier
from moetier import Budgets, EngineConfig, RuntimeConfig, SamplingConfig
from moetier.errors import ConfigError
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest, SlotDecoder, StepEvent
from moetier.runtime.lean import LeanDecoder

FP32 = RuntimeConfig(device="cpu", dtype="fp32")
NEVER: frozenset[int] = frozenset()  # stop ids that never stop


def _engine(path: Path, runtime: RuntimeConfig = FP32, budget_slots: int | None = None) -> moetier.Engine:
    engine = moetier.load(path, EngineConfig(runtime=runtime))
    if budget_slots is None:
        return engine
    budget = budget_slots * engine.store.slot_bytes + engine.store.staging_bytes
    engine.close()
    return moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime))


def _prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def _drain(runner: BatchRunner, check: int | None = None) -> tuple[dict[int, list[StepEvent]], int]:
    """Step until idle -> (events per seq_id, steps); asserts running <= check after every step."""
    events: dict[int, list[StepEvent]] = {}
    steps = 0
    while not runner.idle():
        for ev in runner.step():
            events.setdefault(ev.seq_id, []).append(ev)
        steps += 1
        assert check is None or runner.running <= check
        assert steps < 1000
    return events, steps


def _tokens(evs: list[StepEvent]) -> list[int]:
    return [e.token for e in evs if e.token is not None]


def test_bundled_batch_equals_generate_alone(engine: moetier.Engine) -> None:
    prompts = [engine.encode(t) for t in ("ROMEO:", "JULIET: O Romeo, Romeo", "KING HENRY:\nWhat", "Ay")]
    ref = [engine.generate(p, 12, stop_at_eos=False).token_ids for p in prompts]
    runner = BatchRunner(engine, BatchConfig(max_batch=8))
    ids = [runner.add(SeqRequest(p, 12, stop_ids=NEVER)) for p in prompts]
    events, steps = _drain(runner)
    assert [_tokens(events[i]) for i in ids] == ref
    assert steps == 12 and all(events[i][-1].finish_reason == "length" for i in ids)
    s = runner.stats()
    assert s["mode"] == "batched" and s["decode_steps"] == 11 and s["mean_batch"] == 4.0
    assert s["tokens_generated"] == 48 and s["prefill_tokens"] == sum(map(len, prompts))


def test_slot_logits_equal_lean_alone(engine: moetier.Engine) -> None:
    """Every decode row's logits allclose (fp32) to the single-sequence decoder's, loop and padded."""
    lean = engine.decoder
    assert isinstance(lean, LeanDecoder)
    prompts = _prompts(3, 4096, seed=1)
    steps = 4
    ref: list[list[torch.Tensor]] = []
    for p in prompts:  # single-sequence decoding, teacher-forced on token 7
        lean.reset()
        rows = [lean.forward(torch.tensor([p]))[-1]]
        rows += [lean.forward(torch.tensor([[7]]))[-1] for _ in range(steps)]
        ref.append(rows)
    for attention in ("loop", "padded"):
        slots = SlotDecoder(lean, 4, attention)  # type: ignore[arg-type]
        order = [2, 0, 3]  # slots in any order
        for s, p, r in zip(order, prompts, ref, strict=True):
            torch.testing.assert_close(slots.prefill(s, p), r[0])
        for t in range(steps):
            out = slots.decode(order, [7, 7, 7])  # [B, V]
            for b in range(3):
                torch.testing.assert_close(out[b], ref[b][t + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "mixtral", "gpt_oss"])  # gpt_oss: sinks, windows of 8
def test_other_families_batch_equals_generate(tiny_ckpt, family: str) -> None:
    engine = _engine(tiny_ckpt(family), budget_slots=3)  # evictions inside the batched MoE calls
    prompts = _prompts(5, 96)
    ref = [engine.generate(p, 8, stop_at_eos=False).token_ids for p in prompts]
    runner = BatchRunner(engine, BatchConfig(max_batch=5))
    ids = [runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts]
    events, _ = _drain(runner)
    assert [_tokens(events[i]) for i in ids] == ref
    assert engine.stats()["misses"] > 0
    engine.close()


def test_join_mid_batch_and_max_batch(tiny_ckpt) -> None:
    engine = _engine(tiny_ckpt("qwen3_moe"))
    prompts = _prompts(6, 96, seed=5)
    lens = [3, 9, 5, 7, 2, 6]
    ref = [engine.generate(p, n, stop_at_eos=False).token_ids for p, n in zip(prompts, lens, strict=True)]
    runner = BatchRunner(engine, BatchConfig(max_batch=3))
    ids = [runner.add(SeqRequest(p, n, stop_ids=NEVER)) for p, n in zip(prompts[:4], lens[:4], strict=True)]
    assert (runner.running, runner.pending) == (0, 4)
    events: dict[int, list[StepEvent]] = {}
    for _ in range(3):
        for ev in runner.step():
            events.setdefault(ev.seq_id, []).append(ev)
        assert runner.running <= 3
    assert runner.pending == 1  # queued, never refused
    ids += [runner.add(SeqRequest(p, n, stop_ids=NEVER)) for p, n in zip(prompts[4:], lens[4:], strict=True)]
    rest, _ = _drain(runner, check=3)
    for k, v in rest.items():
        events.setdefault(k, []).extend(v)
    assert [_tokens(events[i]) for i in ids] == ref
    assert all(events[i][-1].finished and sum(e.finished for e in events[i]) == 1 for i in ids)
    assert 1 < runner.stats()["mean_batch"] <= 3
    engine.close()


def test_cancel_frees_the_slot(tiny_ckpt) -> None:
    engine = _engine(tiny_ckpt("qwen3_moe"))
    runner = BatchRunner(engine, BatchConfig(max_batch=1))
    a = runner.add(SeqRequest([5, 6, 7], 20, stop_ids=NEVER))
    b = runner.add(SeqRequest([8, 9], 2, stop_ids=NEVER))
    c = runner.add(SeqRequest([10], 2, stop_ids=NEVER))
    assert [e.seq_id for e in runner.step()] == [a] and (runner.running, runner.pending) == (1, 2)
    runner.cancel(a)
    runner.cancel(c)  # pending
    runner.cancel(12345)  # unknown: no-op
    assert (runner.running, runner.pending) == (0, 1)
    events = runner.step()
    assert events[:2] == [StepEvent(a, None, True, "cancelled"), StepEvent(c, None, True, "cancelled")]
    assert [e.seq_id for e in events[2:]] == [b] and runner.running == 1  # b took the freed slot
    runner.cancel(a)  # already cancelled: no-op
    rest, _ = _drain(runner)
    assert set(rest) == {b} and rest[b][-1].finish_reason == "length"
    assert runner.idle() and runner.step() == []
    engine.close()


def test_stop_ids_and_eos(tiny_ckpt) -> None:
    engine = _engine(tiny_ckpt("qwen3_moe"))
    prompt = [4, 17, 33, 60]
    ref = engine.generate(prompt, 10, stop_at_eos=False).token_ids
    stop = ref[3]
    cut = ref.index(stop) + 1
    runner = BatchRunner(engine)
    s = runner.add(SeqRequest(prompt, 10, stop_ids=frozenset({stop})))
    d = runner.add(SeqRequest(prompt, 10))  # None: the engine's EOS ids, as generate() stops
    events, _ = _drain(runner)
    assert _tokens(events[s]) == ref[:cut] and events[s][-1] == StepEvent(s, stop, True, "stop")
    with_eos = engine.generate(prompt, 10).token_ids
    assert _tokens(events[d]) == with_eos
    assert events[d][-1].finish_reason == ("stop" if with_eos[-1] in engine.eos_ids else "length")
    engine.close()


def test_length_limit_and_bad_requests(tiny_ckpt) -> None:
    engine = _engine(tiny_ckpt("qwen3_moe"), RuntimeConfig(device="cpu", dtype="fp32", max_seq_len=16))
    runner = BatchRunner(engine, BatchConfig(max_batch=2))
    one = runner.add(SeqRequest([5] * 16, 1, stop_ids=NEVER))  # exactly fills the cache
    events, _ = _drain(runner)
    assert len(events[one]) == 1 and events[one][0].finish_reason == "length"
    with pytest.raises(ConfigError, match="exceeds the KV cache of 16"):
        runner.add(SeqRequest([5] * 10, 8))
    with pytest.raises(ConfigError, match="prompt_ids is empty"):
        runner.add(SeqRequest([], 4))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        runner.add(SeqRequest([5], 0))
    with pytest.raises(ConfigError, match="outside the vocabulary of 96"):
        runner.add(SeqRequest([5, 96], 2))
    with pytest.raises(ConfigError, match="max_batch"):
        BatchRunner(engine, BatchConfig(max_batch=0))
    with pytest.raises(ConfigError, match="attention must be"):
        BatchConfig(attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_budget_bytes must be positive"):
        BatchConfig(kv_budget_bytes=0)
    with pytest.raises(ConfigError, match="takes a BatchConfig"):
        BatchRunner(engine, 3)  # type: ignore[arg-type]
    assert runner.idle() and runner.pending == 0
    engine.close()


@pytest.mark.parametrize(("family", "lean"), [("qwen3_moe", False)])
def test_serial_fallback(tiny_ckpt, family: str, lean: bool) -> None:
    """A model on transformers' modules (lean=False): one at a time."""
    engine = _engine(tiny_ckpt(family), RuntimeConfig(device="cpu", dtype="fp32", lean=lean))
    assert not isinstance(engine.decoder, LeanDecoder)
    prompts = _prompts(3, 96, seed=8)
    ref = [engine.generate(p, 5, stop_at_eos=False).token_ids for p in prompts]
    runner = BatchRunner(engine, BatchConfig(max_batch=4))
    ids = [runner.add(SeqRequest(p, 5, stop_ids=NEVER)) for p in prompts]
    events, steps = _drain(runner, check=1)
    assert [_tokens(events[i]) for i in ids] == ref
    s = runner.stats()
    assert s["mode"] == "serial" and steps == 15 and s["mean_batch"] == 1.0
    engine.close()


def test_seeded_sampling_independent_of_batch(tiny_ckpt) -> None:
    engine = _engine(tiny_ckpt("qwen3_moe"))
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, seed=11)
    prompt = [9, 21, 40]
    alone = engine.generate(prompt, 12, sampling, stop_at_eos=False).token_ids
    runs = []
    for others in (0, 3):
        runner = BatchRunner(engine, BatchConfig(max_batch=4))
        for p in _prompts(others, 96, seed=others):
            runner.add(SeqRequest(p, 12, SamplingConfig(temperature=1.0, seed=others), stop_ids=NEVER))
        me = runner.add(SeqRequest(prompt, 12, sampling, stop_ids=NEVER))
        events, _ = _drain(runner)
        runs.append(_tokens(events[me]))
    assert runs[0] == runs[1] == alone
    assert len(set(alone)) > 1  # really sampled, not a constant
    engine.close()


def test_generate_between_steps_and_store_stats(tiny_ckpt) -> None:
    """Batched slots have their own caches: generate() between steps does not disturb them."""
    engine = _engine(tiny_ckpt("mixtral"), budget_slots=2)
    prompts = _prompts(2, 96, seed=2)
    ref = [engine.generate(p, 6, stop_at_eos=False).token_ids for p in prompts]
    before = engine.stats()
    runner = BatchRunner(engine)
    ids = [runner.add(SeqRequest(p, 6, stop_ids=NEVER)) for p in prompts]
    events: dict[int, list[StepEvent]] = {}
    for _ in range(3):
        for ev in runner.step():
            events.setdefault(ev.seq_id, []).append(ev)
    assert engine.generate(prompts[0], 6, stop_at_eos=False).token_ids == ref[0]
    rest, _ = _drain(runner)
    assert [_tokens(events[i] + rest[i]) for i in ids] == ref
    after = engine.stats()
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
    engine.close()
