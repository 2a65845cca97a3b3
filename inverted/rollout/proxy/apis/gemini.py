"""The Gemini API: ``POST {base}/v1beta/models/{model}:generateContent`` and
``:streamGenerateContent?alt=sse``, what Gemini CLI and Google's ``google-genai`` SDKs speak.

Gemini CLI works unchanged with ``GOOGLE_GEMINI_BASE_URL={proxy}/sessions/{id}`` (the path's id is
the capability) and any ``GEMINI_API_KEY``, or with ``GOOGLE_GEMINI_BASE_URL={proxy}`` and the
session's token as its key (``x-goog-api-key``, or ``?key=``). The model is the one in the path.

``contents`` (``user`` and ``model`` turns of ``parts``) become chat messages: ``text`` parts are
text; a model turn's ``functionCall`` parts are its tool calls; a user turn's ``functionResponse``
parts are tool messages, in order (their ``response`` rendered as its ``output`` when that is all it
holds, Gemini CLI's shape, else as JSON); a model turn's ``thought`` parts are its reasoning, and a
thinking model's reasoning comes back as thought parts with ``includeThoughts``.
``systemInstruction`` is the system message.
Implemented: ``tools[].functionDeclarations`` (``parametersJsonSchema``, or ``parameters`` in
Gemini's OpenAPI subset, its upper-case types made JSON Schema's), ``toolConfig`` (``AUTO``,
``ANY`` with its ``allowedFunctionNames``, ``NONE``), and ``generationConfig``: ``temperature``,
``topP``, ``topK``, ``maxOutputTokens``, ``stopSequences``, ``seed``, ``candidateCount`` (n),
``responseMimeType: application/json`` with ``responseJsonSchema`` or ``responseSchema`` (by
constrained decoding), ``thinkingConfig`` (a template's thinking switch: a budget of 0 is off);
the hosted ``googleSearch``, ``urlContext`` and ``codeExecution`` (``hosted``). Answers carry
``candidates`` (``finishReason`` ``STOP``, ``MAX_TOKENS``) and ``usageMetadata``; streamed, one
``data:`` chunk per step, the last with the finish reason and usage. Errors have Google's body
``{"error": {"code", "message", "status"}}``. The fields in ``REASONS`` are accepted without effect,
each with its reason on the turn.
"""

from __future__ import annotations

import json
from typing import Any, AsyncGenerator, AsyncIterator

from inverted.errors import InvalidRequest
from inverted.rollout.chat import Message, ToolCall, join_reasoning, new_call_id
from inverted.rollout.proxy import hosted
from inverted.rollout.proxy.apis import call
from inverted.rollout.proxy.apis.call import Answer, CallRequest, Delta, Event, Failure, Output

ROUTE = "/models/{model}:generateContent"
STREAM_ROUTE = "/models/{model}:streamGenerateContent"
COUNT_ROUTE = "/models/{model}:countTokens"
FIELDS = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig"}
REASONS = {
    "safetySettings": "the hosted service's content filters; this policy's samples are not filtered",
    "labels": "the caller's own billing tags; nothing is sampled from them",
    "model": "the model is the one the path names",
}
GENERATION = {
    "temperature",
    "topP",
    "topK",
    "maxOutputTokens",
    "stopSequences",
    "seed",
    "candidateCount",
    "responseMimeType",
    "responseSchema",
    "responseJsonSchema",
    "thinkingConfig",
}
GENERATION_NEUTRAL: dict[str, tuple] = {
    "presencePenalty": (0, 0.0, None),
    "frequencyPenalty": (0, 0.0, None),
    "responseModalities": (["TEXT"], None),
    "responseLogprobs": (False, None),
    "logprobs": (None, 0),
    "mediaResolution": (None,),
    "speechConfig": (None,),
}
THINKING_REASONS = {
    "thinkingBudget": "a thinking budget is not enforced: maxOutputTokens bounds the whole reply",
    "thinkingLevel": "a thinking level tunes how many tokens a hosted model spends; the prompt is as sent",
}
PART_REASONS = {
    "thoughtSignature": "a signature of a hosted model's thoughts; no thought is rendered from it",
}
HOSTED_TOOLS = {
    "googleSearch": "web_search",
    "googleSearchRetrieval": "web_search",
    "urlContext": "web_fetch",
    "codeExecution": "code_interpreter",
}
FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"}
STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}


def parse(body: Any, session: Any = None, *, stream: bool = False) -> CallRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("Invalid JSON payload received: the body must be a JSON object", code="invalid_body")
    body = _fields(body)
    for key in body:
        if key not in FIELDS and key not in REASONS:
            raise InvalidRequest(f'Invalid JSON payload received. Unknown name "{key}": Cannot find field.', param=key)
    if not isinstance(body.get("contents"), list) or not body["contents"]:
        raise InvalidRequest("* GenerateContentRequest.contents: contents is not specified", param="contents")
    declared, asks = _tools(body.get("tools"))
    config = _object(body.get("generationConfig"), "generationConfig")
    for key, value in config.items():
        if key in GENERATION_NEUTRAL and value not in GENERATION_NEUTRAL[key]:
            raise InvalidRequest(
                f"generationConfig.{key} = {value!r} is not supported by this server: it would "
                f"change what is sampled (accepted: {list(GENERATION_NEUTRAL[key])})",
                param=f"generationConfig.{key}",
            )
        if key not in GENERATION and key not in GENERATION_NEUTRAL:
            raise InvalidRequest(
                f"Invalid JSON payload received. Unknown name \"{key}\" at 'generation_config': Cannot find field.",
                param=f"generationConfig.{key}",
            )
    mode, names = _tool_config(body.get("toolConfig"))
    accepted: dict[str, str] = {}
    messages = _system(body.get("systemInstruction")) + _contents(body["contents"], accepted)
    sampling = call.sampling(
        {
            "temperature": config.get("temperature"),
            "top_p": config.get("topP"),
            "top_k": config.get("topK"),
            "seed": config.get("seed"),
        }
    )
    found = call.stops(config.get("stopSequences"), "generationConfig.stopSequences", most=5)
    if found:
        sampling["stop"] = found
    n = config.get("candidateCount") or 1
    if config.get("maxOutputTokens") is not None:
        call.number("max_tokens", config["maxOutputTokens"])
    req = CallRequest(
        kind="chat",
        model=None,
        messages=messages,
        prompt=None,
        tools=declared or None,
        parse_tools=bool(declared or asks) and mode != "none",
        stream=stream,
        max_tokens=config.get("maxOutputTokens"),
        max_tokens_field="generationConfig.maxOutputTokens",
        sampling=sampling,
        n=call.number("n", n),
        force_call=call.forced_call(mode, names[0] if len(names) == 1 else None, declared, "toolConfig"),
        hosted=asks,
        accepted=accepted,
    )
    call.constrain(req, _schema(config), "generationConfig.responseSchema")
    call.accept(req.accepted, body, REASONS)
    thinking = _object(config.get("thinkingConfig"), "generationConfig.thinkingConfig")
    if thinking:
        budget = thinking.get("thinkingBudget")
        if budget is not None:
            call.number("thinkingBudget", budget, (int, -1, None))
            req.thinking = (("generationConfig.thinkingConfig.thinkingBudget",), budget != 0)
        call.accept(
            req.accepted,
            {k: v for k, v in thinking.items() if k != "thinkingBudget" or budget != 0},
            THINKING_REASONS,
            "generationConfig.thinkingConfig.",
        )
    req.echo = {"thoughts": thinking.get("includeThoughts") is True}
    return req


def parse_stream(body: Any, session: Any = None) -> CallRequest:
    return parse(body, session, stream=True)


def parse_count(body: Any) -> CallRequest:
    """A ``:countTokens`` body: ``contents`` (with what else a request holds), or a whole
    ``generateContentRequest``; counted as the call would render it."""
    body = _fields(body) if isinstance(body, dict) else body
    if isinstance(body, dict) and isinstance(body.get("generateContentRequest"), dict):
        body = {k: v for k, v in _fields(body["generateContentRequest"]).items() if k != "model"}
    return parse(body)


def counted(tokens: int) -> dict[str, Any]:
    return {"totalTokens": tokens}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def _fields(message: dict[str, Any]) -> dict[str, Any]:
    """A message's fields by their JSON (lowerCamelCase) names: Google's API takes the proto field names
    too, and the Python SDK sends them (``function_declarations``, ``parameters_json_schema``). Only the
    message's own keys: the values (a function's arguments, a schema's properties) are the caller's."""
    return {_camel(key): value for key, value in message.items()}


def _object(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"Invalid value at '{name}': expected an object", param=name)
    return _fields(value)


def _list(value: Any, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"Invalid value at '{name}': expected a list", param=name)
    return value


def _system(instruction: Any) -> list[Message]:
    if instruction is None:
        return []
    if isinstance(instruction, str):
        return [Message(role="system", content=instruction)] if instruction else []
    parts = _list(_object(instruction, "systemInstruction").get("parts"), "systemInstruction.parts")
    text = "".join(_text(part, f"systemInstruction.parts[{i}]") for i, part in enumerate(parts))
    return [Message(role="system", content=text)] if text else []


def _text(part: Any, where: str) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
        raise InvalidRequest(f"{where}: only text parts are read here", param=where)
    return part["text"]


def _contents(contents: list, accepted: dict[str, str]) -> list[Message]:
    """``contents`` as chat messages (see the module docstring)."""
    messages: list[Message] = []
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        content = _object(content, where)
        role = content.get("role", "user")
        if role not in ("user", "model", "function"):
            raise InvalidRequest(
                f"Please use a valid role: user, model. ({where}.role: {role!r})", param=f"{where}.role"
            )
        texts: list[str] = []
        thought: list[str] = []
        calls: list[ToolCall] = []
        for j, part in enumerate(_list(content.get("parts"), f"{where}.parts")):
            at = f"{where}.parts[{j}]"
            part = _object(part, at)
            call.accept(accepted, part, PART_REASONS, "contents[].parts[].")
            if part.get("thought") is True and isinstance(part.get("text"), str):  # the reply's reasoning
                if role != "model":
                    raise InvalidRequest(f"{at}: thought parts come from the model", param=at)
                thought.append(part["text"])
            elif isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part.get("functionCall"), dict) and role == "model":
                made = part["functionCall"]
                if not isinstance(made.get("name"), str):
                    raise InvalidRequest(f"{at}.functionCall: a function call needs a 'name'", param=at)
                calls.append(
                    ToolCall(
                        id=made.get("id") or new_call_id(),
                        name=made["name"],
                        arguments=json.dumps(made.get("args") or {}),
                    )
                )
            elif isinstance(part.get("functionResponse"), dict) and role in ("user", "function"):
                if texts:
                    messages.append(Message(role="user", content="".join(texts)))
                    texts = []
                answered = part["functionResponse"]
                messages.append(
                    Message(
                        role="tool",
                        content=_response_text(answered.get("response"), at),
                        tool_call_id=answered.get("id") or answered.get("name"),
                    )
                )
            else:
                kinds = sorted(k for k in part if k not in PART_REASONS)
                raise InvalidRequest(
                    f"{at}: parts of kind {kinds} are not supported in {role} turns here (text, "
                    "functionCall from the model, functionResponse from the user)",
                    param=at,
                )
        if texts or calls or thought:
            messages.append(
                Message(
                    role="assistant" if role == "model" else "user",
                    content=join_reasoning("".join(thought), "".join(texts)),
                    tool_calls=tuple(calls),
                )
            )
    if not messages:
        raise InvalidRequest("* GenerateContentRequest.contents: contents holds no text", param="contents")
    return messages


def _response_text(response: Any, where: str) -> str:
    """A function response as the tool message the model reads: its ``output`` when that is all it holds
    (Gemini CLI's shape), else its JSON."""
    if isinstance(response, dict) and set(response) == {"output"} and isinstance(response["output"], str):
        return response["output"]
    return json.dumps(response)


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[hosted.Ask]]:
    functions: list[dict[str, Any]] = []
    asks: list[hosted.Ask] = []
    for i, tool in enumerate(_list(raw, "tools")):
        tool = _object(tool, f"tools[{i}]")
        for key, value in tool.items():
            where = f"tools[{i}].{key}"
            if key == "functionDeclarations":
                for j, fn in enumerate(_list(value, where)):
                    fn = _object(fn, f"{where}[{j}]")
                    parameters = fn.get("parametersJsonSchema")
                    if parameters is None and fn.get("parameters") is not None:
                        parameters = json_schema(fn["parameters"])
                    functions.append(
                        call.function_tool(fn.get("name"), fn.get("description"), parameters, f"{where}[{j}]")
                    )
            elif key in HOSTED_TOOLS:
                asks.append(hosted.Ask(HOSTED_TOOLS[key], where, len(functions)))
            else:
                raise InvalidRequest(
                    f"{where}: tools of kind {key!r} are not supported here (functionDeclarations, "
                    f"and the hosted {', '.join(HOSTED_TOOLS)})",
                    param=where,
                )
    return functions, asks


def json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-subset schema as JSON Schema: its upper-case ``type`` names in lower case."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_schema(v) for k, v in schema.items()}
    if isinstance(out.get("type"), str):
        out["type"] = out["type"].lower()
    return out


def _tool_config(config: Any) -> tuple[str, list[str]]:
    calling = _object(_object(config, "toolConfig").get("functionCallingConfig"), "toolConfig.functionCallingConfig")
    mode = calling.get("mode", "AUTO")
    names = _list(calling.get("allowedFunctionNames"), "toolConfig.functionCallingConfig.allowedFunctionNames")
    modes = {"AUTO": "auto", "VALIDATED": "auto", "MODE_UNSPECIFIED": "auto", "NONE": "none", "ANY": "required"}
    if mode not in modes:
        raise InvalidRequest(
            f"toolConfig.functionCallingConfig.mode: {mode!r} is not one of {list(modes)}",
            param="toolConfig.functionCallingConfig.mode",
        )
    found = modes[mode]
    if found == "required" and len(names) == 1:
        return "named", names
    if names and found != "required":
        raise InvalidRequest(
            "allowedFunctionNames may be set only with mode ANY",
            param="toolConfig.functionCallingConfig.allowedFunctionNames",
        )
    if len(names) > 1:
        raise InvalidRequest(
            "allowedFunctionNames with more than one name is not supported here: the sampled "
            "call is not constrained to a subset of the tools",
            param="toolConfig.functionCallingConfig.allowedFunctionNames",
        )
    return found, names


def _schema(config: dict[str, Any]) -> dict[str, Any] | None:
    mime = config.get("responseMimeType", "text/plain")
    if mime not in ("text/plain", "application/json"):
        raise InvalidRequest(
            f"generationConfig.responseMimeType: {mime!r} is not supported (text/plain, application/json)",
            param="generationConfig.responseMimeType",
        )
    if mime != "application/json":
        if config.get("responseSchema") is not None or config.get("responseJsonSchema") is not None:
            raise InvalidRequest(
                "a response schema needs responseMimeType application/json", param="generationConfig.responseMimeType"
            )
        return None
    if isinstance(config.get("responseJsonSchema"), dict):
        return config["responseJsonSchema"]
    if isinstance(config.get("responseSchema"), dict):
        return json_schema(config["responseSchema"])
    return {"type": "object"}


# ---- answers --------------------------------------------------------------------------------


def _parts(output: Output, thoughts: bool) -> list[dict[str, Any]]:
    """The reply as parts: its reasoning as a thought part when ``includeThoughts`` asked, its text,
    its calls."""
    reasoning, text = call.reasoning_of(
        "".join(r.reply.content or "" for r in output.rounds) + (output.reply.content or "")
    )
    parts: list[dict[str, Any]] = [{"text": reasoning, "thought": True}] if reasoning and thoughts else []
    parts += [{"text": text}] if text else []
    for made in output.reply.tool_calls:
        if made.id in output.hosted:
            continue  # a hosted call's result is in the next round's text, as Gemini's grounding is
        try:
            args = json.loads(made.arguments)
        except ValueError:
            args = None
        parts.append(
            {
                "functionCall": {
                    "name": made.name,
                    "args": args if isinstance(args, dict) else {"arguments": made.arguments},
                }
            }
        )
    return parts


def _candidate(output: Output, parts: list[dict[str, Any]], finished: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": output.index}
    if finished:
        candidate["finishReason"] = FINISH.get(output.finish, "STOP")
    return candidate


def _usage(answer: Answer, done: bool) -> dict[str, int]:
    usage = {"promptTokenCount": answer.prompt_tokens}
    if answer.cached_tokens:
        usage["cachedContentTokenCount"] = answer.cached_tokens
    if done:
        usage |= {
            "candidatesTokenCount": answer.completion_tokens,
            "totalTokenCount": answer.prompt_tokens + answer.completion_tokens,
        }
    return usage


def _response(answer: Answer, candidates: list[dict[str, Any]], done: bool) -> dict[str, Any]:
    return {
        "candidates": candidates,
        "usageMetadata": _usage(answer, done),
        "modelVersion": answer.model,
        "responseId": answer.id,
    }


def answer(req: CallRequest, answer: Answer) -> dict[str, Any]:
    return _response(answer, [_candidate(o, _parts(o, req.echo["thoughts"]), True) for o in answer.outputs], done=True)


async def events(req: CallRequest, stream: AsyncIterator[Event]) -> AsyncGenerator[tuple[str | None, dict], None]:
    """One chunk per text delta; then each candidate's last chunk, with its calls and finish reason, and
    usage on the last. Those go once the call is recorded (the stream's end): a Gemini stream has no
    terminator, so clients hang up on the finish reason, and a call must not be cut short by it."""
    opened = await call.opened(stream)
    ended: list[Output] = []
    splits = [call.ReasoningStream() for _ in range(req.n)]
    async for item in stream:
        if isinstance(item, Delta) and item.text:
            for reasoning, text in splits[item.index].feed(item.text):
                if reasoning and not req.echo["thoughts"]:
                    continue
                part = {"text": text, "thought": True} if reasoning else {"text": text}
                candidate = {"content": {"role": "model", "parts": [part]}, "index": item.index}
                yield None, _response(opened, [candidate], done=False)
        elif isinstance(item, Output):
            ended.append(item)
    for i, output in enumerate(ended):
        calls = [p for p in _parts(output, False) if "functionCall" in p]
        yield None, _response(opened, [_candidate(output, calls, True)], done=i == len(ended) - 1)


def error_body(failure: Failure) -> dict[str, Any]:
    return {
        "error": {
            "code": failure.status,
            "message": failure.message,
            "status": "INTERNAL"
            if failure.status >= 500 and failure.status != 503
            else STATUS.get(failure.status, "INVALID_ARGUMENT"),
        }
    }


def stream_error(failure: Failure, sent: int) -> tuple[str | None, dict[str, Any]]:
    return None, error_body(failure)
