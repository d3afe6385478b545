"""Bad input gets OpenAI-style JSON errors with the right 4xx status, never a crash or a hang;
a full queue answers 429; the server keeps serving afterwards."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest

from moetier.runtime.batch import StepEvent
from moetier.runtime.engine import Engine
from moetier.serve.errors import APIError
from moetier.serve.prompts import max_new_tokens
from serve.conftest import NAME, SlowRunner, wait_for


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def _assert_error(resp: httpx2.Response, status: int, param: str | None = None, words: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err


OK = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 2}
BAD_BODIES: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("missing prompt", {"model": NAME}, 400, "prompt", "missing"),
    ("missing model", {"prompt": "x"}, 400, "model", "missing"),
    ("max_tokens as string", OK | {"max_tokens": "5"}, 400, "max_tokens", ""),
    ("max_tokens as float", OK | {"max_tokens": 2.5}, 400, "max_tokens", ""),
    ("negative max_tokens", OK | {"max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ("zero max_tokens", OK | {"max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("huge max_tokens", OK | {"max_tokens": 10**9}, 400, "max_tokens", "context"),
    ("prompt too long", OK | {"prompt": [5] * 1030}, 400, "prompt", "longer than the context"),
    ("token id out of vocab", OK | {"prompt": [1, 99999]}, 400, "prompt", "vocabulary"),
    ("empty prompt", OK | {"prompt": ""}, 400, "prompt", "empty"),
    ("an empty prompt of two", OK | {"prompt": ["a", ""]}, 400, "prompt.1", "empty"),
    ("zero max_tokens without echo", OK | {"max_tokens": 0, "echo": False}, 400, "max_tokens", "only with echo"),
    ("token list prompts, one too long", OK | {"prompt": [[5], [5] * 1030]}, 400, "prompt", "longer than the context"),
    ("temperature too high", OK | {"temperature": 3}, 400, "temperature", ""),
    ("top_p zero", OK | {"top_p": 0}, 400, "top_p", ""),
    ("n zero", OK | {"n": 0}, 400, "n", "between 1 and 128"),
    ("n too large", OK | {"n": 129}, 400, "n", "between 1 and 128"),
    ("n past the server's capacity", OK | {"n": 100}, 400, "n", "in flight"),
    ("best_of", OK | {"best_of": 3}, 400, "best_of", ""),
    ("logprobs too many", OK | {"logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("logprobs negative", OK | {"logprobs": -1}, 400, "logprobs", "between 0 and 20"),
    ("logprobs as bool", OK | {"logprobs": True}, 400, "logprobs", ""),
    ("echo as string", OK | {"echo": "yes"}, 400, "echo", ""),
    ("presence penalty", OK | {"presence_penalty": 0.5}, 400, "presence_penalty", ""),
    ("frequency penalty", OK | {"frequency_penalty": -1}, 400, "frequency_penalty", ""),
    ("logit bias", OK | {"logit_bias": {"5": 10}}, 400, "logit_bias", ""),
    ("unknown field", OK | {"top_k": 5}, 400, "top_k", "unsupported parameter"),
    ("too many stops", OK | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("stream as string", OK | {"stream": "yes"}, 400, "stream", ""),
    ("unknown model", OK | {"model": "gpt-4"}, 404, "model", "does not exist"),
]
CHAT_OK = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_CHATS: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("no messages", {"model": NAME, "messages": []}, 400, "messages", ""),
    ("bad role", CHAT_OK | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", ""),
    ("content as int", CHAT_OK | {"messages": [{"role": "user", "content": 5}]}, 400, None, ""),
    ("tools", CHAT_OK | {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tool"),
    ("logprobs as int", CHAT_OK | {"logprobs": 3}, 400, "logprobs", ""),
    ("top_logprobs without logprobs", CHAT_OK | {"top_logprobs": 2}, 400, "top_logprobs", "needs 'logprobs'"),
    ("top_logprobs too many", CHAT_OK | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "between"),
    ("n zero", CHAT_OK | {"n": 0}, 400, "n", ""),
    ("json mode", CHAT_OK | {"response_format": {"type": "json_object"}}, 400, "response_format", ""),
    ("huge max_completion_tokens", CHAT_OK | {"max_completion_tokens": 5000}, 400, "max_completion_tokens", ""),
    ("image part", CHAT_OK | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, None, ""),
]  # fmt: skip


@pytest.fixture(scope="module")
def url(engine: Engine) -> Any:
    from moetier.serve import create_app
    from serve.conftest import config, serve

    with serve(create_app(engine, config())) as base:
        yield base


@pytest.mark.parametrize(("case", "body", "status", "param", "words"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_completion_requests(url: str, case: str, body: dict[str, Any], status: int, param: str | None,
                                 words: str) -> None:  # fmt: skip
    _assert_error(httpx2.post(f"{url}/v1/completions", json=body, timeout=30), status, param, words)


@pytest.mark.parametrize(("case", "body", "status", "param", "words"), BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests(url: str, case: str, body: dict[str, Any], status: int, param: str | None,
                           words: str) -> None:  # fmt: skip
    _assert_error(httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=30), status, param, words)


def test_malformed_bodies_routes_and_the_openai_client(url: str) -> None:
    headers = {"content-type": "application/json"}
    _assert_error(httpx2.post(f"{url}/v1/completions", content=b"{not json", headers=headers), 400, None, "JSON")
    _assert_error(httpx2.post(f"{url}/v1/completions", content=b"\xff\xfe", headers=headers), 400, None, "JSON")
    _assert_error(httpx2.post(f"{url}/v1/completions", content=b"[1, 2]", headers=headers), 400, None, "object")
    _assert_error(httpx2.post(f"{url}/v1/completions", content=b"", headers=headers), 400, None, "JSON")
    _assert_error(httpx2.get(f"{url}/v1/nothing"), 404)
    _assert_error(httpx2.get(f"{url}/v1/completions"), 405)
    _assert_error(httpx2.get(f"{url}/v1/models/other"), 404, "model")
    c = _client(url)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=NAME, prompt="x", max_tokens=2, n=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"repetition_penalty": 1.2})
    assert bad.value.body["param"] == "repetition_penalty"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # harmless extras are accepted, and the server still serves
    out = c.completions.create(model=NAME, prompt="ROMEO:", max_tokens=3, temperature=0, user="u1", n=1,
                               presence_penalty=0, stream_options=None)  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert httpx2.get(f"{url}/health").json()["status"] == "ok"


def test_max_tokens_defaults() -> None:
    assert max_new_tokens(None, 10, 1024, 16, "max_tokens", "prompt") == 16  # completions: 16
    assert max_new_tokens(None, 1020, 1024, 16, "max_tokens", "prompt") == 5  # capped at the room left
    assert max_new_tokens(None, 10, 1024, None, "max_tokens", "messages") == 1015  # chat: the rest of the context
    assert max_new_tokens(1015, 10, 1024, None, "max_tokens", "messages") == 1015
    with pytest.raises(APIError) as err:
        max_new_tokens(1016, 10, 1024, None, "max_completion_tokens", "messages")
    assert err.value.param == "max_completion_tokens"


def test_full_queue_answers_429_and_recovers(engine: Engine, make_server: Callable[..., Any]) -> None:
    runner = SlowRunner(engine, max_batch=1)
    runner.gate.clear()  # the worker blocks inside step(): requests stay in flight
    base, app = make_server(max_batch=1, max_queue=1, runner=runner)
    worker = app.state.worker
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
    with httpx2.Client(base_url=base, timeout=30) as http:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body).status_code))
                   for _ in range(2)]  # fmt: skip
        for t in threads:
            t.start()
        assert wait_for(lambda: worker.in_flight == 2)
        resp = http.post("/v1/completions", json=body)
        _assert_error(resp, 429, None, "busy")
        assert resp.json()["error"]["code"] == "queue_full" and resp.headers.get("retry-after") == "1"
        assert http.get("/health").json()["queued"] == 2  # in flight, none holding a slot yet
        runner.gate.set()
        for t in threads:
            t.join(30)
        assert results == [200, 200]
        assert http.post("/v1/completions", json=body).status_code == 200
        text = http.get("/metrics").text
        assert "moetier_requests_rejected_total 1" in text
        assert 'moetier_requests_total{route="/v1/completions",status="429"} 1' in text
    assert json.loads(httpx2.get(f"{base}/health").text)["status"] == "ok"


class BoomRunner(SlowRunner):
    """Fails its first step (as a broken forward pass would)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, max_batch=2)
        self.boom = True

    def step(self) -> list[StepEvent]:
        if self.boom:
            self.boom = False
            raise RuntimeError("forward pass exploded")
        return super().step()


def test_runner_failure_is_a_500_and_the_server_goes_on(engine: Engine, make_server: Callable[..., Any]) -> None:
    base, app = make_server(max_batch=2, runner=BoomRunner(engine))
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
    _assert_error(httpx2.post(f"{base}/v1/completions", json=body, timeout=30), 500, None, "exploded")
    assert app.state.worker.in_flight == 0
    assert httpx2.post(f"{base}/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 3
    assert httpx2.get(f"{base}/health").json()["status"] == "ok"


def test_huge_body_is_413(url: str) -> None:
    body = OK | {"prompt": "x" * (9 << 20)}
    _assert_error(httpx2.post(f"{url}/v1/completions", json=body, timeout=30), 413, None, "exceeds")


def test_tokenizer_chat_template_is_used(engine: Engine) -> None:
    import copy

    from moetier.serve.prompts import chat_text
    from moetier.serve.schemas import ChatMessage

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    msgs = [
        ChatMessage.model_validate(m)
        for m in (
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        )
    ]
    assert chat_text(tok, msgs) == "<system>Be brief.\n<user>Hi\n<assistant>"
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(APIError) as err:
        chat_text(tok, msgs)
    assert err.value.status == 400 and err.value.param == "messages" and "alternate" in err.value.message
