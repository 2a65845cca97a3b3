"""The Anthropic Messages API: ``POST {base}/v1/messages``, what Claude-Code-style harnesses speak.

The ``anthropic`` SDK works with ``base_url={proxy}/sessions/{id}`` (the path's id is the
capability), or with ``base_url={proxy}`` and the session's token as its API key (``x-api-key``).

``system`` (a string or text blocks) is the system message; ``messages`` hold ``text``,
``tool_use`` and ``tool_result`` blocks: a user message's tool results become tool messages, in
order, and an assistant message's text and tool uses one assistant turn, as the reply that made
them was. Implemented: ``tools`` (``input_schema`` is the function's parameters), ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``), ``max_tokens`` (required, as Anthropic requires it),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``output_config.format`` (by
constrained decoding), and ``stream`` with Anthropic's events (``message_start``,
``content_block_start``/``delta``/``stop``, ``message_delta``, ``message_stop``). Errors have
Anthropic's body ``{"type": "error", "error": {"type", "message"}}``.

What Claude Code sends besides: ``role: system`` messages among the others (rendered where they
stand), ``thinking`` (a template's thinking switch, ``Recorder._thinking``), tools with
``defer_loading`` (left out of the prompt until a tool search would load them), a ``max_tokens``
past the context (cut to what is left, as in every API), and ``POST /v1/messages/count_tokens`` (``parse_count``).
The fields in ``REASONS`` and ``BLOCK_REASONS`` are accepted without effect, each with its reason
on the turn.
"""

from __future__ import annotations

import json
from typing import Any, AsyncGenerator, AsyncIterator

from inverted.errors import InvalidRequest
from inverted.rollout.chat import Message, ToolCall
from inverted.rollout.proxy import hosted
from inverted.rollout.proxy.apis import call
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Delta, Event, Failure, Hosted, Output

ROUTE = "/messages"
FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "output_config",
    "thinking",
}
# Accepted without effect, each with why (recorded on the turn, metadata.turns[].accepted).
REASONS = {
    "metadata": "the caller's own tags (a user id) for the hosted service; nothing is sampled from them",
    "service_tier": "a hosted service's capacity tier; these servers have one",
    "inference_geo": "where a hosted service runs the model; these servers run here",
    "speed": "a hosted service's serving speed; what is sampled is the same",
    "diagnostics": "the hosted service's own diagnostics; nothing is sampled from them",
    "cache_control": "prefix caching here is automatic (the servers' radix cache), with or without breakpoints",
    "context_management": "the hosted service's edits of a long conversation (clearing old tool results or "
    "thinking); here the conversation is rendered as sent, and one past the context is refused",
}
BLOCK_REASONS = {  # fields of a block or a tool
    "cache_control": REASONS["cache_control"],
    "defer_loading": "a deferred tool is left out of the prompt, as the hosted API leaves it until a tool search "
    "loads it",
}
THINKING_REASONS = {
    "budget_tokens": "a thinking budget is not enforced: max_tokens bounds the whole reply, thinking included",
    "display": "thinking is not sent back apart from the text: a template's thinking, if any, is in the reply",
}
EFFORT_REASON = (
    "effort tunes how many tokens a hosted model spends; this policy samples from the prompt as sent, "
    "and max_tokens bounds the reply"
)
NEUTRAL: dict[str, tuple] = {"container": (None,)}
BOUNDS = {
    "temperature": (float, 0.0, 1.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, 1, None),
    "max_tokens": (int, 1, None),
}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
# server tools (Anthropic runs them), by their type's prefix, and the hosted kind that serves them
SERVER_TOOLS = {"web_search_": "web_search", "web_fetch_": "web_fetch", "code_execution_": "code_interpreter"}
RESULT_BLOCKS = {
    "web_search": "web_search_tool_result",
    "web_fetch": "web_fetch_tool_result",
    "code_interpreter": "code_execution_tool_result",
}
SERVER_TOOL_OPTION_REASON = "an option of a server tool, which the configured implementation is not given"


def parse(body: Any, session: Any = None) -> CallRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_body")
    for key, value in body.items():
        if key in NEUTRAL and value not in NEUTRAL[key]:
            raise InvalidRequest(
                f"{key}: {value!r} is not supported by this server: it would change what is "
                f"sampled (accepted: {list(NEUTRAL[key])})",
                param=key,
            )
        if key not in FIELDS | set(REASONS) | set(NEUTRAL):
            raise InvalidRequest(f"{key}: Extra inputs are not permitted", param=key)
    for name in ("max_tokens", "messages"):
        if name not in body:
            raise InvalidRequest(f"{name}: Field required", param=name)
    if body.get("stream") not in (None, True, False):
        raise InvalidRequest("stream: Input should be a valid boolean", param="stream")
    for name, bounds in BOUNDS.items():
        if body.get(name) is not None:
            call.number(name, body[name], bounds)
    declared = _list(body.get("tools"), "tools")
    tools: list[dict[str, Any]] = []
    asks: list[hosted.Ask] = []
    for i, t in enumerate(declared):
        kind = _server_tool(t)
        if kind is not None:
            asks.append(hosted.Ask(kind, f"tools.{i}", len(tools), t.get("name"), t.get("max_uses")))
        elif not (isinstance(t, dict) and t.get("defer_loading")):
            tools.append(_tool(t, f"tools.{i}"))
    accepted: dict[str, str] = {}
    messages = _system(body.get("system")) + _messages(body["messages"], session, accepted)
    mode, named = _tool_choice(body.get("tool_choice"))
    sampling = call.sampling({name: body.get(name) for name in ("temperature", "top_p", "top_k")})
    found = call.stops(body.get("stop_sequences"), "stop_sequences", most=16)
    if found:
        sampling["stop"] = found
    req = CallRequest(
        kind="chat",
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        messages=messages,
        prompt=None,
        tools=tools or None,
        parse_tools=bool(tools) and mode != "none",
        stream=bool(body.get("stream")),
        max_tokens=body["max_tokens"],
        sampling=sampling,
        force_call=call.forced_call(mode, named, tools),
        hosted=asks,
        accepted=accepted,
        hosted_limit=min((a.limit for a in asks if isinstance(a.limit, int)), default=None),
    )
    req.parse_tools = bool(tools or asks) and mode != "none"
    for ask in asks:
        for key in set(declared[int(ask.where.split(".")[1])]) - {"type", "name", "max_uses"}:
            req.accepted[f"{ask.where}.{key}"] = SERVER_TOOL_OPTION_REASON
    call.constrain(req, _output_schema(body.get("output_config")), "output_config.format")
    _accept(req, body, declared)
    return req


def parse_count(body: Any) -> CallRequest:
    """A ``/v1/messages/count_tokens`` body (a Messages request without ``max_tokens``), checked as one."""
    if isinstance(body, dict) and "max_tokens" in body:
        raise InvalidRequest("max_tokens: Extra inputs are not permitted", param="max_tokens")
    return parse({**body, "max_tokens": 1} if isinstance(body, dict) else body)


def counted(tokens: int) -> dict[str, Any]:
    return {"input_tokens": tokens}


def _accept(req: CallRequest, body: dict[str, Any], tools: list) -> None:
    """The fields taken without effect, with why; ``thinking`` as a thinking mode."""
    call.accept(req.accepted, body, REASONS)
    blocks = (
        [
            b
            for m in body["messages"]
            if isinstance(m, dict) and isinstance(m.get("content"), list)
            for b in m["content"]
        ]
        + (body["system"] if isinstance(body.get("system"), list) else [])
        + tools
    )
    for key, reason in BLOCK_REASONS.items():
        if any(isinstance(b, dict) and b.get(key) for b in blocks):
            req.accepted[key] = reason
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise InvalidRequest(
                "thinking: expected {type: 'enabled', budget_tokens}, {type: 'adaptive'} or {type: 'disabled'}",
                param="thinking",
            )
        req.thinking = (("thinking",), kind != "disabled")
        call.accept(req.accepted, thinking, THINKING_REASONS, "thinking.")
    if isinstance(body.get("output_config"), dict) and body["output_config"].get("effort") is not None:
        req.accepted["output_config.effort"] = EFFORT_REASON


def _list(value: Any, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{name}: Input should be a valid list", param=name)
    return value


def _system(system: Any) -> list[Message]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(_texts(system, "system"))
    return [Message(role="system", content=text)] if text else []


def _texts(blocks: Any, where: str) -> list[str]:
    if isinstance(blocks, str):
        return [blocks]
    texts = []
    for j, block in enumerate(_list(blocks, where)):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequest(
                f"{where}.{j}: blocks of type {kind!r} are not supported here: this model reads text blocks only",
                param=f"{where}.{j}.type",
            )
        texts.append(block["text"])
    return texts


def _server_tool(tool: Any) -> str | None:
    """The hosted kind of a server tool declaration (``web_search_20250305``, ...), else None."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return next((k for prefix, k in SERVER_TOOLS.items() if isinstance(kind, str) and kind.startswith(prefix)), None)


def _messages(raw: Any, session: Any, accepted: dict[str, str]) -> list[Message]:
    """Anthropic messages as chat messages (see the module docstring). An assistant message's
    ``server_tool_use`` blocks and their results are the calls of the reply they stand in, as the
    proxy ran them, followed by their results (``hosted.Regrouper``)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    built = hosted.Regrouper(session)
    messages = built.messages
    called: set[str] = set()
    for i, item in enumerate(raw):
        where = f"messages.{i}"
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ("user", "assistant", "system"):  # system: a mid-conversation instruction (Claude Code's)
            raise InvalidRequest(
                f"{where}.role: Input should be 'user', 'assistant' or 'system'", param=f"{where}.role"
            )
        content = item.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else _list(content, f"{where}.content")
        if role == "assistant":
            _assistant(blocks, where, built, called, accepted)
            continue
        pending: list[str | ToolCall] = []  # the blocks of the message being built
        for j, block in enumerate(blocks):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                pending.append(block["text"])
            elif kind == "tool_result" and role == "user":
                if block.get("tool_use_id") not in called:
                    raise InvalidRequest(
                        f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: "
                        f"{block.get('tool_use_id')!r}. Each `tool_result` block must have a "
                        "corresponding `tool_use` block in the previous message.",
                        param=f"{at}.tool_use_id",
                    )
                _flush(messages, role, pending)
                result = "".join(_texts(block.get("content", ""), f"{at}.content"))
                messages.append(Message(role="tool", content=result, tool_call_id=block["tool_use_id"]))
            else:
                raise InvalidRequest(
                    f"{at}: blocks of type {kind!r} are not supported in {role} messages here (text, "
                    "tool_use from the assistant, tool_result from the user)",
                    param=f"{at}.type",
                )
        _flush(messages, role, pending)
    return messages


def _assistant(blocks: list, where: str, built: hosted.Regrouper, called: set[str], accepted: dict[str, str]) -> None:
    """An assistant message's blocks: thinking (signed by this proxy, or rendered as plain reasoning
    with why), text, tool uses, and the server tool calls the proxy ran."""
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            built.text(block["text"])
        elif kind == "tool_use":
            made = _tool_use(block, at)
            called.add(made.id)
            built.call(made)
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            if not call.signed(block["thinking"], block.get("signature")):
                accepted[f"{where}.thinking"] = call.FOREIGN_REASONING
            built.reasoning(block["thinking"])
        elif kind == "redacted_thinking":
            accepted["redacted_thinking"] = (
                "encrypted reasoning of another service cannot be read: it is left out of the prompt"
            )
        elif kind == "server_tool_use":
            built.hosted(built.recall(block.get("id"), f"{at}.id"))
        elif kind in RESULT_BLOCKS.values():
            built.hosted(built.recall(block.get("tool_use_id"), f"{at}.tool_use_id"))
        else:
            raise InvalidRequest(
                f"{at}: blocks of type {kind!r} are not supported in assistant messages here (text, "
                "tool_use, and the server tool calls this session made)",
                param=f"{at}.type",
            )
    built.flush()


def _flush(messages: list[Message], role: str, pending: list[str | ToolCall]) -> None:
    """The pending text (and, for the assistant, tool uses) as one message."""
    if not pending:
        return
    calls = tuple(p for p in pending if isinstance(p, ToolCall))
    text = "".join(p for p in pending if isinstance(p, str))
    messages.append(Message(role=role, content=text, tool_calls=calls))
    pending.clear()


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    if (
        not isinstance(block.get("id"), str)
        or not isinstance(block.get("name"), str)
        or not isinstance(block.get("input"), dict)
    ):
        raise InvalidRequest(f"{where}: a tool_use block needs 'id', 'name' and an 'input' object", param=where)
    return ToolCall(id=block["id"], name=block["name"], arguments=json.dumps(block["input"]))


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
        raise InvalidRequest(
            f"{where}: only client tools ({{name, description, input_schema}}) are supported: the agent runs them",
            param=where,
        )
    return call.function_tool(
        tool.get("name"), tool.get("description"), tool["input_schema"], where, tool.get("strict")
    )


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None:
        return "auto", None
    if kind in ("auto", "none"):
        return kind, None
    if kind == "any":
        return "required", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return "named", choice["name"]
    raise InvalidRequest(
        f"tool_choice: {choice!r} is not one of {{type: auto}}, {{type: any}}, {{type: tool, name}}, {{type: none}}",
        param="tool_choice",
    )


def _output_schema(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    spec = config.get("format") if isinstance(config, dict) else "?"
    if isinstance(config, dict) and config.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise InvalidRequest(
            f"output_config.effort: {config['effort']!r} is not one of 'low', 'medium', 'high', 'xhigh', 'max'",
            param="output_config.effort",
        )
    if spec is None:
        return None
    if isinstance(spec, dict) and spec.get("type") == "json_schema" and isinstance(spec.get("schema"), dict):
        return spec["schema"]
    raise InvalidRequest(
        "output_config.format: expected {type: 'json_schema', schema: {...}}", param="output_config.format"
    )


# ---- answers --------------------------------------------------------------------------------


def blocks(output: Output) -> list[dict[str, Any]]:
    """Every block of the call: each hosted round's text and server tool calls with their results,
    then the last reply's text and calls."""
    content: list[dict[str, Any]] = []
    for reply, ran in [*((r.reply, r.hosted) for r in output.rounds), (output.reply, output.hosted)]:
        reasoning, text = call.reasoning_of(reply.content)
        if reasoning is not None:
            content.append({"type": "thinking", "thinking": reasoning, "signature": call.sign(reasoning)})
        content += [{"type": "text", "text": text}] if text else []
        for made in reply.tool_calls:
            content += _hosted_blocks(ran[made.id]) if made.id in ran else [_tool_use_block(made)]
    return content


def _hosted_blocks(ran: hosted.HostedCall) -> list[dict[str, Any]]:
    """A server tool call as Anthropic returns it: the ``server_tool_use`` and its result block."""
    argument = hosted.DEFINITIONS[ran.kind][2]
    use = {"type": "server_tool_use", "id": ran.call.id, "name": ran.call.name, "input": {argument: ran.argument}}
    if ran.status != "completed":
        error = {"type": RESULT_BLOCKS[ran.kind] + "_error", "error_code": "unavailable"}
        return [use, {"type": RESULT_BLOCKS[ran.kind], "tool_use_id": ran.call.id, "content": error}]
    if ran.kind == "web_search":
        content: Any = [
            {
                "type": "web_search_result",
                "url": s.get("url", ""),
                "title": s.get("title", ""),
                "encrypted_content": "",
                "page_age": None,
            }
            for s in ran.result.sources
        ]
    elif ran.kind == "web_fetch":
        content = {
            "type": "web_fetch_result",
            "url": ran.argument,
            "retrieved_at": None,
            "content": {
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": ran.result.text},
            },
        }
    else:
        content = {
            "type": "code_execution_result",
            "stdout": ran.result.text,
            "stderr": "",
            "return_code": 0,
            "content": [],
        }
    return [use, {"type": RESULT_BLOCKS[ran.kind], "tool_use_id": ran.call.id, "content": content}]


def _tool_use_block(made: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(made.arguments)
    except ValueError:
        arguments = made.arguments
    # Anthropic's input is an object; arguments the model wrote as anything else travel under one key.
    return {
        "type": "tool_use",
        "id": made.id,
        "name": made.name,
        "input": arguments if isinstance(arguments, dict) else {"arguments": arguments},
    }


def _stop(output: Output) -> tuple[str, str | None]:
    if output.stop is not None and output.finish == "stop":
        return "stop_sequence", output.stop
    return STOP_REASONS.get(output.finish, "end_turn"), None


def _usage(answer: Answer, output_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": answer.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    searches = sum(
        h.kind == "web_search"
        for o in answer.outputs
        for ran in [o.hosted, *(r.hosted for r in o.rounds)]
        for h in ran.values()
    )
    if searches:
        usage["server_tool_use"] = {"web_search_requests": searches}
    return usage


def _message(
    answer: Answer, content: list[dict[str, Any]], stop: tuple[str | None, str | None], output_tokens: int
) -> dict[str, Any]:
    return {
        "id": "msg_" + answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": _usage(answer, output_tokens),
    }


def answer(req: CallRequest, answer: Answer) -> dict[str, Any]:
    output = answer.outputs[0]
    return _message(answer, blocks(output), _stop(output), answer.completion_tokens)


async def events(req: CallRequest, stream: AsyncIterator[Event]) -> AsyncGenerator[tuple[str | None, dict], None]:
    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, **fields}

    index = -1  # of the open block, or the last block
    open_block: str | None = None  # "thinking" | "text"
    thought = ""  # the open thinking block's text, which its signature signs
    split = call.ReasoningStream()

    def close() -> list[tuple[str, dict[str, Any]]]:
        nonlocal open_block
        out = (
            [
                event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "signature_delta", "signature": call.sign(thought)},
                )
            ]
            if open_block == "thinking"
            else []
        )
        out.append(event("content_block_stop", index=index))
        open_block = None
        return out

    opened = await call.opened(stream)
    yield event("message_start", message=_message(opened, [], (None, None), 0))
    async for item in stream:
        if isinstance(item, Delta) and item.text:
            for reasoning, text in split.feed(item.text):
                kind = "thinking" if reasoning else "text"
                if open_block != kind:
                    if open_block is not None:
                        for ev in close():
                            yield ev
                    open_block, index, thought = kind, index + 1, ""
                    start = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if reasoning
                        else {"type": "text", "text": ""}
                    )
                    yield event("content_block_start", index=index, content_block=start)
                thought += text if reasoning else ""
                delta = (
                    {"type": "thinking_delta", "thinking": text} if reasoning else {"type": "text_delta", "text": text}
                )
                yield event("content_block_delta", index=index, delta=delta)
        elif isinstance(item, (Hosted, Output)):
            reply, ran = (
                (item.round.reply, item.round.hosted) if isinstance(item, Hosted) else (item.reply, item.hosted)
            )
            split = call.ReasoningStream()  # a hosted round's next reply starts anew
            if open_block is not None:  # the recorder streams all of a reply's content before its end
                for ev in close():
                    yield ev
            for made in reply.tool_calls:
                for block in _hosted_blocks(ran[made.id]) if made.id in ran else [_tool_use_block(made)]:
                    index += 1
                    if block["type"] in ("tool_use", "server_tool_use"):
                        yield event("content_block_start", index=index, content_block={**block, "input": {}})
                        yield event(
                            "content_block_delta",
                            index=index,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                        )
                    else:
                        yield event("content_block_start", index=index, content_block=block)
                    yield event("content_block_stop", index=index)
            if isinstance(item, Output):
                stop_reason, stop_sequence = _stop(item)
                yield event(
                    "message_delta",
                    delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    usage=_usage(opened, item.all_tokens),
                )
    yield event("message_stop")


def error_body(failure: Failure) -> dict[str, Any]:
    kind = {413: "request_too_large"}.get(failure.status, failure.type)
    if failure.status >= 500:
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": failure.message}}


def stream_error(failure: Failure, sent: int) -> tuple[str | None, dict[str, Any]]:
    return "error", error_body(failure)
