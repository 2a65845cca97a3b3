"""A call, whichever API it came by: the request every API is normalised to, and what the recorder answers.

Each API module (``openai_chat``, ``anthropic_messages``, ...) parses its own request body into a
``CallRequest`` (chat messages and tools in one internal form, SGLang sampling parameters) and
shapes the recorder's ``Answer`` (or its stream of ``Answer``, ``Delta`` and ``Output`` events)
into its own response. So the recording path is one, and the same conversation gives the same
Sample whichever API an agent spoke.

Also here: the checks every API shares (sampling numbers, stop strings, a forced tool call, a
JSON schema to constrain the reply with) and the session's ``sampling_params`` overrides.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from inverted.errors import InvalidRequest, ServiceError
from inverted.rollout.chat import Message, ParsedReply

NUMERIC = {  # name: (type, low, high) for implemented scalar parameters
    "temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "n": (int, 1, 16), "seed": (int, None, None),
    "max_tokens": (int, 1, None), "max_completion_tokens": (int, 1, None), "max_output_tokens": (int, 1, None),
    "top_logprobs": (int, 0, 20), "top_k": (int, -1, None), "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 0.0, 2.0), "min_tokens": (int, 0, None),
}
ENGINE_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}
# What a session's ``sampling_params`` may set for every call of the session, whatever its API.
OVERRIDES = set(ENGINE_NAMES) | {"stop", "max_tokens", "max_completion_tokens"}


@dataclass(slots=True)
class CallRequest:
    """A validated call, in one form for every API."""

    kind: str  # "chat" (messages) | "text" (a raw prompt: legacy completions)
    model: str | None
    messages: list[Message] | None
    prompt: str | None
    tools: list[dict[str, Any]] | None  # in Chat Completions' form, as the chat template renders them
    parse_tools: bool
    stream: bool
    max_tokens: int | None
    sampling: dict[str, Any]  # SGLang sampling_params, without max_new_tokens (set from the context left)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # the k most likely tokens at each sampled position
    force_call: str | None = None  # tool_choice: "" = some tool (required), a name = that tool, None = free
    include_usage: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # the API's own request fields its answer repeats
    # Fields taken without effect, each with why (``field: reason``); every turn of the call records them.
    accepted: dict[str, str] = field(default_factory=dict)
    # A thinking mode asked for, as (field, on): on a template with a switch (Qwen3's ``enable_thinking``)
    # it sets it; on one without, the field joins ``accepted`` (``Recorder._thinking``).
    thinking: tuple[str, bool] | None = None
    clamp_max_tokens: bool = False  # a max_tokens past the context left is cut to it (and said), not refused
    on_recorded: Callable[[Answer], None] | None = None  # run once the call is recorded (Responses' store)


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely tokens at this position, when asked for


@dataclass(slots=True)
class Output:
    """One finished choice."""

    index: int
    text: str  # all the decoded text, up to a stop string (and after a forced call's opening)
    reply: ParsedReply  # the text as content and tool calls
    finish: str  # "stop" | "length" | "tool_calls"
    stop: str | None  # the stop string that ended it
    tokens: int  # how many were sampled
    logprobs: list[TokenLogprob] | None  # when asked for
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache


@dataclass(slots=True)
class Answer:
    """A call's answer. Streamed, it comes first with no outputs, and each ``Output`` joins it as it ends."""

    model: str
    prompt_tokens: int
    outputs: list[Output] = field(default_factory=list)
    id: str = field(default_factory=lambda: secrets.token_hex(12))  # each API adds its prefix
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completion_tokens(self) -> int:
        return sum(o.tokens for o in self.outputs)

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens the server reused (the first choice's: the others share its prompt)."""
        return min((o.index, o.cached_tokens) for o in self.outputs)[1] if self.outputs else 0


@dataclass(slots=True)
class Delta:
    """Streamed text of choice ``index``: safe to show (no part of a tool call or a stop string)."""

    index: int
    text: str


Event = Answer | Delta | Output


@dataclass(slots=True)
class Failure:
    """An error in neutral terms; each API writes it in its own body."""

    status: int
    type: str  # OpenAI's names: invalid_request_error, authentication_error, permission_error, not_found_error, ...
    message: str
    param: str | None = None
    code: str | None = None


def failure(exc: Exception) -> Failure:
    """What to answer for an error a call raised."""
    if isinstance(exc, InvalidRequest):
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            exc.status, "invalid_request_error")
        return Failure(exc.status, kind, str(exc), exc.param, exc.code)
    if isinstance(exc, ServiceError) and exc.status is not None and 400 <= exc.status < 500:
        # The engine refused what we sent (e.g. a sampling value it does not support): the caller's request.
        message = exc.body
        try:
            body = json.loads(exc.body)
            message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) \
                else body.get("message") or body.get("error") or exc.body
        except (ValueError, AttributeError):
            pass
        return Failure(400, "invalid_request_error", f"the rollout server rejected the request: {message}",
                       code="engine_rejected")
    return Failure(503, "server_error", f"rollout servers unavailable: {exc}", code="unavailable")


# ---- checks every API shares ----------------------------------------------------------------

MAX_TOKENS_REASON = "the reply's limit is past the context left after the prompt: it may use what is left"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort(value: Any, param: str) -> bool:
    """Whether a reasoning effort asks for thinking: ``none`` is off, any other level on."""
    if value not in EFFORTS:
        raise InvalidRequest(f"Invalid value for '{param}': {value!r}; expected one of {list(EFFORTS)}", param=param,
                             code="invalid_value")
    return value != "none"


def accept(accepted: dict[str, str], body: dict[str, Any], reasons: dict[str, str], prefix: str = "") -> None:
    """Note each field of ``body`` that ``reasons`` accepts without effect (a null one is absent)."""
    for name, reason in reasons.items():
        if body.get(name) is not None:
            accepted[prefix + name] = reason


def number(name: str, value: Any, bounds: tuple[type, float | None, float | None] | None = None) -> Any:
    kind, low, high = bounds or NUMERIC[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok:
        raise InvalidRequest(f"Invalid type for '{name}': expected {'a number' if kind is float else 'an integer'}, "
                             f"got {value!r}", param=name, code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds_ = f"at least {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequest(f"Invalid '{name}': {value!r} must be {bounds_}", param=name, code="invalid_value")
    return value


def stops(value: Any, name: str = "stop", most: int = 4) -> list[str] | None:
    if value is None:
        return None
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not all(isinstance(s, str) and s for s in found) or len(found) > most:
        raise InvalidRequest(f"'{name}' must be a non-empty string or an array of up to {most} of them", param=name)
    return found or None


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang sampling parameters from a request's sampling fields (``ENGINE_NAMES``) and ``stop``."""
    params = {engine: number(name, body[name]) for name, engine in ENGINE_NAMES.items() if body.get(name) is not None}
    found = stops(body.get("stop"))
    if found:
        params["stop"] = found
    return params


def before_stop(text: str, stop_strings: list[str]) -> str:
    """The text up to the first stop string in it (the stop string left out)."""
    found = first_stop(text, stop_strings)
    return text[: text.find(found)] if found is not None else text


def first_stop(text: str, stop_strings: list[str]) -> str | None:
    """The stop string that ended ``text``: the first in the text, not in the list. One sampled token
    may complete several, and SGLang names the first in the request's list."""
    found = [(text.find(s), s) for s in stop_strings if s in text]
    return min(found)[1] if found else None


def forced_call(mode: str, name: str | None, tools: list[dict[str, Any]] | None,
                param: str = "tool_choice") -> str | None:
    """A tool choice (``none``, ``auto``, ``required`` or ``named``) as ``CallRequest.force_call``.

    ``required`` with a single tool is that tool named: the only call the model may make, so its
    name is written too, as for a named choice, and the model samples the arguments alone."""
    if mode in ("none", "auto"):
        return None
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise InvalidRequest(f"Invalid value for '{param}': '{param}' is only allowed when 'tools' are specified",
                             param=param, code="invalid_value")
    if mode == "named" and name not in names:
        raise InvalidRequest(f"Invalid value for '{param}': no tool named {name!r} in 'tools' ({names})", param=param,
                             code="invalid_value")
    if mode == "required" and len(names) == 1:
        return names[0]
    return name if mode == "named" else ""


def constrain(req: CallRequest, schema: dict[str, Any] | None, param: str) -> None:
    """Constrain the reply to JSON matching ``schema`` (SGLang's ``json_schema`` sampling parameter)."""
    if schema is None:
        return
    if req.force_call is not None:
        raise InvalidRequest(f"'{param}' cannot be combined with a required or named tool choice", param=param)
    req.sampling["json_schema"] = json.dumps(schema)


def function_tool(name: Any, description: Any, parameters: Any, where: str, strict: Any = None) -> dict[str, Any]:
    """A tool in Chat Completions' form, the one the chat template renders, whatever API declared it,
    so that one tool renders the same tokens from every API. ``strict`` is checked and not rendered
    from any of them: it asks the server to hold the arguments to the schema, it is not something
    the model reads (and the proxy does not constrain tool arguments)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("a function tool needs a 'name'", param=f"{where}.name")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest("a tool's parameters must be a JSON schema object", param=f"{where}.parameters")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("a tool's 'strict' must be true or false", param=f"{where}.strict")
    function: dict[str, Any] = {"name": name}
    if isinstance(description, str):
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def apply_overrides(req: CallRequest, overrides: dict[str, Any]) -> None:
    """A session's ``sampling_params`` replace the call's own (e.g. the rollout's temperature)."""
    if not overrides:
        return
    req.sampling.update(sampling(overrides))
    limit = overrides.get("max_completion_tokens") or overrides.get("max_tokens")
    if limit is not None:
        req.max_tokens = number("max_tokens", limit)


def check_overrides(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - OVERRIDES)
    if unknown:
        raise InvalidRequest(f"{unknown[0]!r} cannot be set for a whole session; these can: {sorted(OVERRIDES)}",
                             param=unknown[0], code="unrecognized_argument")
    for name in ("max_tokens", "max_completion_tokens"):
        if overrides.get(name) is not None:
            number(name, overrides[name])
    sampling(overrides)


def finish_reason(engine_reason: str, reply: ParsedReply | None) -> str:
    if reply is not None and reply.tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"
