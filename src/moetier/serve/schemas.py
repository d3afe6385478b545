"""Request bodies of the OpenAI-compatible routes, and the checks pydantic cannot express.

Policy (issue 7): a parameter either works as OpenAI documents it, is harmless and accepted
(`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, `stream_options`), or is
rejected with 400 naming it. Unknown fields are rejected too (extra="forbid"): a client's
`extra_body` such as `top_k` or `repetition_penalty` would change the output, and silently ignoring
it is worse than an error. Types are strict (no "16" for 16, no 1.5 for an int); floats accept ints.
Supported and output-changing: `max_tokens` (`max_completion_tokens` for chat, which wins),
`temperature` (0-2), `top_p` (0-1], `seed`, `stop` (a string or up to 4), `stream`, `n` (1 to
MAX_N samples of each prompt), and for the evaluation tools: completions `logprobs` (0 to 20 top
tokens; OpenAI allows 5) and `echo` (the prompt and, with logprobs, its tokens' logprobs first;
`max_tokens: 0` with echo scores the prompt alone), chat `logprobs: true` with `top_logprobs` (0-20;
it needs logprobs), and a completions `prompt` as a string, a list of strings, token ids or a list of
token id lists (one choice per prompt and sample).
Rejected unless neutral: best_of other than 1, suffix, non-zero presence/frequency penalties, a
non-empty logit_bias, tools/functions, response_format other than text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moetier.serve.errors import APIError
from moetier.serve.logprobs import MAX_LOGPROBS

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128  # OpenAI's limit on n


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # harmless bookkeeping fields some clients send
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


def _reject(param: str, why: str) -> APIError:
    return APIError(400, f"unsupported parameter {param!r}: {why}", param, "unsupported_parameter")


def check_supported(req: CompletionRequest | ChatRequest) -> None:
    """APIError(400) naming the first parameter the server cannot honour exactly."""
    # 1. parameters of both routes
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise APIError(400, f"'n' must be between 1 and {MAX_N}, got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise _reject(name, f"only 0 is supported, got {value}")
    if req.logit_bias:
        raise _reject("logit_bias", "token biases are not supported")
    stops = stop_list(req.stop)
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' sequences must not be empty strings", "stop")
    # 2. per route
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise _reject("best_of", f"only best_of=1 is supported, got {req.best_of}")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
        if req.suffix is not None:
            raise _reject("suffix", "insertion (suffix) is not supported")
        return
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                           "top_logprobs")  # fmt: skip
        if not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if req.tools or req.functions:
        raise _reject("tools" if req.tools else "functions", "tool calling is not supported")
    if req.tool_choice not in (None, "none"):
        raise _reject("tool_choice", "tool calling is not supported")
    if req.function_call not in (None, "none"):
        raise _reject("function_call", "function calling is not supported")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise _reject("response_format", "only {'type': 'text'} is supported")


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def logprobs_k(req: CompletionRequest | ChatRequest) -> int | None:
    """The runner's `logprobs` for a checked request: None (none asked), else how many top tokens."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


__all__ = ["MAX_N", "MAX_STOP", "ChatMessage", "ChatRequest", "CompletionRequest", "StreamOptions", "check_supported",
           "logprobs_k", "stop_list"]  # fmt: skip
