"""Per-sequence failure in the batch runner (runtime/batch.py): an ExpertReadError or NumericalError in a
step fails only the sequences of the rows it names, frees their slots, and the rest of the batch goes on with
exactly the tokens it would have had (the retried step is idempotent); a failure naming no row fails that
step's sequences, never the runner. Faults are injected into the lean decoder's layers (finish_layer: the
MoE block's place, where the store raises) and output head."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import moetier
from fault_inject import eio_on
from moetier import Budgets, EngineConfig, RuntimeConfig
from moetier.errors import ExpertReadError, NumericalError
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest, SlotDecoder, StepEvent
from moetier.runtime.lean import LeanDecoder
from moetier.runtime.observers import Tap
from moetier.traces import load as load_trace
from moetier.types import ExpertKey

NEVER: frozenset[int] = frozenset()
PATH = "/models/x/model-00002.safetensors"


@pytest.fixture(scope="module")
def prompts(engine: moetier.Engine) -> list[list[int]]:
    return [engine.encode(t) for t in ("ROMEO:", "JULIET: O Romeo, Romeo", "KING HENRY:\nWhat", "Ay me")]


@pytest.fixture(scope="module")
def ref(engine: moetier.Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.generate(p, 8, stop_at_eos=False).token_ids for p in prompts]


def _lean(engine: moetier.Engine) -> LeanDecoder:
    assert isinstance(engine.decoder, LeanDecoder)
    return engine.decoder


def _read_error(rows: tuple[int, ...]) -> ExpertReadError:
    return ExpertReadError(f"{PATH}: expert (1, 3) could not be read: [Errno 5] Input/output error",
                           ExpertKey(1, 3), PATH, rows)  # fmt: skip


def _fault(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine, when: Callable[[int, int], Any]) -> list[int]:
    """Wrap layer 1's finish_layer: `when(rows of the call, calls so far)` returns an exception to raise or None.
    Returns the list of row counts of layer 1's calls (one per forward)."""
    lean = _lean(engine)
    orig, calls = lean.finish_layer, []

    def finish_layer(L: Any, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        if L is lean.layers[1]:
            calls.append(x.shape[0])
            exc = when(x.shape[0], len(calls))
            if exc is not None:
                raise exc
        return orig(L, x, att)

    monkeypatch.setattr(lean, "finish_layer", finish_layer)
    return calls


def _drain(runner: BatchRunner) -> dict[int, list[StepEvent]]:
    out: dict[int, list[StepEvent]] = {}
    steps = 0
    while not runner.idle():
        for ev in runner.step():
            out.setdefault(ev.seq_id, []).append(ev)
        steps += 1
        assert steps < 200
    return out


def _tokens(evs: list[StepEvent]) -> list[int]:
    return [e.token for e in evs if e.token is not None]


def test_read_error_fails_only_its_rows(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine,
                                        prompts: list[list[int]], ref: list[list[int]]) -> None:  # fmt: skip
    """The 2nd batched decode step fails row 1: that sequence ends with the error, its slot goes to the waiting
    request, and every other sequence's tokens equal decoding it alone."""
    fired: list[int] = []

    def when(rows: int, n: int) -> ExpertReadError | None:
        if rows == 3 and not fired and sum(1 for c in calls if c == 3) == 2:
            fired.append(n)
            return _read_error((1,))
        return None

    calls = _fault(monkeypatch, engine, when)
    runner = BatchRunner(engine, BatchConfig(max_batch=3, kv_budget_bytes=1 << 30))
    ids = [runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts]
    events = _drain(runner)
    failed = events[ids[1]]
    assert fired and failed[-1].finish_reason == "error" and failed[-1].token is None and failed[-1].finished
    assert isinstance(failed[-1].error, ExpertReadError) and failed[-1].error.path == PATH
    assert _tokens(failed) == ref[1][:2]  # its prefill's token and one decode step, then the failed step
    for i in (0, 2, 3):  # the others, the waiting one included, as if alone
        assert _tokens(events[i]) == ref[i] and events[i][-1].finish_reason == "length"
    s = runner.stats()
    assert s["sequence_errors"] == 1 and s["running"] == 0 and s["kv_reserved_bytes"] == 0 == s["kv_cache_bytes"]


def test_unattributed_error_fails_that_step_only(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine,
                                                 prompts: list[list[int]], ref: list[list[int]]) -> None:  # fmt: skip
    fired: list[int] = []

    def when(rows: int, n: int) -> ExpertReadError | None:
        if rows == 2 and not fired:
            fired.append(n)
            return _read_error(())  # the rows are unknown
        return None

    _fault(monkeypatch, engine, when)
    runner = BatchRunner(engine, BatchConfig(max_batch=2))
    a, b = (runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts[:2])
    events = _drain(runner)
    for s in (a, b):
        assert [e.finish_reason for e in events[s]] == [None, "error"] and len(_tokens(events[s])) == 1
    assert events[a][-1].error is events[b][-1].error  # one event per sequence, the same cause
    c = runner.add(SeqRequest(prompts[2], 8, stop_ids=NEVER))  # the runner goes on serving
    assert _tokens(_drain(runner)[c]) == ref[2]


def test_persistent_fault_ends_the_step(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine,
                                        prompts: list[list[int]]) -> None:  # fmt: skip
    """A fault that names row 0 of every retry: each retry drops one sequence, the step ends after B tries."""
    calls = _fault(monkeypatch, engine, lambda rows, n: _read_error((0,)) if rows >= 1 and n > 3 else None)
    runner = BatchRunner(engine, BatchConfig(max_batch=3))
    ids = [runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts[:3]]
    runner.step()  # three prefills (calls 1..3)
    events = runner.step()  # the decode step: tries with 3, 2, 1 rows
    assert calls[3:] == [3, 2, 1]
    assert sorted(e.seq_id for e in events) == ids and all(e.finish_reason == "error" for e in events)
    assert runner.idle() or (runner.step() == [] and runner.idle())


def test_prefill_error_fails_that_sequence(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine,
                                           prompts: list[list[int]], ref: list[list[int]]) -> None:  # fmt: skip
    n_bad = len(prompts[1])
    _fault(monkeypatch, engine, lambda rows, n: _read_error((n_bad - 1,)) if rows == n_bad else None)
    runner = BatchRunner(engine, BatchConfig(max_batch=4))
    ids = [runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts]
    events = _drain(runner)
    assert [e.finish_reason for e in events[ids[1]]] == ["error"] and events[ids[1]][0].token is None
    for i in (0, 2, 3):
        assert _tokens(events[ids[i]]) == ref[i]


def test_nonfinite_logits_fail_their_row_without_retry(
    monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine, prompts: list[list[int]], ref: list[list[int]]
) -> None:
    """Engine.step's NumericalError (rows, logits): the forward ran to its end, the finite rows are sampled from
    its logits (a retry would decode them twice: their tokens would differ from decoding alone)."""
    lean = _lean(engine)
    orig, fired = lean.head, list[int]()

    def head(x: torch.Tensor) -> torch.Tensor:
        out = orig(x)
        if x.shape[0] == 3 and not fired:
            fired.append(1)
            out[2] = float("nan")
        return out

    monkeypatch.setattr(lean, "head", head)
    runner = BatchRunner(engine, BatchConfig(max_batch=3))
    ids = [runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts[:3]]
    events = _drain(runner)
    bad = events[ids[2]][-1]
    assert bad.finish_reason == "error" and isinstance(bad.error, NumericalError)
    assert getattr(bad.error, "rows", None) == (2,) and _tokens(events[ids[2]]) == ref[2][:1]
    assert _tokens(events[ids[0]]) == ref[0] and _tokens(events[ids[1]]) == ref[1]


def test_serial_mode_fails_the_sequence(monkeypatch: pytest.MonkeyPatch, engine: moetier.Engine,
                                        prompts: list[list[int]], ref: list[list[int]]) -> None:  # fmt: skip
    orig, fired = engine.step, list[int]()

    def step(ids: torch.Tensor | None = None, index: int | None = None, **kw: Any) -> torch.Tensor:
        if index == 3 and not fired:
            fired.append(1)
            raise _read_error((0,))
        return orig(ids, index, **kw)

    monkeypatch.setattr(engine, "step", step)
    runner = BatchRunner(engine, BatchConfig(max_batch=2), serial=True)
    a, b = (runner.add(SeqRequest(p, 8, stop_ids=NEVER)) for p in prompts[:2])
    events = _drain(runner)
    assert events[a][-1].finish_reason == "error" and _tokens(events[a]) == ref[0][:3]
    assert _tokens(events[b]) == ref[1]


def test_failed_decode_leaves_positions(engine: moetier.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """SlotDecoder.decode advances positions only after the whole forward: a retry gives the same logits."""
    slots = SlotDecoder(_lean(engine), 2)
    slots.prefill(0, [5, 6, 7], reserve=8)
    slots.prefill(1, [8, 9], reserve=8)
    fired: list[int] = []

    def once(rows: int, n: int) -> ExpertReadError | None:
        if fired:
            return None
        fired.append(n)
        return _read_error((0,))

    _fault(monkeypatch, engine, once)
    with pytest.raises(ExpertReadError):
        slots.decode([0, 1], [10, 11])
    assert slots.pos == [3, 2]
    again = slots.decode([0, 1], [10, 11])  # [2, V]
    monkeypatch.undo()
    fresh = SlotDecoder(_lean(engine), 2)
    fresh.prefill(0, [5, 6, 7], reserve=8)
    fresh.prefill(1, [8, 9], reserve=8)
    torch.testing.assert_close(again, fresh.decode([0, 1], [10, 11]))
    assert slots.pos == [4, 3]


def test_eio_on_disk_fails_the_sequences_routed_to_it(tiny_ckpt) -> None:
    """End to end: EIO on one expert's bytes in the checkpoint (os.preadv), the host tier holding one expert so
    every access reads the disk. Exactly the sequences whose route reaches that expert fail (with the error
    naming file and expert); the others finish with the tokens they have alone."""
    path = tiny_ckpt("qwen3_moe")
    runtime = RuntimeConfig(device="cpu", dtype="fp32")
    probe = moetier.load(path, EngineConfig(runtime=runtime))
    budget = probe.store.slot_bytes + probe.store.staging_bytes
    probe.close()
    eng = moetier.load(path, EngineConfig(budgets=Budgets(host_expert_bytes=budget), runtime=runtime))
    try:
        # 1. each prompt alone: its tokens and the layer-1 experts its whole run routes to
        g = torch.Generator().manual_seed(9)
        ps = [torch.randint(3, 96, (4,), generator=g).tolist() for _ in range(6)]
        used: list[set[int]] = []
        seen: list[list[list[int]]] = []
        eng.observers.add(Tap(lambda r: seen.append(r.ids.tolist()) if r.layer == 1 else None))
        ref = []
        for p in ps:
            seen.clear()
            ref.append(eng.generate(p, 5, stop_at_eos=False).token_ids)
            used.append({e for call in seen for row in call for e in row})
        e = next(x for x in range(8) if 0 < sum(x in u for u in used) < len(ps))
        hit = {i for i, u in enumerate(used) if e in u}
        # 2. the batch with expert (1, e) unreadable
        key = ExpertKey(1, e)
        runner = BatchRunner(eng, BatchConfig(max_batch=4))
        ids = [runner.add(SeqRequest(p, 5, stop_ids=NEVER)) for p in ps]
        with eio_on(eng.store.source.reader, key):  # type: ignore[union-attr]
            events = _drain(runner)
        failed = {k for k, i in enumerate(ids) if events[i][-1].finish_reason == "error"}
        assert failed == hit
        for k, i in enumerate(ids):
            if k in hit:
                err = events[i][-1].error
                assert isinstance(err, ExpertReadError) and err.key == key and "safetensors" in str(err)
            else:
                assert _tokens(events[i]) == ref[k]
        assert runner.stats()["sequence_errors"] == len(hit) and runner.idle()
    finally:
        eng.close()


# -- the trace of a run with a failed step (issue 18): only the routing of forwards that completed ---------------

Row = tuple[int, int, int, tuple[int, ...]]  # (step, token, layer, experts)


def _traced_run(engine: moetier.Engine, path: Path, run: Callable[[moetier.Engine], Any]) -> list[Row]:
    """`run` on a fresh engine like `engine` recording a trace at `path` -> the saved trace's rows (weights
    checked finite and in [0, 1])."""
    eng = moetier.load(engine.info.path, engine.config)
    try:
        eng.record_trace(path)
        run(eng)
    finally:
        eng.close()  # writes the trace
    rows = load_trace(path).table.to_pylist()
    assert rows and all(0.0 <= w <= 1.0 for r in rows for w in r["weights"])
    return [(r["step"], r["token"], r["layer"], tuple(r["experts"])) for r in rows]


def _batch_run(prompts: list[list[int]], on_fault: Callable[[moetier.Engine, BatchRunner], None] | None
               ) -> Callable[[moetier.Engine], None]:  # fmt: skip
    """A batch of `prompts` (6 tokens each, no stop) drained to the end, `on_fault` installing a fault first."""

    def run(eng: moetier.Engine) -> None:
        runner = BatchRunner(eng, BatchConfig(max_batch=len(prompts)))
        if on_fault is not None:
            on_fault(eng, runner)
        for p in prompts:
            runner.add(SeqRequest(p, 6, stop_ids=NEVER))
        _drain(runner)

    return run


def test_trace_of_a_retried_step_holds_the_retry_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: moetier.Engine, prompts: list[list[int]]
) -> None:
    """Decode step 2 fails in layer 1 (layer 0 has routed and recorded) naming row 1; the retry runs rows 0 and 2.
    The trace is the fault-free run's minus sequence 1's rows from step 2 on (sequence 2 is the retry's row 1)."""
    fired: list[int] = []

    def install(eng: moetier.Engine, runner: BatchRunner) -> None:
        def when(rows: int, n: int) -> ExpertReadError | None:
            if rows == 3 and not fired and runner.stats()["decode_steps"] == 2:
                fired.append(n)
                return _read_error((1,))
            return None

        _fault(monkeypatch, eng, when)

    want = _traced_run(engine, tmp_path / "ref.parquet", _batch_run(prompts[:3], None))
    got = _traced_run(engine, tmp_path / "fault.parquet", _batch_run(prompts[:3], install))
    assert fired
    expect = [(s, t - (s >= 2 and t == 2), la, e) for s, t, la, e in want if not (s >= 2 and t == 1)]
    assert got == expect
    assert {s for s, *_ in got} == {s for s, *_ in want}  # every step recorded, none twice
    assert len(got) == len(want) - 4 * len(engine.info.moe_layers)  # sequence 1's decode steps 2..5


def test_trace_keeps_the_finite_rows_of_nonfinite_logits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: moetier.Engine, prompts: list[list[int]]
) -> None:
    """Non-finite logits in row 2 of decode step 3: that forward ran to its end and rows 0 and 1 are sampled from
    it, so their routing stays; sequence 2's is dropped from step 3 on."""
    fired: list[int] = []

    def install(eng: moetier.Engine, runner: BatchRunner) -> None:
        lean = _lean(eng)
        orig = lean.head

        def head(x: torch.Tensor) -> torch.Tensor:
            out = orig(x)
            if x.shape[0] == 3 and not fired and runner.stats()["decode_steps"] == 3:
                fired.append(1)
                out[2] = float("nan")
            return out

        monkeypatch.setattr(lean, "head", head)

    want = _traced_run(engine, tmp_path / "ref.parquet", _batch_run(prompts[:3], None))
    got = _traced_run(engine, tmp_path / "fault.parquet", _batch_run(prompts[:3], install))
    assert fired
    assert got == [r for r in want if not (r[0] >= 3 and r[1] == 2)]
    assert len(got) == len(want) - 3 * len(engine.info.moe_layers)  # sequence 2's decode steps 3..5


def test_trace_of_a_step_failed_for_all_has_no_rows_of_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: moetier.Engine, prompts: list[list[int]]
) -> None:
    """A failure naming no row fails decode step 2 for every sequence (no retry): the trace ends with step 1."""
    fired: list[int] = []

    def install(eng: moetier.Engine, runner: BatchRunner) -> None:
        def when(rows: int, n: int) -> ExpertReadError | None:
            if rows == 2 and not fired and runner.stats()["decode_steps"] == 2:
                fired.append(n)
                return _read_error(())
            return None

        _fault(monkeypatch, eng, when)

    want = _traced_run(engine, tmp_path / "ref.parquet", _batch_run(prompts[:2], None))
    got = _traced_run(engine, tmp_path / "fault.parquet", _batch_run(prompts[:2], install))
    assert fired
    assert got == [r for r in want if r[0] < 2] and max(s for s, *_ in want) == 5
