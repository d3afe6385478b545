"""The API key: `Authorization: Bearer <key>` on every route but /health, when the server has a key.

Invariants: the key is compared in constant time (hmac.compare_digest over the header's bytes, so
the time taken does not tell how much of a guess was right); a missing or wrong key is a 401 in
OpenAI's shape (code "invalid_api_key", `WWW-Authenticate: Bearer`) that never echoes what was sent;
/health stays open so load balancers and orchestrators can probe without the key. With no key
configured every request passes (the default, as before).
"""

from __future__ import annotations

import hmac

from moetier.serve.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # answered without the key


def key_error(authorization: str | None, key: str) -> APIError | None:
    """None when `authorization` (the header's value) carries `key` as a bearer token, else the 401 to answer."""
    if authorization is None:
        return _unauthorized("no API key was sent; send it as the header 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.strip().partition(" ")
    # latin-1 gives back the header's own bytes (ASGI headers are bytes; Starlette decodes them as latin-1)
    given = token.strip().encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode("utf-8")):
        return _unauthorized("the API key is not valid")
    return None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


__all__ = ["OPEN_PATHS", "key_error"]
