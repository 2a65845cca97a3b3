"""API keys on every service: what a caller presented, and one rule for checking it.

The engine, the proxy and the buffer all read keys here, so they agree on the rule:

- the key comes as ``Authorization: Bearer <key>``, the scheme in any case, the key stripped of
  surrounding whitespace (or, for Anthropic's SDK, as ``x-api-key: <key>``, stripped alike);
- keys are compared with ``hmac.compare_digest``, whose time does not depend on how much of a
  guess is right, so a caller cannot find a key a byte at a time by timing refusals;
- a service without a key configured lets every caller in (127.0.0.1 is the default bind).

``require_key`` makes the FastAPI dependency a route declares; each service's exception handler
renders ``Unauthorized`` in its API's error shape. ``NO_DOCS``: no service serves FastAPI's
``/docs``, ``/redoc`` or ``/openapi.json``, which would map every route for whoever asks, key or not.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from inverted.errors import Unauthorized

NO_DOCS: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None}


def presented_key(request: Request, google: bool = False) -> str | None:
    """The key the caller sent: a bearer token, else ``x-api-key`` (Anthropic's); with ``google`` (the
    proxy, which serves the Gemini API), else Google's ``x-goog-api-key`` or ``?key=``; ``None`` if none."""
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    api_key = request.headers.get("x-api-key")
    if api_key is None and google:
        api_key = request.headers.get("x-goog-api-key") or request.query_params.get("key")
    return api_key.strip() if api_key is not None else None


def key_matches(given: str | None, key: str | None) -> bool:
    """Whether ``given`` is ``key``, in constant time; never true when either is missing."""
    if not given or not key:
        return False
    return hmac.compare_digest(given.encode(), key.encode())


def require_key(expected: Callable[[Request], str | None], message: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency that lets a request through only with the key ``expected(request)`` names (if any)."""

    # ``async def``: FastAPI runs a plain ``def`` dependency on a worker thread, a thread hop per request.
    async def dependency(request: Request) -> None:
        key = expected(request)
        if key and not key_matches(presented_key(request), key):
            raise Unauthorized(message)

    return dependency
