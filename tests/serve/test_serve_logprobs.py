"""The evaluation tools against the server: logprobs, echo (max_tokens 0 too), n > 1, batched prompts.

The acceptance test: a loglikelihood request sent exactly as lm-evaluation-harness's `local-completions`
sends it (prompt as a batch of token id lists, echo, logprobs 1, max_tokens 1, temperature 0, seed),
parsed as it parses it, gives the per-token logprobs of Engine.logits on the same tokens (fp32 allclose).
The same runs through lm-evaluation-harness's own LocalCompletionsAPI when `lm_eval` is installed.
Response shapes are checked with the real `openai` client; the formatting module alone on synthetic
entries (bytes, the chosen token in top_logprobs, -inf, NaN)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import httpx2
import openai
import pytest
import torch

from moetier.config import SamplingConfig
from moetier.runtime.engine import Engine
from moetier.serve.errors import APIError
from moetier.serve.logprobs import (
    LOGPROB_FLOOR,
    TokenLogprob,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
)
from serve.conftest import MODEL, NAME

CONTEXTS = [("ROMEO:\nWhat light through yonder", " window breaks"),
            ("JULIET:\nO Romeo, Romeo", ", wherefore art thou")]  # fmt: skip


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def reference_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, from Engine.logits in fp32."""
    logits = engine.logits(torch.tensor([ids]))[0].float()  # [T, V]
    lps = torch.log_softmax(logits, dim=-1)  # [T, V]
    return [float(lps[t - 1, ids[t]]) for t in range(1, len(ids))]


def reference_greedy(engine: Engine, ids: list[int]) -> list[bool]:
    """Whether ids[t] is the argmax after ids[:t], t >= 1."""
    logits = engine.logits(torch.tensor([ids]))[0].float()  # [T, V]
    return [int(logits[t - 1].argmax()) == ids[t] for t in range(1, len(ids))]


# -- the formatting module alone -------------------------------------------------------
def test_token_bytes_concatenate_to_the_text(engine: Engine) -> None:
    names = TokenNames(engine.tokenizer)
    text = "Hello — wörld ✓ 漢字\nROMEO:"
    ids = engine.encode(text)
    assert b"".join(names.get(t)[1] for t in ids) == text.encode()
    partial = [names.name(t) for t in ids if names.name(t).startswith("bytes:")]
    assert partial and all(p.startswith("bytes:\\x") for p in partial)  # pieces of multi-byte characters
    assert TokenNames(None).get(7) == ("token_id:7", b"token_id:7")


def test_completion_and_chat_shapes_on_synthetic_entries(engine: Engine) -> None:
    names = TokenNames(engine.tokenizer)
    a, b, c = engine.encode("ROMEO")[:3]
    entries = [TokenLogprob(a, None), TokenLogprob(b, -1.5, ((c, -0.5), (b, -1.5))), TokenLogprob(c, -math.inf, ())]
    out = completion_logprobs(entries, names, offset=3)
    assert out["tokens"] == [names.name(a), names.name(b), names.name(c)]
    assert out["token_logprobs"] == [None, -1.5, LOGPROB_FLOOR]  # -inf is not JSON: OpenAI's floor
    assert out["top_logprobs"][0] is None
    assert out["top_logprobs"][1] == {names.name(c): -0.5, names.name(b): -1.5}
    assert out["top_logprobs"][2] == {names.name(c): LOGPROB_FLOOR}  # the chosen token is always there
    assert out["text_offset"] == [3, 3 + len(names.name(a)), 3 + len(names.name(a)) + len(names.name(b))]
    json.dumps(out, allow_nan=False)
    chat = chat_logprobs(entries, names, top_k=1)
    assert chat["refusal"] is None and len(chat["content"]) == 2  # the prompt entry (None) is not chat's
    first = chat["content"][0]
    assert first == {
        "token": names.name(b),
        "logprob": -1.5,
        "bytes": list(names.get(b)[1]),
        "top_logprobs": [{"token": names.name(c), "logprob": -0.5, "bytes": list(names.get(c)[1])}],
    }
    with pytest.raises(APIError) as err:
        completion_logprobs([TokenLogprob(a, math.nan)], names)
    assert err.value.status == 500 and "NaN" in err.value.message


# -- against a live server -----------------------------------------------------------------
def test_lm_eval_loglikelihood_request_matches_engine_logits(engine: Engine, make_server: Callable[..., Any]) -> None:
    """lm-evaluation-harness local-completions, reproduced: LocalCompletionsAPI._create_payload(generate=False)
    and its parse_logprobs (lm_eval/models/openai_completions.py, v0.4)."""
    pairs = [(engine.encode(ctx), engine.encode(ctx + cont)[len(engine.encode(ctx)) :]) for ctx, cont in CONTEXTS]
    inputs = [ctx + cont for ctx, cont in pairs]
    ctxlens = [len(ctx) for ctx, _ in pairs]
    url, _ = make_server()
    payload = {"model": NAME, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}  # fmt: skip
    resp = httpx2.post(f"{url}/v1/completions", json=payload, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, ids, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), inputs, ctxlens, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference_logprobs(engine, ids)
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1 : len(ids)]), torch.tensor(want), atol=1e-4)
        # lm-eval's parse: the continuation's sum, and greedy when each token is its position's best
        tokens_logprobs = lp["token_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, lp["top_logprobs"][ctxlen:-1],
                                                                     strict=True))  # fmt: skip
        assert math.isclose(sum(tokens_logprobs), sum(want[ctxlen - 1 :]), abs_tol=1e-3)
        assert is_greedy == all(reference_greedy(engine, ids)[ctxlen - 1 :])
        assert choice["text"].startswith(engine.tokenizer.decode(ids))  # echo: the prompt text first
    assert out["usage"]["prompt_tokens"] == sum(len(i) for i in inputs)
    assert out["usage"]["completion_tokens"] == 2


def test_echo_with_zero_max_tokens_scores_the_prompt_alone(engine: Engine, make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    prompt = "ROMEO:\nBut soft, what light"
    ids = engine.encode(prompt)
    out = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), torch.tensor(reference_logprobs(engine, ids)), atol=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the 2 best, and the prompt token when not
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    # streamed: one chunk with the prompt's text and logprobs, ended by "length"
    chunks = list(client(url).completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                                 stream=True))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    assert [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens or []] == lp.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    # echo without logprobs: the text only
    plain = client(url).completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True)
    assert plain.choices[0].text == engine.tokenizer.decode(ids) and plain.choices[0].logprobs is None


def test_completion_logprobs_follow_the_generated_tokens(engine: Engine, make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    c = client(url)
    prompt = "KING HENRY:"
    want = engine.generate(prompt, 12, SamplingConfig())
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(want.token_ids)
    ids = engine.encode(prompt) + want.token_ids
    ref = reference_logprobs(engine, ids)[len(engine.encode(prompt)) - 1 :]
    assert torch.allclose(torch.tensor(lp.token_logprobs), torch.tensor(ref), atol=1e-4)
    for tok, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and tok == max(top.values())  # greedy: the chosen token is the best
    # streamed: the same tokens and logprobs, spread over the chunks
    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                       stream=True))  # fmt: skip
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens or []] == lp.tokens
    assert [x for s in streamed for x in s.token_logprobs or []] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset or []] == lp.text_offset
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.choices[0].text


def test_chat_logprobs_shape(engine: Engine, make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    c = client(url)
    messages: Any = [{"role": "user", "content": "Who goes there?"}]
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                    top_logprobs=2)  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and out.usage is not None and len(content) == out.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and entry.bytes is not None
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
    text_bytes = b"".join(bytes(e.bytes or []) for e in content)
    assert text_bytes.decode("utf-8", "replace").startswith(out.choices[0].message.content or "")
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True))  # fmt: skip
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    # logprobs: true alone gives the chosen tokens with no alternatives
    bare = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content or [])  # type: ignore[union-attr]
    plain = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_samples_are_seeded_per_index(engine: Engine, make_server: Callable[..., Any]) -> None:
    url, _ = make_server()
    c = client(url)
    kw: dict[str, Any] = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 12, "temperature": 1.0}
    out = c.completions.create(n=3, seed=40, **kw)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    singles = [c.completions.create(seed=40 + i, **kw).choices[0].text for i in range(3)]
    assert [ch.text for ch in out.choices] == singles  # sample i uses seed + i
    assert len(set(singles)) > 1
    assert out.usage is not None and out.usage.prompt_tokens == len(engine.encode("ROMEO:"))  # the prompt counts once
    assert out.usage.completion_tokens == 3 * 12 or out.usage.completion_tokens < 3 * 12
    # streamed: chunks of every index, each choice's text as above
    chunks = list(c.completions.create(n=3, seed=40, stream=True, **kw))
    texts = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in range(3)}  # fmt: skip
    assert [texts[i] for i in range(3)] == singles
    ends = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason is not None]
    assert sorted(e.index for e in ends) == [0, 1, 2]
    # chat: n choices, streamed with a role chunk per index
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, n=2, seed=5, temperature=1.0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    stream = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, n=2, seed=5, temperature=1.0,
                                            stream=True))  # fmt: skip
    roles = [ch.choices[0].index for ch in stream if ch.choices and ch.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for i in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices and ch.choices[0].index == i)
        assert text == chat.choices[i].message.content


def test_a_list_of_prompts_gives_a_choice_per_prompt_and_sample(engine: Engine,
                                                                make_server: Callable[..., Any]) -> None:  # fmt: skip
    url, _ = make_server()
    prompts = ["ROMEO:", "JULIET:", "HAMLET:"]
    out = client(url).completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [ch.index for ch in out.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        want = engine.generate(prompt, 8, SamplingConfig()).text
        assert out.choices[2 * p].text == out.choices[2 * p + 1].text == want  # choice index = prompt * n + sample
    assert out.usage is not None and out.usage.prompt_tokens == sum(len(engine.encode(p)) for p in prompts)


def test_lm_eval_harness_itself(engine: Engine, make_server: Callable[..., Any]) -> None:
    """lm-evaluation-harness's LocalCompletionsAPI (batched token prompts) against the server, when installed."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, _ = make_server()
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=NAME, tokenizer=str(MODEL),
                             tokenizer_backend="huggingface", batch_size=2, max_length=1024, max_retries=1)  # fmt: skip
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(CONTEXTS)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (ctx, cont), (logprob, is_greedy) in zip(CONTEXTS, got, strict=True):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        ids = ctx_ids + cont_ids
        want = reference_logprobs(engine, ids)[len(ctx_ids) - 1 :]
        assert math.isclose(logprob, sum(want), abs_tol=1e-3)
        assert is_greedy == all(reference_greedy(engine, ids)[len(ctx_ids) - 1 :])
    gen = lm.generate_until([Instance("generate_until", {}, ("ROMEO:", {"until": ["\n\n"], "max_gen_toks": 8}), 0)],
                            disable_tqdm=True)  # fmt: skip
    want_text = engine.generate("ROMEO:", 8, SamplingConfig()).text.split("\n\n")[0]
    assert gen == [want_text]
