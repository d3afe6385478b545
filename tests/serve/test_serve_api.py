"""The server against the official `openai` client on loopback: completions, chat, streaming,
stop strings, seeds, models, health, metrics, and concurrent requests decoded in shared batches (all
admitted in one step: the batch does not depend on when each request arrived). Greedy server output must
equal Engine.generate of the same prompt alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest

from moetier.config import SamplingConfig
from moetier.runtime.engine import Engine
from moetier.serve.prompts import chat_text
from serve.conftest import NAME, FakeClock, HeldRunner, wait_for

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:", "Good morrow,",
           "HAMLET:\nTo be", "What light", "MERCUTIO:\nNay"]  # fmt: skip


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def reference(engine: Engine, prompt: str, n: int) -> tuple[str, int]:
    """(text, generated tokens) of greedy Engine.generate alone."""
    r = engine.generate(prompt, n, SamplingConfig())
    return r.text, len(r.token_ids)


def test_completion_equals_engine_generate(engine: Engine, make_server: Callable[..., Any]) -> None:
    want, n_tok = reference(engine, PROMPTS[0], 24)
    url, _ = make_server()
    out = client(url).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.model == NAME
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == ("length" if n_tok == 24 and len(want) > 0 else "stop")
    assert out.usage is not None and out.usage.prompt_tokens == len(engine.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == n_tok
    assert out.usage.total_tokens == out.usage.prompt_tokens + n_tok
    # token-id prompts are accepted too, with the same result; the default max_tokens is 16
    ids = engine.encode(PROMPTS[0])
    again = client(url).completions.create(model=NAME, prompt=ids, temperature=0)
    assert again.usage is not None and again.usage.completion_tokens <= 16
    assert want.startswith(again.choices[0].text)


def test_chat_uses_plain_template_and_streams_the_same(engine: Engine, make_server: Callable[..., Any]) -> None:
    from moetier.serve.schemas import ChatMessage

    messages = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "Who goes there?"}]
    prompt = chat_text(engine.tokenizer, [ChatMessage.model_validate(m) for m in messages])
    assert prompt == "System: Speak as a king.\nUser: Who goes there?\nAssistant:"
    want, _ = reference(engine, prompt, 20)
    url, _ = make_server()
    c = client(url)
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens  # type: ignore[union-attr]


def test_streamed_completion_and_stop_strings(engine: Engine, make_server: Callable[..., Any]) -> None:
    want, _ = reference(engine, PROMPTS[1], 30)
    stop = want[6:9]  # a string inside the reference output
    assert stop and stop in want
    url, _ = make_server()
    c = client(url)
    chunks = list(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # stop: the text ends right before the first occurrence, the stop string excluded
    cut = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert cut.choices[0].text == want[: want.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=stop,
                                         stream=True))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in streamed) == want[: want.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    c = client(url)
    kw: dict[str, Any] = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 20, "temperature": 1.0, "top_p": 0.9}
    a = c.completions.create(seed=11, **kw).choices[0].text
    b = c.completions.create(seed=11, **kw).choices[0].text
    others = {c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # sampling does sample


def test_models_health_metrics(make_server: Callable[..., Any]) -> None:
    import httpx2

    clock = FakeClock()  # the generation rate's window: 2 s old at the request, and still when /metrics is read
    url, _ = make_server(clock=clock)
    clock.advance(2.0)
    c = client(url)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.models.retrieve(NAME).id == NAME
    health = httpx2.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == NAME
    out = c.completions.create(model=NAME, prompt="ROMEO:", max_tokens=4, temperature=0)
    assert out.usage is not None
    resp = httpx2.get(f"{url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    metrics = _parse_metrics(resp.text)
    assert metrics['moetier_requests_total{route="/v1/completions",status="200"}'] == 1
    assert metrics["moetier_completion_tokens_total"] == out.usage.completion_tokens >= 1
    assert metrics["moetier_prompt_tokens_total"] == out.usage.prompt_tokens >= 1
    assert metrics["moetier_generation_tokens_per_second"] == pytest.approx(out.usage.completion_tokens / 2.0)
    assert metrics['moetier_expert_hits_total{tier="host"}'] + metrics['moetier_expert_misses_total{tier="host"}'] > 0
    assert 'moetier_precision_experts{precision="full"}' in metrics
    for name in ("moetier_bytes_moved_total{link=\"disk_host\"}", "moetier_sparsity_achieved", "moetier_queue_depth",
                 "moetier_requests_running", "moetier_batch_mean_size"):  # fmt: skip
        assert name in metrics, name
    assert metrics["moetier_kv_cache_bytes"] > 0  # the request's slot kept its (sized) cache


def _parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_concurrent_requests_share_batches(engine: Engine, make_server: Callable[..., Any]) -> None:
    """The runner admits nothing until all 8 requests wait in it (HeldRunner), so they are prefilled in one step
    and every decode step decodes each of them that has not finished: the batches are fixed, not timing's."""
    refs = [reference(engine, p, 24) for p in PROMPTS]
    runner = HeldRunner(engine, max_batch=8)
    url, _ = make_server(max_batch=8, runner=runner)
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out = client(url).completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0)
            got[i] = out.choices[0].text
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    assert wait_for(lambda: runner.pending == len(PROMPTS)), runner.stats()
    assert runner.stats()["steps"] == 0  # none started before the others came
    runner.gate.set()
    for t in threads:
        t.join(60)
    assert not errors
    assert [got[i] for i in range(len(PROMPTS))] == [text for text, _ in refs]
    stats = runner.stats()
    decoded = [n - 1 for _, n in refs]  # each sequence's first token comes from its prefill
    assert stats["mode"] == "batched" and stats["decode_steps"] == max(decoded)
    assert stats["mean_batch"] == pytest.approx(sum(decoded) / max(decoded)) and stats["mean_batch"] > 1.0


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_model_without_tokenizer_takes_token_ids(tiny_ckpt: Callable[..., Any], family: str) -> None:
    from moetier.runtime.wire import load
    from moetier.serve import ServeConfig, create_app
    from serve.conftest import serve

    with load(tiny_ckpt(family)) as eng:
        app = create_app(eng, ServeConfig(model_name="tiny"))
        with serve(app) as url:
            c = client(url)
            out = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0)
            assert out.choices[0].text == "" and out.usage is not None and out.usage.completion_tokens >= 1
            with pytest.raises(openai.BadRequestError) as err:
                c.completions.create(model="tiny", prompt="text needs a tokenizer", max_tokens=3)
            assert err.value.body["param"] == "prompt"  # type: ignore[index]
