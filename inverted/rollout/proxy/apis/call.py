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

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Callable, overload

from inverted.errors import InvalidRequest, ServiceError
from inverted.rollout.chat import THINK_CLOSE, THINK_OPEN, Message, ParsedReply, split_reasoning
from inverted.rollout.proxy.hosted import Ask, HostedCall, Round

NUMERIC = {  # name: (type, low, high) for implemented scalar parameters
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "n": (int, 1, 16),
    "seed": (int, None, None),
    "max_tokens": (int, 1, None),
    "max_completion_tokens": (int, 1, None),
    "max_output_tokens": (int, 1, None),
    "top_logprobs": (int, 0, 20),
    "top_k": (int, -1, None),
    "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 0.0, 2.0),
    "min_tokens": (int, 0, None),
}
ENGINE_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
}
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
    # A thinking mode asked for, as (the fields that asked, on): on a template with a switch (Qwen3's
    # ``enable_thinking``) it sets it; on one without, the fields join ``accepted`` (``Recorder._thinking``).
    thinking: tuple[tuple[str, ...], bool] | None = None
    # The request field ``max_tokens`` came from (``max_completion_tokens``, ``max_output_tokens``, ...):
    # a limit past the context left is cut to it, and the turn says so under this name.
    max_tokens_field: str = "max_tokens"
    on_recorded: Callable[[Answer], None] | None = None  # run once the call is recorded (Responses' store)
    # Hosted tools the request declared (``hosted``); those the proxy offers, by the name the model is
    # shown (``hosted_names``: name -> kind, set by ``Recorder.offer``); at most this many calls of them.
    hosted: list[Ask] = field(default_factory=list)
    hosted_names: dict[str, str] = field(default_factory=dict)
    hosted_limit: int | None = None
    # A hosted round's follow-up: the caller's own history and the reply text it was shown before this
    # round (``Turn.echo``).
    shown: tuple[Any, str] | None = None

    @property
    def chat(self) -> list[Message]:
        """A chat call's messages (``kind == "chat"``)."""
        assert self.messages is not None, "a text call has no messages"
        return self.messages

    @property
    def text(self) -> str:
        """A text call's prompt (``kind == "text"``)."""
        assert self.prompt is not None, "a chat call has no prompt"
        return self.prompt


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely tokens at this position, when asked for


@dataclass(slots=True)
class Output:
    """One finished choice."""

    index: int
    text: str  # all the decoded text, up to a stop string, after ``Choice.lead`` (an open think block, a forced call)
    reply: ParsedReply  # the text as content and tool calls
    finish: str  # "stop" | "length" | "tool_calls"
    stop: str | None  # the stop string that ended it
    tokens: int  # how many were sampled
    logprobs: list[TokenLogprob] | None  # when asked for
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    hosted: dict[str, HostedCall] = field(default_factory=dict)  # its hosted calls, run (by call id)
    rounds: list[Round] = field(default_factory=list)  # the replies before it whose hosted calls ran

    @property
    def all_tokens(self) -> int:
        """Tokens sampled for this choice over the whole call, hosted rounds included."""
        return self.tokens + sum(r.tokens for r in self.rounds)


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
        return sum(o.all_tokens for o in self.outputs)

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens the server reused (the first choice's: the others share its prompt)."""
        return min((o.index, o.cached_tokens) for o in self.outputs)[1] if self.outputs else 0


@dataclass(slots=True)
class Delta:
    """Streamed text of choice ``index``: safe to show (no part of a tool call or a stop string)."""

    index: int
    text: str


@dataclass(slots=True)
class Hosted:
    """Streamed: a reply of choice ``index`` whose hosted calls ran; the model samples again after it."""

    index: int
    round: Round


Event = Answer | Delta | Hosted | Output


async def opened(stream: AsyncIterator[Event]) -> Answer:
    """A call's stream opens with its ``Answer``, which every later event belongs to."""
    first = await anext(stream)
    if not isinstance(first, Answer):
        raise TypeError(f"a call's stream opens with its Answer, not a {type(first).__name__}")
    return first


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
            exc.status, "invalid_request_error"
        )
        return Failure(exc.status, kind, str(exc), exc.param, exc.code)
    if isinstance(exc, ServiceError) and exc.status is not None and 400 <= exc.status < 500:
        # The engine refused what we sent (e.g. a sampling value it does not support): the caller's request.
        message: str | None = exc.body
        try:
            body = json.loads(exc.body)
            message = (
                (body.get("error") or {}).get("message")
                if isinstance(body.get("error"), dict)
                else body.get("message") or body.get("error") or exc.body
            )
        except (ValueError, AttributeError):
            pass
        return Failure(
            400, "invalid_request_error", f"the rollout server rejected the request: {message}", code="engine_rejected"
        )
    return Failure(503, "server_error", f"rollout servers unavailable: {exc}", code="unavailable")


# ---- a thinking model's reasoning -----------------------------------------------------------

# Signs the reasoning this proxy returns (Anthropic's thinking ``signature``, Responses'
# ``encrypted_content``), so that reasoning sent back can be told from reasoning written elsewhere.
# One key per process: a restarted proxy reads its earlier signatures as foreign.
_SIGNING_KEY = secrets.token_bytes(32)


def sign(reasoning: str) -> str:
    return base64.b64encode(hmac.digest(_SIGNING_KEY, reasoning.encode(), hashlib.sha256)).decode()


def signed(reasoning: str, signature: Any) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(signature, sign(reasoning))


FOREIGN_REASONING = (
    "reasoning signed elsewhere (a conversation begun on another service, or before this proxy "
    "restarted) is rendered as the message's reasoning, as plain text"
)


class ReasoningStream:
    """Splits a reply's text, as it streams, into its reasoning and its answer the way
    ``split_reasoning`` splits the whole: ``feed`` takes the next piece, and gives back the new
    text of each, holding back what may still be a tag or the whitespace around one."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = {True: 0, False: 0}  # reasoning?, characters sent

    def feed(self, piece: str) -> list[tuple[bool, str]]:
        self.text += piece
        stripped = self.text.lstrip()
        if THINK_OPEN.startswith(stripped) and len(stripped) < len(THINK_OPEN):
            return []  # maybe a <think> yet
        if stripped.startswith(THINK_OPEN):
            inner, closed, rest = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
            if closed:
                parts = {True: inner.strip("\n"), False: rest.lstrip("\n")}
            else:
                held = next((k for k in range(len(THINK_CLOSE) - 1, 0, -1) if inner.endswith(THINK_CLOSE[:k])), 0)
                parts = {True: inner[: len(inner) - held].lstrip("\n").rstrip("\n"), False: ""}
        else:
            parts = {True: "", False: self.text}
        out = []
        for reasoning in (True, False):
            new = parts[reasoning][self.sent[reasoning] :]
            if new:
                out.append((reasoning, new))
                self.sent[reasoning] += len(new)
        return out


@overload
def reasoning_of(content: str) -> tuple[str | None, str]: ...
@overload
def reasoning_of(content: None) -> tuple[None, None]: ...
def reasoning_of(content: str | None) -> tuple[str | None, str | None]:
    """A reply's content as its reasoning and its answer (None stays None)."""
    if content is None:
        return None, None
    return split_reasoning(content)


# ---- checks every API shares ----------------------------------------------------------------

MAX_TOKENS_REASON = (
    "the reply's limit is past the context left after the prompt: it may use what is left, as "
    "the API answers when the reply reaches it"
)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort(value: Any, param: str) -> bool:
    """Whether a reasoning effort asks for thinking: ``none`` is off, any other level on."""
    if value not in EFFORTS:
        raise InvalidRequest(
            f"Invalid value for '{param}': {value!r}; expected one of {list(EFFORTS)}",
            param=param,
            code="invalid_value",
        )
    return value != "none"


# Chat Completions fields, each a provider's spelling of a thinking switch, that harnesses send by default.
THINKING_SWITCHES = ("reasoning_effort", "thinking", "enable_thinking", "chat_template_kwargs", "reasoning")
OPENROUTER_REASONS = {  # the rest of OpenRouter's ``reasoning`` object
    "max_tokens": "a thinking budget is not enforced: max_tokens bounds the whole reply, thinking included",
    "exclude": "the reasoning is part of the reply's text here, as the template renders it",
}


def thinking_switch(req: CallRequest, body: dict[str, Any]) -> None:
    """The thinking mode a Chat request asks for, in whichever provider's spelling it came:

    - ``reasoning_effort``: OpenAI's (``none`` is off);
    - ``thinking: {type: enabled | disabled | auto}``: Moonshot's (Kimi CLI sends ``disabled`` by
      default), DeepSeek's and GLM's;
    - ``enable_thinking: bool``: DashScope's (Qwen) and SiliconFlow's;
    - ``chat_template_kwargs: {enable_thinking | thinking: bool}``: vLLM's and SGLang's own (other
      template arguments would change the prompt, and are refused by name);
    - ``reasoning: {effort | enabled, ...}``: OpenRouter's.

    Several that agree are one switch; several that disagree are refused, since either reading
    would change what is sampled. ``Recorder._thinking`` then sets the template's switch, or
    accepts the field with its reason on a template without one.
    """
    asked: list[tuple[str, bool]] = []
    if body.get("reasoning_effort") is not None:
        asked.append(("reasoning_effort", effort(body["reasoning_effort"], "reasoning_effort")))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "auto"):
            raise InvalidRequest(
                f"Invalid value for 'thinking': {thinking!r}; expected {{'type': 'enabled' | 'disabled' | 'auto'}}",
                param="thinking",
                code="invalid_value",
            )
        asked.append(("thinking", kind != "disabled"))
        if thinking.get("budget_tokens") is not None:
            req.accepted["thinking.budget_tokens"] = OPENROUTER_REASONS["max_tokens"]
    if body.get("enable_thinking") is not None:
        if not isinstance(body["enable_thinking"], bool):
            raise InvalidRequest(
                "Invalid type for 'enable_thinking': expected a boolean", param="enable_thinking", code="invalid_type"
            )
        asked.append(("enable_thinking", body["enable_thinking"]))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise InvalidRequest(
                "'chat_template_kwargs' must be an object", param="chat_template_kwargs", code="invalid_type"
            )
        for key, value in kwargs.items():
            if key not in ("enable_thinking", "thinking") or not isinstance(value, bool):
                raise InvalidRequest(
                    f"'chat_template_kwargs.{key}' = {value!r} is not supported by this server: it "
                    "would change the prompt (supported: enable_thinking or thinking, a boolean)",
                    param=f"chat_template_kwargs.{key}",
                    code="unsupported_parameter",
                )
            asked.append((f"chat_template_kwargs.{key}", value))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "enabled", *OPENROUTER_REASONS}:
            raise InvalidRequest(
                f"Invalid value for 'reasoning': {reasoning!r}; expected OpenRouter's {{effort, "
                "enabled, max_tokens, exclude}",
                param="reasoning",
                code="invalid_value",
            )
        if reasoning.get("effort") is not None:
            asked.append(("reasoning.effort", effort(reasoning["effort"], "reasoning.effort")))
        if reasoning.get("enabled") is not None:
            asked.append(("reasoning.enabled", bool(reasoning["enabled"])))
        accept(req.accepted, reasoning, OPENROUTER_REASONS, "reasoning.")
    if len({on for _, on in asked}) > 1:
        raise InvalidRequest(
            f"thinking switches disagree: {', '.join(f'{k}={v}' for k, v in asked)}",
            param=asked[0][0],
            code="invalid_value",
        )
    if asked:
        req.thinking = (tuple(k for k, _ in asked), asked[0][1])


def accept(accepted: dict[str, str], body: dict[str, Any], reasons: dict[str, str], prefix: str = "") -> None:
    """Note each field of ``body`` that ``reasons`` accepts without effect (a null one is absent)."""
    for name, reason in reasons.items():
        if body.get(name) is not None:
            accepted[prefix + name] = reason


def number(name: str, value: Any, bounds: tuple[type, float | None, float | None] | None = None) -> Any:
    kind, low, high = bounds or NUMERIC[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok:
        raise InvalidRequest(
            f"Invalid type for '{name}': expected {'a number' if kind is float else 'an integer'}, got {value!r}",
            param=name,
            code="invalid_type",
        )
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


def forced_call(
    mode: str, name: str | None, tools: list[dict[str, Any]] | None, param: str = "tool_choice"
) -> str | None:
    """A tool choice (``none``, ``auto``, ``required`` or ``named``) as ``CallRequest.force_call``.

    ``required`` with a single tool is that tool named: the only call the model may make, so its
    name is written too, as for a named choice, and the model samples the arguments alone."""
    if mode in ("none", "auto"):
        return None
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise InvalidRequest(
            f"Invalid value for '{param}': '{param}' is only allowed when 'tools' are specified",
            param=param,
            code="invalid_value",
        )
    if mode == "named" and name not in names:
        raise InvalidRequest(
            f"Invalid value for '{param}': no tool named {name!r} in 'tools' ({names})",
            param=param,
            code="invalid_value",
        )
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
        req.max_tokens_field = "sampling_params.max_tokens"


def check_overrides(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - OVERRIDES)
    if unknown:
        raise InvalidRequest(
            f"{unknown[0]!r} cannot be set for a whole session; these can: {sorted(OVERRIDES)}",
            param=unknown[0],
            code="unrecognized_argument",
        )
    for name in ("max_tokens", "max_completion_tokens"):
        if overrides.get(name) is not None:
            number(name, overrides[name])
    sampling(overrides)


def finish_reason(engine_reason: str, reply: ParsedReply | None) -> str:
    if reply is not None and reply.tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"
