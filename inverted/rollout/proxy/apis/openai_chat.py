"""OpenAI Chat Completions: ``POST {base_url}/chat/completions``.

Implemented: ``messages``, ``tools``, ``tool_choice`` (``required`` and named are served by writing
the call's opening, see ``Recorder._forced``), ``response_format`` (by constrained decoding),
``n``, ``stream`` and ``stream_options.include_usage``, ``logprobs`` and ``top_logprobs``, and the
sampling fields ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``,
``seed``, with SGLang's extras ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``.
Penalties are neutral-only: SGLang implements them, but sgl-router 0.3.2 keeps them and the
embedded engine does not. A thinking switch in any vendor's spelling (``reasoning_effort``,
Moonshot's, DeepSeek's and GLM's ``thinking``, DashScope's ``enable_thinking``, vLLM's and
SGLang's ``chat_template_kwargs``, OpenRouter's ``reasoning``) sets the template's
(``call.thinking_switch``).
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, AsyncIterator

from inverted.errors import InvalidRequest
from inverted.rollout.chat import parse_messages
from inverted.rollout.proxy import hosted
from inverted.rollout.proxy.apis import call, openai_shared
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Delta, Event, Output

ROUTE = "/chat/completions"
FIELDS = {
    "messages",
    "tools",
    "tool_choice",
    "stream",
    "stream_options",
    "logprobs",
    "stop",
    "response_format",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    *call.THINKING_SWITCHES,
} | set(call.NUMERIC) - {"max_output_tokens"}
REASONS = openai_shared.REASONS | {
    "store": "stored completions are the hosted service's (for its evals and distillation); this server records "
    "every call of the session itself",
    "thinking_budget": "a thinking budget is not enforced: max_tokens bounds the whole reply, thinking included",
}
VERBOSITY = ("low", "medium", "high")
VERBOSITY_REASON = (
    "a length hint that hosted models follow through their own system prompt; this policy samples "
    "from the prompt as sent, and max_tokens bounds the reply"
)
NEUTRAL: dict[str, tuple] = {
    "logit_bias": ({}, None),
    "prediction": (None,),
    "modalities": (["text"], None),
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
}


def parse(body: Any, session: Any = None) -> CallRequest:
    body = openai_shared.check_fields(body, FIELDS, NEUTRAL, REASONS)
    if body.get("logprobs") not in (None, True, False):
        raise InvalidRequest("Invalid type for 'logprobs': expected a boolean", param="logprobs", code="invalid_type")
    if "messages" not in body:
        raise InvalidRequest(
            "Missing required parameter: 'messages'.", param="messages", code="missing_required_parameter"
        )
    if body.get("top_logprobs") and not body.get("logprobs"):
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    for name in ("n", "max_tokens", "max_completion_tokens", "top_logprobs"):
        if body.get(name) is not None:
            call.number(name, body[name])
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise InvalidRequest("'tools' must be an array of {type: 'function', function: {name, ...}}", param="tools")
    tools = [
        call.function_tool(
            t["function"]["name"],
            t["function"].get("description"),
            t["function"].get("parameters"),
            f"tools[{i}].function",
            t["function"].get("strict"),
        )
        for i, t in enumerate(tools or [])
    ]
    choice = body.get("tool_choice")
    search = body.get("web_search_options")
    if search is not None and not isinstance(search, dict):
        raise InvalidRequest("'web_search_options' must be an object", param="web_search_options", code="invalid_type")
    asks = [] if search is None else [hosted.Ask("web_search", "web_search_options", len(tools))]
    req = CallRequest(
        kind="chat",
        model=openai_shared.model_name(body),
        messages=parse_messages(body["messages"], session and session.parsed),
        prompt=None,
        tools=tools or None,
        parse_tools=bool(tools or asks) and choice != "none",
        stream=bool(body.get("stream")),
        max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
        max_tokens_field="max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens",
        sampling=call.sampling(body),
        n=body.get("n") or 1,
        logprobs=bool(body.get("logprobs")),
        top_logprobs=body.get("top_logprobs") or 0,
        include_usage=openai_shared.include_usage(body),
        force_call=call.forced_call(*_tool_choice(choice), tools),
        hosted=asks,
    )
    for key in search or {}:
        req.accepted[f"web_search_options.{key}"] = (
            "an option of the hosted web search, which the configured implementation is not given"
        )
    call.constrain(req, _response_schema(body.get("response_format")), "response_format")
    call.accept(req.accepted, body, REASONS)
    call.thinking_switch(req, body)
    if body.get("verbosity") is not None:
        if body["verbosity"] not in VERBOSITY:
            raise InvalidRequest(
                f"Invalid value for 'verbosity': {body['verbosity']!r}; expected one of {list(VERBOSITY)}",
                param="verbosity",
                code="invalid_value",
            )
        req.accepted["verbosity"] = VERBOSITY_REASON
    return req


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        return "named", choice["function"]["name"]
    raise InvalidRequest(
        f"Invalid value for 'tool_choice': {choice!r}; expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
        code="invalid_value",
    )


def _response_schema(value: Any) -> dict[str, Any] | None:
    """``response_format`` as a JSON schema, as SGLang's own OpenAI server maps it: ``json_object`` is any object."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        return spec.get("schema", {})
    raise InvalidRequest(
        f"Invalid 'response_format': {str(value)[:200]}; expected {{'type': 'text'}}, "
        "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', 'schema'}}",
        param="response_format",
        code="invalid_value",
    )


# ---- answers --------------------------------------------------------------------------------


def answer(req: CallRequest, answer: Answer) -> dict[str, Any]:
    choices = [
        {"index": o.index, "message": message(o), "logprobs": logprobs(o), "finish_reason": o.finish}
        for o in answer.outputs
    ]
    return envelope(answer, "chat.completion", choices, openai_shared.usage(answer))


def message(output: Output) -> dict[str, Any]:
    """The reply, a thinking model's reasoning apart (``reasoning_content``, as DeepSeek's, vLLM's and
    SGLang's servers return it); after hosted rounds (``web_search_options``), every round's text, as
    it was streamed."""
    content = output.reply.content
    if output.rounds:
        content = "".join(r.reply.content or "" for r in output.rounds) + (content or "")
    reasoning, answer_text = call.reasoning_of(content)
    body: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning is not None:
        body |= {"content": answer_text or (None if output.reply.tool_calls else ""), "reasoning_content": reasoning}
    if output.reply.tool_calls:
        body["tool_calls"] = [c.to_openai() for c in output.reply.tool_calls]
    return body


def logprobs(output: Output) -> dict[str, Any] | None:
    """Each sampled token's logprob and, with ``top_logprobs``, the most likely tokens at its position."""
    if output.logprobs is None:
        return None
    return {"content": openai_shared.token_logprobs(output.logprobs), "refusal": None}


def envelope(
    answer: Answer,
    obj: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    *,
    prefix: str = "chatcmpl-",
    chunk: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": prefix + answer.id,
        "object": obj,
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


async def events(req: CallRequest, stream: AsyncIterator[Event]) -> AsyncGenerator[tuple[str | None, dict], None]:
    """Chunks: each choice's role, its content as it grows, its tool calls in one delta, its finish; then usage."""
    opened = await call.opened(stream)
    for index in range(req.n):
        yield None, _chunk(opened, index, {"role": "assistant", "content": ""})
    splits = [call.ReasoningStream() for _ in range(req.n)]
    async for event in stream:
        if isinstance(event, Delta):
            for reasoning, text in splits[event.index].feed(event.text):
                yield None, _chunk(opened, event.index, {"reasoning_content" if reasoning else "content": text})
        elif isinstance(event, Output):
            if event.reply.tool_calls:
                calls = [{"index": i, **c.to_openai()} for i, c in enumerate(event.reply.tool_calls)]
                yield None, _chunk(opened, event.index, {"tool_calls": calls})
            last = _chunk(opened, event.index, {}, finish=event.finish)
            last["choices"][0]["logprobs"] = logprobs(event)
            yield None, last
    if req.include_usage:
        yield None, envelope(opened, "chat.completion.chunk", [], openai_shared.usage(opened), chunk=True)


def _chunk(answer: Answer, index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return envelope(answer, "chat.completion.chunk", [choice], None, chunk=True)
