"""OpenAI Responses: ``POST {base_url}/responses``, the default model of the ``openai-agents`` SDK.

``input`` (a string, or items: ``message`` with ``input_text``/``output_text`` parts,
``function_call``, ``function_call_output``) becomes chat messages: an assistant ``message`` item
and the ``function_call`` items after it are one assistant turn, as the response that produced
them was, so an agent that echoes a response's output back continues its branch. ``instructions``
is the system message.

``previous_response_id`` is resolved inside the session: each stored response (``store`` is true
unless the call says false) keeps its conversation, without its instructions, which OpenAI does
not carry over either. Implemented besides: function ``tools``, ``tool_choice``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (by constrained decoding),
``include: ["message.output_text.logprobs"]`` with ``top_logprobs``, and ``stream`` with the
documented events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``, ...). A reply cut by ``max_output_tokens`` is ``incomplete``, as OpenAI's.

Codex's "responses lite" declares its tools in ``additional_tools`` input items, in namespaces,
the main one a freeform ``custom`` tool: ``Tools`` shows the model each as a function (a custom
tool's one string, ``input``), and a custom tool's call is answered, and echoed back, as a
``custom_tool_call``. ``reasoning.effort`` sets a template's thinking switch; the other fields in
``REASONS``, ``REASONING_REASONS`` and ``INCLUDE_REASONS`` are accepted without effect, each with
its reason on the turn.
"""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any, AsyncGenerator, AsyncIterator

from inverted.errors import InvalidRequest
from inverted.rollout.chat import Message, ToolCall
from inverted.rollout.proxy import hosted
from inverted.rollout.proxy.apis import call, openai_shared
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Delta, Event, Failure, Hosted, Output

ROUTE = "/responses"
FIELDS = {
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "previous_response_id",
    "top_logprobs",
    "include",
    "truncation",
    "store",
    "reasoning",
    "max_tool_calls",
}
REASONS = openai_shared.REASONS | {
    "stream_options": "its one option pads stream events against length side channels; these events are not "
    "padded, and what is sampled is the same",
    "context_management": "the hosted service's compaction of a long conversation; here the conversation is "
    "rendered as sent, and one past the context is refused with context_length_exceeded",
    "prompt_cache_options": "prefix caching here is automatic (the servers' radix cache)",
}
NEUTRAL: dict[str, tuple] = {"background": (False, None), "conversation": (None,), "prompt": (None,)}
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"  # each reasoning item carries its text signed (``_sealed``)
INCLUDE_REASONS = {  # include entries asking for what this server never produces
    "message.input_image.image_url": "no images are read here",
    "computer_call_output.output.image_url": "no computer-use tool runs here",
}
# include entries that add a hosted call's results to its item (``--proxy-hosted-tools``)
INCLUDE_HOSTED = (
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
)
# hosted tool types, by their prefix, and the kind that serves them; their items, by kind
HOSTED_TYPES = {"web_search": "web_search", "file_search": "file_search", "code_interpreter": "code_interpreter"}
HOSTED_ITEMS = {
    "web_search_call": "web_search",
    "file_search_call": "file_search",
    "code_interpreter_call": "code_interpreter",
}
HOSTED_OPTION_REASON = "an option of a hosted tool, which the configured implementation is not given"
REASONING_REASONS = {
    "summary": "no reasoning summary is produced: a template's reasoning, if any, is in the message text",
    "generate_summary": "no reasoning summary is produced: a template's reasoning, if any, is in the message text",
    "context": "reasoning is not kept apart from the conversation here: the template renders the history as sent",
}
VERBOSITY_REASON = (
    "a length hint that hosted models follow through their own system prompt; this policy samples "
    "from the prompt as sent, and max_output_tokens bounds the reply"
)
CUSTOM_REASON = (
    "custom tools are shown to the model as functions with one string argument, 'input', which is "
    "returned as the custom_tool_call's input; a grammar in its 'format' is not enforced"
)
MAX_STORED = 256  # responses a session keeps for previous_response_id (the oldest go first)


def parse(body: Any, session: Any) -> CallRequest:
    body = openai_shared.check_fields(body, FIELDS, NEUTRAL, REASONS)
    prior = _previous(body.get("previous_response_id"), session)
    if body.get("input") is None and not prior:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    declared = Tools()
    for i, t in enumerate(_list(body.get("tools"), "tools")):
        declared.add(t, f"tools[{i}]")
    accepted: dict[str, str] = {}
    conversation = _conversation(body.get("input"), prior, declared, session, accepted)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", param="instructions", code="invalid_type")
    messages = ([Message(role="system", content=instructions)] if instructions else []) + conversation
    tools = declared.functions
    include = _list(body.get("include"), "include")
    for j, entry in enumerate(include):
        if entry not in (LOGPROBS, ENCRYPTED) and entry not in INCLUDE_REASONS and entry not in INCLUDE_HOSTED:
            raise InvalidRequest(
                f"Invalid value for 'include[{j}]': {entry!r}; supported values are "
                f"{[LOGPROBS, ENCRYPTED, *INCLUDE_HOSTED, *INCLUDE_REASONS]}",
                param=f"include[{j}]",
                code="invalid_value",
            )
    for name in ("max_output_tokens", "top_logprobs"):
        if body.get(name) is not None:
            call.number(name, body[name])
    if body.get("max_tool_calls") is not None:
        call.number("max_tool_calls", body["max_tool_calls"], (int, 0, None))
    choice = body.get("tool_choice")
    req = CallRequest(
        kind="chat",
        model=openai_shared.model_name(body),
        messages=messages,
        prompt=None,
        tools=tools or None,
        parse_tools=bool(tools or declared.hosted) and choice != "none",
        stream=bool(body.get("stream")),
        max_tokens=body.get("max_output_tokens"),
        max_tokens_field="max_output_tokens",
        sampling=call.sampling({k: body.get(k) for k in ("temperature", "top_p")}),
        logprobs=LOGPROBS in include,
        top_logprobs=body.get("top_logprobs") or 0,
        force_call=call.forced_call(*_tool_choice(choice), tools),
        hosted=declared.hosted,
        hosted_limit=body.get("max_tool_calls"),
        accepted=accepted,
    )
    call.constrain(req, _text_schema(body.get("text")), "text.format")
    _accept(req, body, include, declared)
    req.echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": choice or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "top_logprobs": body.get("top_logprobs") or 0,
        "custom": declared.custom,
        "include": set(include),
    }
    if req.echo["store"]:
        kept = conversation  # OpenAI does not carry instructions over to the next response

        def store(answer: Answer) -> None:
            output = answer.outputs[0]
            session.stored[_response_id(answer)] = (
                kept + hosted.expanded(output.rounds, output.reply) + [h.message() for h in output.hosted.values()]
            )
            while len(session.stored) > MAX_STORED:
                session.stored.pop(next(iter(session.stored)))

        req.on_recorded = store
    return req


def _accept(req: CallRequest, body: dict[str, Any], include: list, declared: "Tools") -> None:
    """The fields taken without effect, with why; ``reasoning.effort`` as a thinking mode."""
    call.accept(req.accepted, body, REASONS)
    for entry in include:
        if entry in INCLUDE_REASONS:
            req.accepted[f"include.{entry}"] = INCLUDE_REASONS[entry]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise InvalidRequest("'reasoning' must be an object", param="reasoning", code="invalid_type")
        unknown = sorted(set(reasoning) - {"effort"} - set(REASONING_REASONS))
        if unknown:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: reasoning.{unknown[0]}",
                param=f"reasoning.{unknown[0]}",
                code="unrecognized_argument",
            )
        if reasoning.get("effort") is not None:
            req.thinking = (("reasoning.effort",), call.effort(reasoning["effort"], "reasoning.effort"))
        call.accept(req.accepted, reasoning, REASONING_REASONS, "reasoning.")
    text = body.get("text")
    if isinstance(text, dict) and text.get("verbosity") is not None:
        if text["verbosity"] not in ("low", "medium", "high"):
            raise InvalidRequest(
                f"Invalid value for 'text.verbosity': {text['verbosity']!r}; expected 'low', 'medium' or 'high'",
                param="text.verbosity",
                code="invalid_value",
            )
        req.accepted["text.verbosity"] = VERBOSITY_REASON
    if declared.custom:
        req.accepted["tools[].format"] = CUSTOM_REASON
    for where, key in declared.options:
        req.accepted[f"{where}.{key}"] = HOSTED_OPTION_REASON
    if declared.namespaced:
        req.accepted["tools[].namespace"] = (
            "a namespace's tools are shown to the model by their own names, each as a function"
        )


def _previous(response_id: Any, session: Any) -> list[Message]:
    if response_id is None:
        return []
    found = session.stored.get(response_id) if isinstance(response_id, str) else None
    if found is None:
        raise InvalidRequest(
            f"Previous response with id '{response_id}' not found (only this session's stored "
            "responses can be continued).",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found


def _list(value: Any, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"'{name}' must be an array", param=name, code="invalid_type")
    return value


def _conversation(
    raw: Any, prior: list[Message], declared: "Tools", session: Any, accepted: dict[str, str]
) -> list[Message]:
    """``input`` as chat messages, after the ``prior`` conversation (a previous response's); its
    ``additional_tools`` items join ``declared`` (Codex's "responses lite" declares its tools there).

    An assistant ``message`` item and the calls after it are one assistant turn, as the response
    that produced them was; a hosted call the proxy ran (``web_search_call``, ...) is that turn's
    call too, and its result follows the turn (``hosted.Regrouper``); a ``reasoning`` item opens the turn
    after it (``_reasoning``)."""
    if raw is None:
        return list(prior)
    if isinstance(raw, str):
        return [*prior, Message(role="user", content=raw)]
    built = hosted.Regrouper(session)
    built.messages = list(prior)
    called = {c.id for m in prior for c in m.tool_calls}
    for i, item in enumerate(_list(raw, "input")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"expected an input item object, got {type(item).__name__}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, where)
            if message.role != "assistant" or built.content or built.calls or built.results:
                built.flush()
            if message.role == "assistant":
                built.text(message.content)
            else:
                built.messages.append(message)
        elif kind == "reasoning":
            text = _reasoning(item, where, accepted)
            if text is not None:
                built.reasoning(text)
        elif kind in ("function_call", "custom_tool_call"):
            made = _call_item(item, where)
            called.add(made.id)
            built.call(made)
        elif kind in HOSTED_ITEMS:
            ran = built.recall(item.get("id"), f"{where}.id")
            called.add(ran.call.id)
            built.hosted(ran)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item.get("call_id") not in called:
                raise InvalidRequest(
                    f"a {kind} must answer a call made earlier in the conversation; no call has "
                    f"call_id {item.get('call_id')!r}",
                    param=f"{where}.call_id",
                )
            built.flush()
            built.messages.append(
                Message(role="tool", content=_text(item.get("output"), f"{where}.output"), tool_call_id=item["call_id"])
            )
        elif kind == "additional_tools":
            for j, tool in enumerate(_list(item.get("tools"), f"{where}.tools")):
                declared.add(tool, f"{where}.tools[{j}]")
        else:
            raise InvalidRequest(
                f"input items of type {kind!r} are not supported: send message, function_call, "
                "custom_tool_call, their outputs, the hosted calls this session made "
                f"({', '.join(HOSTED_ITEMS)}) and additional_tools items",
                param=f"{where}.type",
                code="invalid_value",
            )
    built.flush()
    return built.messages


def _reasoning(item: dict[str, Any], where: str, accepted: dict[str, str]) -> str | None:
    """A reasoning item's text: its ``reasoning_text`` content, or the text this proxy sealed in its
    ``encrypted_content``; another service's sealed reasoning cannot be read (left out, with why)."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequest("a reasoning item's content must be reasoning_text parts", param=f"{where}.content")
    sealed = _unsealed(item.get("encrypted_content"))
    text = "".join(p["text"] for p in parts) if parts else sealed
    if text is None:
        accepted[f"{where}.encrypted_content"] = (
            "reasoning sealed by another service cannot be read: it is left out of the prompt"
        )
    elif sealed != text:
        accepted[f"{where}.content"] = call.FOREIGN_REASONING
    return text


def _sealed(reasoning: str) -> str:
    """``encrypted_content`` as this proxy writes it: the text and its signature (readable: nothing in it
    is secret from the agent, but only this proxy's own is taken as signed)."""
    return base64.b64encode(json.dumps({"text": reasoning, "signature": call.sign(reasoning)}).encode()).decode()


def _unsealed(sealed: Any) -> str | None:
    try:
        found = json.loads(base64.b64decode(sealed, validate=True))
    except (TypeError, ValueError):
        return None
    text = found.get("text") if isinstance(found, dict) else None
    return text if isinstance(text, str) and call.signed(text, found.get("signature")) else None


def _call_item(item: dict[str, Any], where: str) -> ToolCall:
    """A ``function_call`` item, or a ``custom_tool_call`` as the function call the model wrote for it."""
    if item["type"] == "custom_tool_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "input")):
            raise InvalidRequest("a custom_tool_call item needs string 'call_id', 'name' and 'input'", param=where)
        return ToolCall(id=item["call_id"], name=item["name"], arguments=json.dumps({"input": item["input"]}))
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise InvalidRequest("a function_call item needs string 'call_id', 'name' and 'arguments'", param=where)
    return ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])


def _message(item: dict[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(
            f"Invalid value: {role!r}. Supported values are: 'user', 'system', 'developer' and 'assistant'.",
            param=f"{where}.role",
            code="invalid_value",
        )
    content = _text(item.get("content"), f"{where}.content")
    return Message(role="system" if role == "developer" else role, content=content)


def _text(content: Any, where: str) -> str:
    """A string, or text parts (``input_text``, ``output_text``): this model reads text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("expected a string or an array of text parts", param=where, code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text")
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(
                f"content part of type {kind!r} is not supported: this model reads text parts only "
                "(input_text, output_text)",
                param=f"{where}[{j}]",
                code="invalid_value",
            )
        texts.append(part["text"])
    return "".join(texts)


class Tools:
    """The tools a request declares, in the order the model is shown them: ``tools``, then each
    ``additional_tools`` item's. Function tools as they are; a ``namespace``'s tools each by its own
    name; a ``custom`` (freeform) tool as a function of one string, ``input`` (``CUSTOM_REASON``)."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.custom: set[str] = set()  # names whose calls are answered as custom_tool_call items
        self.namespaced = False
        self.hosted: list[hosted.Ask] = []  # hosted tools, offered where they stand when configured
        self.options: list[tuple[str, str]] = []  # (where, option) of each hosted tool's options

    def add(self, tool: Any, where: str) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind == "function":
            self.functions.append(
                call.function_tool(
                    tool.get("name"), tool.get("description"), tool.get("parameters"), where, tool.get("strict")
                )
            )
        elif kind == "custom":
            self.functions.append(
                call.function_tool(tool.get("name"), tool.get("description"), CUSTOM_PARAMETERS, where)
            )
            self.custom.add(tool["name"])
        elif isinstance(kind, str) and kind.startswith(tuple(HOSTED_TYPES)):
            self.hosted.append(
                hosted.Ask(
                    HOSTED_TYPES[next(p for p in HOSTED_TYPES if kind.startswith(p))], where, len(self.functions)
                )
            )
            self.options += [(where, key) for key in tool if key != "type"]
        elif kind == "namespace":
            self.namespaced = True
            for j, child in enumerate(_list(tool.get("tools"), f"{where}.tools")):
                self.add(child, f"{where}.tools[{j}]")
        else:
            raise InvalidRequest(
                f"tools of type {kind!r} are not supported: function, custom and namespace tools, "
                "which the agent runs, and the hosted web_search, file_search and code_interpreter",
                param=f"{where}.type",
                code="invalid_value",
            )


CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return "named", choice["name"]
    raise InvalidRequest(
        f"Invalid value for 'tool_choice': {choice!r}; expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'name': ...}",
        param="tool_choice",
        code="invalid_value",
    )


def _text_schema(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a JSON schema to constrain the reply with (``json_object``: any object)."""
    if text is None:
        return None
    spec: Any = text.get("format") if isinstance(text, dict) else "?"
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        return spec["schema"]
    raise InvalidRequest(
        f"Invalid 'text.format': {str(spec)[:200]}; expected {{'type': 'text'}}, "
        "{'type': 'json_object'} or {'type': 'json_schema', 'name', 'schema'}",
        param="text.format",
        code="invalid_value",
    )


# ---- answers --------------------------------------------------------------------------------


def _response_id(answer: Answer) -> str:
    return "resp_" + answer.id


def _message_id(answer: Answer, n: int = 0) -> str:
    """The call's ``n``-th message item (a call with hosted rounds has one per reply with text)."""
    return "msg_" + answer.id + (f"_{n}" if n else "")


def output_items(req: CallRequest, answer: Answer, output: Output) -> list[dict[str, Any]]:
    """Every item of the call, in order: each hosted round's message (when it wrote text) and calls,
    then the last reply's message (when there is text, or nothing else) and calls."""
    items: list[dict[str, Any]] = []
    for r in output.rounds:
        reasoning, text = call.reasoning_of(r.reply.content)
        if reasoning is not None:
            items.append(_reasoning_item(f"rs_{answer.id}_{len(items)}", reasoning, req.echo))
        if text:
            items.append(_message_item(_message_id(answer, len(items)), text, None, "completed"))
        items += [_call_output(f"fc_{answer.id}_{len(items)}", made, req.echo, r.hosted) for made in r.reply.tool_calls]
    reasoning, content = call.reasoning_of(output.reply.content or "")
    if reasoning is not None:
        items.append(_reasoning_item(f"rs_{answer.id}_{len(items)}", reasoning, req.echo))
    if content or not output.reply.tool_calls:
        status = "incomplete" if output.finish == "length" else "completed"
        items.append(_message_item(_message_id(answer, len(items)), content, output, status))
    items += [
        _call_output(f"fc_{answer.id}_{len(items)}", made, req.echo, output.hosted) for made in output.reply.tool_calls
    ]
    return items


def _reasoning_item(item_id: str, reasoning: str, echo: dict[str, Any]) -> dict[str, Any]:
    """A reply's reasoning as its own item, with ``encrypted_content`` when ``include`` asks for it."""
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": reasoning}],
        "encrypted_content": _sealed(reasoning) if ENCRYPTED in echo["include"] else None,
    }


def _message_item(item_id: str, text: str, output: Output | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, output)],
    }


def _call_output(
    item_id: str, made: ToolCall, echo: dict[str, Any], ran: dict[str, hosted.HostedCall]
) -> dict[str, Any]:
    """A call as its output item: a hosted call's own item (its id the call's, by which the proxy
    knows it when it comes back); a custom tool's ``custom_tool_call`` with the ``input`` the model
    wrote; else a ``function_call``."""
    if made.id in ran:
        return _hosted_item(ran[made.id], echo["include"])
    if made.name in echo["custom"]:
        try:
            written = json.loads(made.arguments)
        except ValueError:
            written = None
        text = written.get("input") if isinstance(written, dict) else None
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": made.id,
            "name": made.name,
            "input": text if isinstance(text, str) else made.arguments,
        }
    return {
        "id": item_id,
        "type": "function_call",
        "status": "completed",
        "call_id": made.id,
        "name": made.name,
        "arguments": made.arguments,
    }


def _hosted_item(ran: hosted.HostedCall, include: set[str]) -> dict[str, Any]:
    """OpenAI's item for a hosted call; its results only when ``include`` asks for them, as OpenAI's."""
    item: dict[str, Any] = {"id": ran.call.id, "status": ran.status}
    if ran.kind == "web_search":
        action: dict[str, Any] = {"type": "search", "query": ran.argument}
        if include & {"web_search_call.action.sources", "web_search_call.results"}:
            action["sources"] = [{"type": "url", "url": s.get("url", "")} for s in ran.result.sources]
        return {**item, "type": "web_search_call", "action": action}
    if ran.kind == "file_search":
        results: list[dict[str, Any]] = [
            {"text": ran.result.text, "filename": None, "file_id": None, "score": None, "attributes": {}}
        ]
        return {
            **item,
            "type": "file_search_call",
            "queries": [ran.argument],
            "results": results if "file_search_call.results" in include else None,
        }
    return {
        **item,
        "type": "code_interpreter_call",
        "code": ran.argument,
        "container_id": "inverted",
        "outputs": [{"type": "logs", "logs": ran.result.text}] if "code_interpreter_call.outputs" in include else None,
    }


def _text_part(text: str, output: Output | None) -> dict[str, Any]:
    logprobs = [] if output is None or output.logprobs is None else openai_shared.token_logprobs(output.logprobs)
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def response(req: CallRequest, answer: Answer, output: list[dict[str, Any]], done: bool) -> dict[str, Any]:
    """The response object; ``done``: with its status and usage (else ``in_progress``)."""
    cut = done and any(o.finish == "length" for o in answer.outputs)
    status = ("incomplete" if cut else "completed") if done else "in_progress"
    usage = (
        {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": answer.cached_tokens},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
        if done
        else None
    )
    echo = req.echo
    return {
        "id": _response_id(answer),
        "object": "response",
        "created_at": answer.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "model": answer.model,
        "output": output,
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": echo["previous_response_id"],
        "reasoning": {"effort": None, "summary": None},
        "store": echo["store"],
        "temperature": echo["temperature"],
        "text": echo["text"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_logprobs": echo["top_logprobs"],
        "top_p": echo["top_p"],
        "truncation": "disabled",
        "usage": usage,
        "user": echo["user"],
        "metadata": echo["metadata"],
    }


def answer(req: CallRequest, answer: Answer) -> dict[str, Any]:
    return response(req, answer, output_items(req, answer, answer.outputs[0]), done=True)


# streamed events of a hosted call, between its item's added and done: (kind: the status steps)
HOSTED_STEPS = {
    "web_search": ("in_progress", "searching", "completed"),
    "file_search": ("in_progress", "searching", "completed"),
    "code_interpreter": ("in_progress", "interpreting", "completed"),
}


async def events(req: CallRequest, stream: AsyncIterator[Event]) -> AsyncGenerator[tuple[str | None, dict], None]:
    """The documented event sequence: a thinking model's reasoning in a reasoning item, then text
    deltas as tokens arrive, in a message item per reply; each hosted call as its own item once it
    ran; each function call whole at the end."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(numbers), **fields}

    opened = await call.opened(stream)
    yield event("response.created", response=response(req, opened, [], done=False))
    yield event("response.in_progress", response=response(req, opened, [], done=False))
    items: list[dict[str, Any]] = []  # done, in order
    texting: dict[str, Any] | None = None  # the open message item
    thinking: dict[str, Any] | None = None  # the open reasoning item, and its text so far
    thought = ""
    split = call.ReasoningStream()

    def open_reasoning() -> list[tuple[str, dict[str, Any]]]:
        nonlocal thinking, thought
        thinking, thought = (
            {
                "id": f"rs_{opened.id}_{len(items)}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            },
            "",
        )
        return [event("response.output_item.added", output_index=len(items), item=thinking)]

    def close_reasoning() -> list[tuple[str, dict[str, Any]]]:
        nonlocal thinking
        assert thinking is not None  # called only while a reasoning item is open
        done = _reasoning_item(thinking["id"], thought, req.echo)
        at = {"item_id": done["id"], "output_index": len(items), "content_index": 0}
        thinking = None
        items.append(done)
        return [
            event("response.reasoning_text.done", **at, text=thought),
            event("response.output_item.done", output_index=len(items) - 1, item=done),
        ]

    def open_message() -> list[tuple[str, dict[str, Any]]]:
        nonlocal texting
        texting = {
            "id": _message_id(opened, len(items)),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        return [
            event("response.output_item.added", output_index=len(items), item=texting),
            event(
                "response.content_part.added",
                item_id=texting["id"],
                output_index=len(items),
                content_index=0,
                part=_text_part("", None),
            ),
        ]

    def close_message(text: str, output: Output | None, status: str) -> list[tuple[str, dict[str, Any]]]:
        nonlocal texting
        assert texting is not None  # called only while a message item is open
        done = _message_item(texting["id"], text, output, status)
        part, at = done["content"][0], {"item_id": done["id"], "output_index": len(items), "content_index": 0}
        texting = None
        items.append(done)
        return [
            event("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]),
            event("response.content_part.done", **at, part=part),
            event("response.output_item.done", output_index=len(items) - 1, item=done),
        ]

    def call_item(done: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        index = len(items)
        items.append(done)
        out = []
        if done["type"] in ("function_call", "custom_tool_call"):
            field = "input" if done["type"] == "custom_tool_call" else "arguments"
            prefix = "response." + ("custom_tool_call_input" if field == "input" else "function_call_arguments")
            out.append(
                event(
                    "response.output_item.added", output_index=index, item={**done, field: "", "status": "in_progress"}
                )
            )
            at = {"item_id": done["id"], "output_index": index}
            out.append(event(prefix + ".delta", **at, delta=done[field]))
            out.append(
                event(
                    prefix + ".done",
                    **at,
                    **({"name": done["name"]} if field == "arguments" else {}),
                    **{field: done[field]},
                )
            )
        else:  # a hosted call, which ran before this event
            out.append(event("response.output_item.added", output_index=index, item={**done, "status": "in_progress"}))
            for step in HOSTED_STEPS[HOSTED_ITEMS[done["type"]]]:
                out.append(event(f"response.{done['type']}.{step}", output_index=index, item_id=done["id"]))
        out.append(event("response.output_item.done", output_index=index, item=done))
        return out

    def reply_items(
        reply: Any, output: Output | None, ran: dict[str, hosted.HostedCall], status: str, last: bool
    ) -> list[tuple[str, dict[str, Any]]]:
        out = close_reasoning() if thinking is not None else []
        if texting is not None:
            out += close_message(call.reasoning_of(reply.content or "")[1], output, status)
        elif last and not reply.tool_calls:
            out += open_message() + close_message("", output, status)
        for made in reply.tool_calls:
            out += call_item(_call_output(f"fc_{opened.id}_{len(items)}", made, req.echo, ran))
        return out

    async for item in stream:
        if isinstance(item, Delta) and item.text:
            for reasoning, text in split.feed(item.text):
                if reasoning:
                    for ev in open_reasoning() if thinking is None else []:
                        yield ev
                    thought += text
                    assert thinking is not None  # opened above
                    yield event(
                        "response.reasoning_text.delta",
                        item_id=thinking["id"],
                        output_index=len(items),
                        content_index=0,
                        delta=text,
                    )
                    continue
                for ev in (close_reasoning() if thinking is not None else []) + (
                    open_message() if texting is None else []
                ):
                    yield ev
                assert texting is not None  # opened above
                yield event(
                    "response.output_text.delta",
                    item_id=texting["id"],
                    output_index=len(items),
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
        elif isinstance(item, Hosted):
            split = call.ReasoningStream()
            for ev in reply_items(item.round.reply, None, item.round.hosted, "completed", last=False):
                yield ev
        elif isinstance(item, Output):
            split = call.ReasoningStream()
            status = "incomplete" if item.finish == "length" else "completed"
            for ev in reply_items(item.reply, item, item.hosted, status, last=True):
                yield ev
    final = response(req, opened, items, done=True)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


def stream_error(failure: Failure, sent: int) -> tuple[str | None, dict[str, Any]]:
    """The ``error`` event a Responses stream ends with once its headers are sent."""
    return "error", {
        "type": "error",
        "code": failure.code,
        "message": failure.message,
        "param": failure.param,
        "sequence_number": sent,
    }
