"""Logprobs and echo of the batch runner (runtime/batch.py): log_softmax of the raw logits in fp32, the
prompt's from the prefill's every position; they equal what `moetier eval` scores (Engine.window_logits /
Engine.logits) for the same tokens, batched or serial, and the sampled token's at every step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moetier
from moetier import SamplingConfig
from moetier.errors import ConfigError
from moetier.runtime.batch import ECHO_CHUNK, BatchConfig, BatchRunner, SeqRequest, StepEvent

NEVER: frozenset[int] = frozenset()


def _run(runner: BatchRunner, reqs: list[SeqRequest]) -> list[list[StepEvent]]:
    ids = [runner.add(r) for r in reqs]
    out: dict[int, list[StepEvent]] = {i: [] for i in ids}
    steps = 0
    while not runner.idle():
        for ev in runner.step():
            out[ev.seq_id].append(ev)
        steps += 1
        assert steps < 500
    return [out[i] for i in ids]


def _eval_logprobs(engine: moetier.Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax [T - 1, V] of the logits `moetier eval` scores ids with (one window)."""
    (start, logits, target), *rest = list(engine.window_logits(ids, window=len(ids)))
    assert start == 0 and not rest and target.tolist() == ids[1:]
    return F.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("serial", [False, True])
def test_echo_prompt_logprobs_equal_eval(engine: moetier.Engine, serial: bool) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs k; in a batch of others."""
    ids = engine.encode("ROMEO: But soft, what light through yonder window breaks?")
    ref = _eval_logprobs(engine, ids)  # [T - 1, V]
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # [T - 1]
    runner = BatchRunner(engine, BatchConfig(max_batch=4), serial=serial)
    others = [SeqRequest(engine.encode(t), 5, stop_ids=NEVER) for t in ("JULIET:", "KING HENRY: Once more")]
    evs = _run(runner, [others[0], SeqRequest(ids, 0, logprobs=5, echo=True), others[1]])[1]
    assert len(evs) == 1
    ev = evs[0]
    assert (ev.token, ev.finished, ev.finish_reason, ev.logprob) == (None, True, "length", None)
    assert ev.prompt_logprobs is not None and ev.prompt_top_logprobs is not None
    assert len(ev.prompt_logprobs) == len(ids) and ev.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(ev.prompt_logprobs[1:]), want, rtol=1e-5, atol=1e-5)
    assert ev.prompt_top_logprobs[0] == () and len(ev.prompt_top_logprobs) == len(ids)
    for t, top in enumerate(ev.prompt_top_logprobs[1:]):
        vals, idx = torch.topk(ref[t], 5)
        assert [i for i, _ in top] == idx.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, rtol=1e-5, atol=1e-5)
    assert runner.stats()["prefill_tokens"] >= len(ids)


def test_sampled_logprobs_at_every_step(engine: moetier.Engine) -> None:
    """logprob of each generated token = log_softmax at that step of the raw logits (not of the temperature's),
    checked against eval's logits of prompt + generated; echo's prompt logprobs come on the first event only."""
    ids = engine.encode("JULIET: O Romeo, Romeo")
    sampling = SamplingConfig(temperature=1.5, top_p=0.9, seed=4)
    runner = BatchRunner(engine, BatchConfig(max_batch=3))
    reqs = [
        SeqRequest(ids, 6, sampling, stop_ids=NEVER, logprobs=3, echo=True),
        SeqRequest(engine.encode("ROMEO:"), 6, stop_ids=NEVER, logprobs=0),
        SeqRequest(engine.encode("ROMEO:"), 3, stop_ids=NEVER),  # no logprobs asked: none given
    ]
    echoed, zero, none = _run(runner, reqs)
    for evs, req in ((echoed, reqs[0]), (zero, reqs[1])):
        produced = [e.token for e in evs if e.token is not None]
        assert len(produced) == 6
        ref = _eval_logprobs(engine, req.prompt_ids + produced)  # row len(prompt) - 1 + i scores produced[i]
        for i, ev in enumerate(evs):
            row = ref[len(req.prompt_ids) - 1 + i]
            assert ev.logprob is not None
            assert abs(ev.logprob - float(row[ev.token])) < 1e-4
            k = req.logprobs or 0
            assert [t for t, _ in ev.top_logprobs] == torch.topk(row, k).indices.tolist()
            assert (ev.prompt_logprobs is not None) == (req.echo and i == 0)
    assert echoed[0].prompt_logprobs is not None and len(echoed[0].prompt_logprobs) == len(ids)
    assert all(e.logprob is None and e.top_logprobs == () and e.prompt_logprobs is None for e in none)


def test_echo_of_one_token_and_without_top(engine: moetier.Engine) -> None:
    runner = BatchRunner(engine)
    (one,), (plain,) = _run(runner, [SeqRequest([5], 0, echo=True), SeqRequest([5, 6, 7], 0, echo=True, logprobs=0)])
    assert one.prompt_logprobs == (None,) and one.prompt_top_logprobs is None and one.finish_reason == "length"
    assert plain.prompt_logprobs is not None and len(plain.prompt_logprobs) == 3 and plain.prompt_top_logprobs is None
    assert all(lp is not None and lp <= 0 for lp in plain.prompt_logprobs[1:])


def test_echo_longer_than_a_chunk(engine: moetier.Engine) -> None:
    """Echo scores the prompt ECHO_CHUNK positions at a time: a prompt over one chunk agrees with eval throughout."""
    ids = torch.randint(3, 4000, (ECHO_CHUNK + 45,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _eval_logprobs(engine, ids)
    (ev,) = _run(BatchRunner(engine), [SeqRequest(ids, 0, logprobs=1, echo=True)])[0]
    assert ev.prompt_logprobs is not None and ev.prompt_top_logprobs is not None
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ev.prompt_logprobs[1:]), want, rtol=1e-5, atol=1e-5)
    assert [top[0][0] for top in ev.prompt_top_logprobs[1:]] == ref.argmax(-1).tolist()


def test_bad_logprob_requests(engine: moetier.Engine) -> None:
    runner = BatchRunner(engine)
    with pytest.raises(ConfigError, match="0 only with echo"):
        runner.add(SeqRequest([5], 0))
    for bad in (-1, 21, True):
        with pytest.raises(ConfigError, match=r"logprobs must be None or an int in 0\.\.20"):
            runner.add(SeqRequest([5], 2, logprobs=bad))
    assert runner.idle()
