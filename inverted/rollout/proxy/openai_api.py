"""The OpenAI surface of the proxy: what a request may ask for, and the exact shapes of the answers.

Agents built with any SDK or framework must work unchanged, and nothing may silently change what is
sampled. So every request field falls in one of four classes:

- **implemented**: mapped onto SGLang sampling parameters (``temperature``, ``top_p``,
  ``max_tokens``/``max_completion_tokens``, ``stop``, ``n``, ``seed``, penalties, and SGLang's
  extras ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``) or served by the proxy
  (``tools``, ``tool_choice``, ``response_format`` by constrained decoding, ``stream``,
  ``stream_options``, ``logprobs``);
- **ignored**, because they never change the tokens (``model``, ``user``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``, ...);
- **neutral only**: accepted at their neutral value (``logit_bias: {}``, ``reasoning_effort: null``,
  ...), else a 400 naming the parameter;
- anything else: 400 ``Unrecognized request argument supplied: X``, as OpenAI answers.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``. Responses are plain
dicts in OpenAI's field order; streaming chunks are built by the same functions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from inverted.errors import InvalidRequest
from inverted.rollout.chat import Message, ParsedReply, parse_messages

IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "prompt_cache_retention", "safety_identifier", "stream_options", "echo_usage"}
NEUTRAL: dict[str, Any] = {
    "logit_bias": ({}, None), "reasoning_effort": (None,),
    "prediction": (None,), "modalities": (["text"], None), "audio": (None,), "functions": (None, []),
    "function_call": (None, "none", "auto"), "web_search_options": (None,), "verbosity": (None,),
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "suffix": (None,), "echo": (False, None),
    "best_of": (1, None),
}
# Penalties are neutral-only here: SGLang implements them, but sgl-router 0.3.2 keeps them and the
# embedded engine does not, so they are checked like the other neutral-only parameters.
NUMERIC = {  # name: (type, low, high) for implemented scalar parameters
    "temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "n": (int, 1, 16), "seed": (int, None, None),
    "max_tokens": (int, 1, None), "max_completion_tokens": (int, 1, None), "top_logprobs": (int, 0, 20),
    "top_k": (int, -1, None), "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 0.0, 2.0),
    "min_tokens": (int, 0, None),
}
CHAT_FIELDS = {"messages", "tools", "tool_choice", "stream", "logprobs", "stop", "response_format"} | set(NUMERIC)
COMPLETION_FIELDS = {"prompt", "stream", "logprobs", "stop"} | set(NUMERIC) - {"top_logprobs", "max_completion_tokens"}
ENGINE_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(slots=True)
class CallRequest:
    """A validated chat or text-completion call."""

    kind: str  # "chat" | "text"
    model: str | None
    messages: list[Message] | None
    prompt: str | None
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    max_tokens: int | None
    sampling: dict[str, Any]  # SGLang sampling_params, without max_new_tokens (set from the context left)
    top_logprobs: int = 0  # chat: the k most likely tokens at each sampled position; text: the legacy count
    force_call: str | None = None  # tool_choice: "" = some tool (required), a name = that tool, None = free


def _number(name: str, value: Any) -> Any:
    kind, low, high = NUMERIC[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok:
        raise InvalidRequest(f"Invalid type for '{name}': expected {'a number' if kind is float else 'an integer'}, "
                             f"got {value!r}", param=name, code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequest(f"Invalid '{name}': {value!r} must be {bounds}", param=name, code="invalid_value")
    return value


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed or key in IGNORED:
            continue
        if key in NEUTRAL:
            if value not in NEUTRAL[key]:
                raise InvalidRequest(f"'{key}' = {value!r} is not supported by this server: it would change what is "
                                     f"sampled (accepted values: {list(NEUTRAL[key])})", param=key,
                                     code="unsupported_parameter")
            continue
        raise InvalidRequest(f"Unrecognized request argument supplied: {key}", param=key,
                             code="unrecognized_argument")


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise InvalidRequest("'stop' must be a non-empty string or an array of up to 4 of them", param="stop")
    return stops


def before_stop(text: str, stops: list[str]) -> str:
    """The text up to the first stop string in it (OpenAI leaves the stop string out). The first in
    the text, not in the list: one sampled token may complete several, and SGLang names the first
    in the request's list."""
    found = [text.find(stop) for stop in stops if stop in text]
    return text[: min(found)] if found else text


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    params = {ENGINE_NAMES[k]: _number(k, v) for k, v in body.items() if k in ENGINE_NAMES and v is not None}
    stops = _stop(body.get("stop"))
    if stops:
        params["stop"] = stops
    return params


def _common(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_body")
    _check_fields(body, allowed)
    for name in ("n", "max_tokens", "max_completion_tokens", "top_logprobs"):
        if body.get(name) is not None:
            _number(name, body[name])
    if body.get("stream") not in (None, True, False):
        raise InvalidRequest("Invalid type for 'stream': expected a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    logprobs = body.get("logprobs")
    asked_logprobs = logprobs is not None and logprobs is not False  # the legacy API's count may be 0
    return {"model": body.get("model") if isinstance(body.get("model"), str) else None, "n": body.get("n") or 1,
            "stream": bool(body.get("stream")), "include_usage": bool(options.get("include_usage")),
            "logprobs": asked_logprobs,
            "max_tokens": max_tokens,
            "sampling": _sampling(body)}


def parse_chat(body: Any) -> CallRequest:
    common = _common(body, CHAT_FIELDS)
    if body.get("logprobs") not in (None, True, False):
        raise InvalidRequest("Invalid type for 'logprobs': expected a boolean", param="logprobs", code="invalid_type")
    if "messages" not in body:
        raise InvalidRequest("Missing required parameter: 'messages'.", param="messages",
                             code="missing_required_parameter")
    if body.get("top_logprobs") and not body.get("logprobs"):
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise InvalidRequest("'tools' must be an array of {type: 'function', function: {name, ...}}", param="tools")
    choice = body.get("tool_choice")
    force_call = _forced_call(choice, tools or [])
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        if force_call is not None:
            raise InvalidRequest("'response_format' cannot be combined with a required or named 'tool_choice'",
                                 param="response_format")
        common["sampling"]["json_schema"] = schema
    return CallRequest(kind="chat", messages=parse_messages(body["messages"]), prompt=None, tools=tools or None,
                       parse_tools=bool(tools) and choice != "none", top_logprobs=body.get("top_logprobs") or 0,
                       force_call=force_call, **common)


def _response_schema(value: Any) -> str | None:
    """``response_format`` as SGLang's ``json_schema`` sampling parameter (constrained decoding), as
    SGLang's own OpenAI server maps it: ``json_object`` is any object."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return '{"type": "object"}'
    spec = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        return json.dumps(spec.get("schema", {}))
    raise InvalidRequest(f"Invalid 'response_format': {str(value)[:200]}; expected {{'type': 'text'}}, "
                         "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', 'schema'}}",
                         param="response_format", code="invalid_value")


def _forced_call(choice: Any, tools: list[dict[str, Any]]) -> str | None:
    """``tool_choice``: None for none/auto; ``""`` for required (some tool); a tool's name for a named choice."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        name = ""
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
    else:
        raise InvalidRequest(f"Invalid value for 'tool_choice': {choice!r}; expected 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", param="tool_choice", code="invalid_value")
    names = [t["function"]["name"] for t in tools]
    if not names:
        raise InvalidRequest("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                             "specified", param="tool_choice", code="invalid_value")
    if name and name not in names:
        raise InvalidRequest(f"Invalid value for 'tool_choice': no tool named {name!r} in 'tools' ({names})",
                             param="tool_choice", code="invalid_value")
    return name


def parse_completion(body: Any) -> CallRequest:
    common = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty string (token and batch prompts are not supported "
                             "per session)", param="prompt")
    # The legacy API's logprobs is a count: the sampled tokens' logprobs and, at each position, the
    # ``logprobs`` most likely tokens (0 to 5).
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5):
        raise InvalidRequest(f"Invalid 'logprobs': {top!r} must be an integer between 0 and 5 (the legacy "
                             "completions API counts the most likely tokens to list)", param="logprobs",
                             code="invalid_value")
    return CallRequest(kind="text", messages=None, prompt=prompt, tools=None, parse_tools=False,
                       top_logprobs=top or 0, **common)


# ---- responses ----------------------------------------------------------------------------


def finish_reason(engine_reason: str, reply: ParsedReply | None) -> str:
    if reply is not None and reply.tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def logprobs_content(tokens: list[str], logprobs: list[float],
                     tops: list[list[tuple[str, float]]] | None = None) -> dict[str, Any]:
    """Chat ``logprobs``: each sampled token, and (``top_logprobs``) the most likely tokens at its position."""
    tops = tops or [[] for _ in tokens]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": list(tt.encode())} for tt, tlp in top]}
                        for t, lp, top in zip(tokens, logprobs, tops)], "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_message(reply: ParsedReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in reply.tool_calls]
    return message


def envelope(kind: str, call_id: str, model: str, choices: list[dict[str, Any]], *, chunk: bool = False,
             usage_: dict[str, int] | None = None) -> dict[str, Any]:
    obj = {"chat": "chat.completion.chunk" if chunk else "chat.completion", "text": "text_completion"}[kind]
    body: dict[str, Any] = {"id": call_id, "object": obj, "created": int(time.time()), "model": model,
                            "choices": choices, "system_fingerprint": None}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body
