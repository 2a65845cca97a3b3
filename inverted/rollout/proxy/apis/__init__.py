"""The APIs agents speak to the proxy, each a small module beside its siblings.

An API is five things (``Api``): its route under ``/v1`` (Gemini's: ``/v1beta``, the model in its path);
``parse(body, session)``, which checks a request and normalises it to a ``call.CallRequest``;
``answer(req, answer)``, the whole response; ``events(req, stream)``, its streamed events as ``(event
name or None, data)``; and its error body, whole and mid-stream. The recorder knows none of them: it
records a ``CallRequest`` and answers with ``call.Answer`` and its events. A fourth API is one more
module and one more line in ``APIS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from inverted.rollout.proxy.apis import (
    anthropic_messages,
    gemini,
    openai_chat,
    openai_completions,
    openai_responses,
    openai_shared,
)
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Event, Failure


@dataclass(frozen=True, slots=True)
class Api:
    name: str
    route: str  # under {base_url} = /sessions/{id}/v1, and under /v1 with the session's token
    parse: Callable[[Any, Any], CallRequest]
    answer: Callable[[CallRequest, Answer], dict[str, Any]]
    events: Callable[[CallRequest, AsyncIterator[Event]], AsyncGenerator[tuple[str | None, dict[str, Any]], None]]
    error_body: Callable[[Failure], dict[str, Any]]
    stream_error: Callable[[Failure, int], tuple[str | None, dict[str, Any]]]  # (failure, events sent)
    done: bytes = b""  # what ends a stream after its last event
    # ``POST {count_route}``, where the API has it (Anthropic's, Gemini's): a request to count, and its answer
    count: tuple[Callable[[Any], CallRequest], Callable[[int], dict[str, Any]]] | None = None
    count_route: str | None = None  # default: ``{route}/count_tokens``
    prefix: str = "/v1"


CHAT = Api(
    "chat",
    openai_chat.ROUTE,
    openai_chat.parse,
    openai_chat.answer,
    openai_chat.events,
    openai_shared.error_body,
    openai_shared.stream_error,
    openai_shared.DONE,
)
APIS = [
    CHAT,
    Api(
        "completions",
        openai_completions.ROUTE,
        openai_completions.parse,
        openai_completions.answer,
        openai_completions.events,
        openai_shared.error_body,
        openai_shared.stream_error,
        openai_shared.DONE,
    ),
    Api(
        "responses",
        openai_responses.ROUTE,
        openai_responses.parse,
        openai_responses.answer,
        openai_responses.events,
        openai_shared.error_body,
        openai_responses.stream_error,
    ),
    Api(
        "messages",
        anthropic_messages.ROUTE,
        anthropic_messages.parse,
        anthropic_messages.answer,
        anthropic_messages.events,
        anthropic_messages.error_body,
        anthropic_messages.stream_error,
        count=(anthropic_messages.parse_count, anthropic_messages.counted),
    ),
    Api(
        "gemini",
        gemini.ROUTE,
        gemini.parse,
        gemini.answer,
        gemini.events,
        gemini.error_body,
        gemini.stream_error,
        count=(gemini.parse_count, gemini.counted),
        count_route=gemini.COUNT_ROUTE,
        prefix="/v1beta",
    ),
    Api(
        "gemini-stream",
        gemini.STREAM_ROUTE,
        gemini.parse_stream,
        gemini.answer,
        gemini.events,
        gemini.error_body,
        gemini.stream_error,
        prefix="/v1beta",
    ),
]


def for_path(path: str) -> Api:
    """The API whose errors a path gets: its own for an API's routes, OpenAI's for everything else."""
    if "/v1beta/models/" in path:
        return next(api for api in APIS if api.name == "gemini")
    return next((api for api in APIS if path.removesuffix("/count_tokens").endswith("/v1" + api.route)), CHAT)
