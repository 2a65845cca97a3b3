"""OpenAI's legacy Completions: ``POST {base_url}/completions`` with a text ``prompt``.

A later call whose prompt extends an earlier call's prompt and completion continues its branch,
as chat turns do. ``logprobs`` is this API's integer (0 to 5): the sampled tokens' logprobs and, at
each position, that many most likely tokens, with ``text_offset``.
"""

from __future__ import annotations

import itertools
from typing import Any, AsyncGenerator, AsyncIterator

from inverted.errors import InvalidRequest
from inverted.rollout.proxy.apis import call, openai_shared
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Delta, Event, Output
from inverted.rollout.proxy.apis.openai_chat import envelope

ROUTE = "/completions"
FIELDS = {
    "prompt",
    "stream",
    "stream_options",
    "logprobs",
    "stop",
    "temperature",
    "top_p",
    "n",
    "seed",
    "max_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
}
NEUTRAL: dict[str, tuple] = {
    "logit_bias": ({}, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "suffix": (None,),
    "echo": (False, None),
    "best_of": (1, None),
}


def parse(body: Any, session: Any = None) -> CallRequest:
    body = openai_shared.check_fields(body, FIELDS, NEUTRAL)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest(
            "'prompt' must be a non-empty string (token and batch prompts are not supported per session)",
            param="prompt",
        )
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5):
        raise InvalidRequest(
            f"Invalid 'logprobs': {top!r} must be an integer between 0 and 5 (the legacy "
            "completions API counts the most likely tokens to list)",
            param="logprobs",
            code="invalid_value",
        )
    for name in ("n", "max_tokens"):
        if body.get(name) is not None:
            call.number(name, body[name])
    req = CallRequest(
        kind="text",
        model=openai_shared.model_name(body),
        messages=None,
        prompt=prompt,
        tools=None,
        parse_tools=False,
        stream=bool(body.get("stream")),
        max_tokens=body.get("max_tokens"),
        sampling=call.sampling(body),
        n=body.get("n") or 1,
        logprobs=top is not None,
        top_logprobs=top or 0,
        include_usage=openai_shared.include_usage(body),
    )
    call.accept(req.accepted, body, openai_shared.REASONS)
    return req


def answer(req: CallRequest, answer: Answer) -> dict[str, Any]:
    choices = [
        {"index": o.index, "text": o.text, "logprobs": logprobs(req, o), "finish_reason": o.finish}
        for o in answer.outputs
    ]
    usage = openai_shared.usage(answer)
    return envelope(answer, "text_completion", choices, usage, prefix="cmpl-")


def logprobs(req: CallRequest, output: Output) -> dict[str, Any] | None:
    if output.logprobs is None:
        return None
    tokens = [t.token for t in output.logprobs]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=len(req.prompt or "")))
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in output.logprobs],
        "top_logprobs": [dict(t.top) for t in output.logprobs] if req.top_logprobs else None,
        "text_offset": offsets,
    }


async def events(req: CallRequest, stream: AsyncIterator[Event]) -> AsyncGenerator[tuple[str | None, dict], None]:
    opened = await call.opened(stream)
    async for event in stream:
        if isinstance(event, Delta):
            yield None, _chunk(opened, event.index, event.text)
        elif isinstance(event, Output):
            yield None, _chunk(opened, event.index, "", finish=event.finish, logprobs=logprobs(req, event))
    if req.include_usage:
        yield None, envelope(opened, "text_completion", [], openai_shared.usage(opened), prefix="cmpl-", chunk=True)


def _chunk(
    answer: Answer, index: int, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return envelope(answer, "text_completion", [choice], None, prefix="cmpl-", chunk=True)
