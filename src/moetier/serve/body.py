"""Reading and decoding a request body: a streamed size limit, a read deadline, JSON checks.

`read_body(request, limit, timeout_s)`:
- a `Content-Length` over `limit` is refused at once with 413, before a byte of the body is read
  (a client that sent `Expect: 100-continue` never sends it); a malformed one is a 400;
- otherwise the body is read chunk by chunk as it arrives, counting bytes: the moment the count
  passes `limit` the answer is 413 (with `Connection: close`, so the rest is never read), so a
  1 GiB body never sits in memory, declared length or not (chunked transfer, a lying length);
- the whole body must arrive within `timeout_s` of the handler starting to read it; a client that
  stalls mid-body gets 408 (with `Connection: close`) when the deadline passes;
- a client that disconnects mid-body raises `BodyGone` (nobody is left to answer).

`decode_json(raw)` -> the body as a JSON object, or APIError(400): not UTF-8, not JSON, nested
deeper than MAX_JSON_DEPTH (Python's own parser gives up past about 1000 levels with RecursionError,
caught too), not an object, or a string (value or key) holding a lone UTF-16 surrogate such as
"\\ud800" (valid JSON escapes, but not text: a tokenizer cannot take them), named by its field path.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from moetier.serve.errors import APIError

MAX_JSON_DEPTH = 64  # containers inside containers; requests need 4 (messages -> message -> content -> part)
_SURROGATE = re.compile("[\ud800-\udfff]")
_CLOSE = {"Connection": "close"}


class BodyGone(Exception):
    """The client disconnected before its body was complete."""


def _too_large(size: str, limit: int, headers: dict[str, str] | None = None) -> APIError:
    return APIError(413, f"the request body of {size} bytes exceeds the limit of {limit} bytes (--max-body)", None,
                    "request_too_large", headers)  # fmt: skip


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, at most `limit` bytes, read within `timeout_s` seconds (see the module docstring)."""
    # 1. a declared length: refuse at once when over the limit
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, f"the Content-Length header {declared!r} is not a byte count", None, None, _CLOSE)
        if int(declared) > limit:
            raise _too_large(declared.strip(), limit)
    # 2. stream it in, counting, against one deadline
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise _too_large(f"more than {limit}", limit, _CLOSE)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g} s ({total} bytes received; --read-timeout)",
            None, "request_timeout", _CLOSE,
        ) from None  # fmt: skip
    except ClientDisconnect:
        raise BodyGone from None
    return b"".join(chunks)


def _path(parts: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in parts)


def check_json(data: Any) -> None:
    """APIError(400) when `data` nests deeper than MAX_JSON_DEPTH or holds a lone surrogate (naming the field)."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(data, (), 0)]
    while stack:  # iterative: the depth of the input never becomes the depth of our stack
        node, path, depth = stack.pop()
        if isinstance(node, str):
            bad = _SURROGATE.search(node)
            if bad is not None:
                where = _path(path)
                raise APIError(
                    400, f"invalid value for {where!r}: the string holds a lone UTF-16 surrogate "
                    f"(\\u{ord(bad.group()):04x}) at character {bad.start()}, which is not valid Unicode",
                    where or None, "invalid_string",
                )  # fmt: skip
        elif isinstance(node, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels (at "
                                    f"{_path(path)!r})", _path(path) or None, "invalid_json")  # fmt: skip
            if isinstance(node, dict):
                for key, value in node.items():
                    if _SURROGATE.search(key):
                        where = _path((*path, key.encode("utf-8", "backslashreplace").decode()))
                        raise APIError(400, f"the field name {where!r} holds a lone UTF-16 surrogate", where,
                                       "invalid_string")  # fmt: skip
                    stack.append((value, (*path, key), depth + 1))
            else:
                stack.extend((value, (*path, i), depth + 1) for i, value in enumerate(node))


def decode_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; APIError(400) otherwise (see the module docstring)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", None,
                       "invalid_json") from None  # fmt: skip
    check_json(data)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


__all__ = ["MAX_JSON_DEPTH", "BodyGone", "check_json", "decode_json", "read_body"]
