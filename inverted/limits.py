"""What one request may cost a service, bounded before the service pays for it.

- ``BodyLimit``: ASGI middleware that refuses a body over the service's limit (413, in the app's
  own error shape: it is raised as an ``HTTPException`` where the app reads the body) as soon as the
  app starts to read it, from its ``Content-Length``, or for a chunked body as soon as the bytes
  received pass the limit: the service never reads or holds more than the limit of any request.
- ``parse_json``: strict JSON (``loads``: no lone surrogates, no nesting past 1024 levels, each a
  ``ValueError`` the services answer with 400, naming the field), a large body's parsed on a
  worker thread, so that requests beside it are served meanwhile (measured with a 20 MB body
  refused again and again: ``/health`` p50 33 -> 5 ms on the engine, p99 83 -> 45 ms on the proxy;
  ``bench/hostile_load.py``).
- ``max_token_chars``: the most characters one token of a tokenizer stands for. Every character of
  a prompt's text is in some token, so a text of more than ``tokens × max_token_chars`` characters
  cannot fit ``tokens``, whatever it says; services refuse it by its length instead of tokenizing
  it first (a 50 MB prompt took the engine two minutes and 9 GB to tokenize before it was refused).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import orjson
from starlette.exceptions import HTTPException


class BodyTooLarge(HTTPException):
    """413: FastAPI passes (Starlette's) ``HTTPException`` raised while it reads a body through unchanged."""

    def __init__(self, size: int, limit: int):
        super().__init__(
            413,
            f"The request body is larger than this service accepts: {size} bytes or more, "
            f"over the limit of {limit} bytes.",
        )


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (raised into the app when it reads the body)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = int(declared) if declared.isdigit() else 0

        async def counted_receive() -> dict:
            nonlocal received
            if received > self.max_bytes:  # the declared length, before a byte of the body is read
                raise BodyTooLarge(received, self.max_bytes)
            message = await receive()
            if message["type"] == "http.request" and not declared:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(received, self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)


OFF_LOOP_BYTES = 1 << 20  # below this, the thread hop costs more than the parse


def loads(raw: bytes) -> Any:
    """Strict JSON: ``ValueError`` for what is not, with the field named where a string is not text.

    orjson refuses what the services cannot use, where ``json.loads`` lets it through to fail later
    as a 500: a lone UTF-16 surrogate (``"\\ud800"``, which no tokenizer and no UTF-8 response can
    hold), nesting deeper than 1024 levels, ``NaN`` and numbers out of 64-bit range.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "surrogate" in str(exc) and (where := _unencodable_field(raw)):
            raise ValueError(f"{where} is not valid Unicode text (a lone UTF-16 surrogate)") from None
        raise


def _unencodable_field(raw: bytes) -> str | None:
    """The path of the first string (or key) of ``raw`` that UTF-8 cannot encode, found without recursion."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                if not _encodable(key):
                    return f"a key of {path or 'the body'}"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str) and not _encodable(value):
            return path or "the body"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def parse_json(raw: bytes) -> Any:
    """``loads(raw)`` (raising ``ValueError``), off the event loop for bodies over ``OFF_LOOP_BYTES``."""
    if len(raw) < OFF_LOOP_BYTES:
        return loads(raw)
    return await asyncio.to_thread(loads, raw)


def brief(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: an answer never echoes a
    large input back (a 2.5 MB ``logit_bias`` was)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def max_token_chars(tokenizer: Any) -> int:
    """The most characters any one token of ``tokenizer`` decodes to (its vocabulary's longest entry).

    A byte-level BPE vocabulary writes each byte as one character, and a text character is at
    least one byte; a SentencePiece vocabulary writes text as it is (``▁`` for a space). Either
    way an entry is at least as long as the text it stands for.
    """
    return max(len(token) for token in tokenizer.get_vocab())


def cannot_fit(chars: int, tokens: int, per_token: int) -> bool:
    """Whether ``chars`` characters of text are sure to need more than ``tokens`` tokens."""
    return chars > tokens * per_token
