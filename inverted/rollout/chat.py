"""Chat messages to token ids for the proxy, without ever re-encoding a token the policy sampled.

The proxy owns each session's token history (token-in, token-out). Three jobs live here:

- ``parse_messages`` checks an OpenAI ``messages`` list where it enters (roles, content parts,
  tool calls, a ``tool`` message answering a call that was made) and returns ``Message`` values,
  whose ``key`` compares what a client echoes back with what was sent (tool-call ids and JSON
  key order do not matter; text does).
- ``ChatRenderer`` renders with the checkpoint's own chat template. The first turn of a branch is
  a full render; every later turn is a **bridge**: the text the template appends for the new
  messages (render of history + new, minus render of history, which must be a prefix: the
  template has to be append-only, checked every time), preceded by the *junction*, the part of the
  template's end-of-assistant-turn text that the sampled ids do not already hold (for ChatML the
  ``\\n`` after a sampled ``<|im_end|>``; all of ``<|im_end|>\\n`` after a turn cut by
  ``max_tokens``). Only that bridge text is tokenized; earlier ids are reused as they are. A
  request with ``tools`` to a template that does not render tools (SmolLM2's) is refused with a
  400 naming the model, rather than shown to the model without them.
  The two renders cover a **window** of the history, not all of it, so a turn costs the same at
  turn 200 as at turn 2: the leading system messages (the tools render there), the last user
  message before the last assistant turn (templates such as Qwen3's look for the latest query),
  and that turn on. A template whose appended text depends on more (a counter over the whole
  conversation, say) is found by ``window_is_exact``, which bridges probe conversations both ways
  when the renderer is made; such a template keeps the whole-history render.
- ``HermesToolParser``: Qwen/Hermes ``<tool_call>{"name", "arguments"}</tool_call>`` blocks in the
  sampled text become OpenAI ``tool_calls``. Parsers are plug-ins (``--proxy-tool-parser-path``):
  a class with a ``start`` marker (so streaming can hold tool-call text back) and ``parse``.

Nothing here does I/O; the proxy's service calls it.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2

from inverted.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "\x00inverted-sentinel\x00"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text as the client (or the model) wrote it

    @property
    def canonical_arguments(self) -> str:
        """Key order and spacing do not matter when a client echoes a call back."""
        return _canonical_json(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # What must match for a client's message to be the one recorded (ids excluded: some SDKs remint
    # them). Made once: every later request of the session compares it again.
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        calls = tuple((c.name, c.canonical_arguments) for c in self.tool_calls)
        # A reply's reasoning does not name it: clients send a thinking model's reply back with its
        # reasoning (Anthropic, Responses) or without it (most Chat clients), and either is that reply.
        content = split_reasoning(self.content)[1] if self.role == "assistant" else self.content
        object.__setattr__(self, "key", (self.role, content, calls, self.name))

    def to_template(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            data["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            data["name"] = self.name
        return data


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A reply's reasoning and its answer: the ``<think>`` block it opens with (or that its template
    opened in the generation prompt: text up to a ``</think>`` with no ``<think>`` before it), and the
    rest; (None, text) without one. Each API returns the reasoning in its own channel."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        inner, closed, rest = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
        return (inner.strip("\n"), rest.lstrip("\n")) if closed else (inner.strip("\n"), "")
    before, closed, rest = text.partition(THINK_CLOSE)
    if closed and THINK_OPEN not in before:
        return before.strip("\n"), rest.lstrip("\n")
    return None, text


def join_reasoning(reasoning: str | None, content: str) -> str:
    """A reply sent back with its reasoning apart, as the content the model wrote (Qwen3's layout,
    which its template renders from ``reasoning_content`` too)."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}" if reasoning else content


@functools.lru_cache(maxsize=1 << 16)
def _canonical_json(text: str) -> str:
    """Memoised: every turn's request resends every earlier call, which must not cost a parse each."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return text


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, or a list of text parts (other part types are not supported here)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(
                    f"content part of type {kind!r} is not supported: this model reads text parts only",
                    param=f"{where}.content[{j}]",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(
        f"expected a string or a list of text parts, got {type(content).__name__}", param=f"{where}.content"
    )


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequest("expected an array of tool calls", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("expected {id, type: 'function', function: {name, arguments}}", param=at)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(ToolCall(id=call["id"], name=fn["name"], arguments=arguments))
    return tuple(calls)


class ParsedMessages:
    """The messages array a session sent last, as sent and as parsed. The API is stateless, so the
    next request resends all of it: with this, ``parse_messages`` reads only what was appended."""

    __slots__ = ("raw", "messages", "called")

    def __init__(self) -> None:
        self.raw: list[Any] = []
        self.messages: list[Message] = []
        self.called: set[str] = set()  # the tool-call ids the messages made, which tool messages answer


def parse_messages(raw: Any, last: ParsedMessages | None = None) -> list[Message]:
    """Validate an OpenAI ``messages`` array; raise ``InvalidRequest`` naming the first bad field.
    With ``last``, a request that begins with exactly the array ``last`` holds parses only the rest,
    and ``last`` then holds this one."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    messages: list[Message] = []
    called: set[str] = set()
    start = 0
    if last is not None and last.raw and len(raw) >= len(last.raw) and raw[: len(last.raw)] == last.raw:
        start, messages, called = len(last.raw), list(last.messages), set(last.called)
    for i in range(start, len(raw)):
        item, where = raw[i], f"messages.[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"expected an object, got {type(item).__name__}", param=where)
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"Invalid value: {role!r}. Supported values are: {', '.join(map(repr, ROLES))}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = item.get("content")
        calls = _tool_calls(item.get("tool_calls"), where) if role == "assistant" else ()
        if content is None and not (role == "assistant"):
            raise InvalidRequest(f"messages with role {role!r} must have content", param=f"{where}.content")
        text = "" if content is None else _text(content, where)
        reasoning = item.get("reasoning_content", item.get("reasoning")) if role == "assistant" else None
        if reasoning is not None and not isinstance(reasoning, str):
            raise InvalidRequest(
                "an assistant message's reasoning_content must be a string", param=f"{where}.reasoning_content"
            )
        text = join_reasoning(reasoning, text)
        tool_call_id = item.get("tool_call_id")
        if role == "tool":
            if tool_call_id not in called:
                raise InvalidRequest(
                    "messages with role 'tool' must be a response to a preceding message with "
                    f"'tool_calls'; no call has id {tool_call_id!r}",
                    param=f"{where}.tool_call_id",
                )
        called.update(c.id for c in calls)
        name = item.get("name") if isinstance(item.get("name"), str) else None
        # OpenAI's newer 'developer' role is the system role for every open chat template.
        messages.append(
            Message(
                role="system" if role == "developer" else role,
                content=text,
                tool_calls=calls,
                tool_call_id=tool_call_id if role == "tool" else None,
                name=name,
            )
        )
    if last is not None:
        last.raw, last.messages, last.called = raw, messages, called
    return messages


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class TemplateBreak(Exception):
    """The chat template is not append-only for this history: the bridge would splice; start a new branch."""


class ChatRenderer:
    """Renders messages with the tokenizer's chat template and tokenizes only what is new."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.turn_end = self._assistant_turn_end()
        self.renders_tools = self._renders_tools()
        self.thinking_switch = self._has_thinking_switch()
        template = getattr(tokenizer, "chat_template", None)
        if template not in _WINDOW_VERDICTS:
            _WINDOW_VERDICTS[template] = self.window_is_exact()
        self.windowed = _WINDOW_VERDICTS[template]

    def render(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        *,
        generation_prompt: bool,
        thinking: bool | None = None,
    ) -> str:
        """``thinking``: the template's ``enable_thinking`` (Qwen3's switch), where it has one; None leaves
        the template's default."""
        if tools and not self.renders_tools:
            # Rendered anyway, the tools would silently vanish: the model would answer without them.
            raise InvalidRequest(
                f"the chat template of {self.tokenizer.name_or_path or 'this model'} cannot render "
                "tools (SmolLM2's, for one, has no tool support); send the request without "
                "'tools', or serve a model whose template renders them",
                param="tools",
            )
        switch = {"enable_thinking": thinking} if thinking is not None and self.thinking_switch else {}
        return self.tokenizer.apply_chat_template(
            [m.to_template() for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **switch,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(
        self, messages: list[Message], tools: list[dict] | None, *, thinking: bool | None = None
    ) -> list[int]:
        """A branch's first prompt: the whole conversation, rendered and tokenized once."""
        return self.encode(self.render(messages, tools, generation_prompt=True, thinking=thinking))

    def bridge(
        self,
        history: list[Message],
        new: list[Message],
        tools: list[dict] | None,
        sampled_ids: list[int],
        *,
        thinking: bool | None = None,
    ) -> list[int]:
        """Ids to append after ``sampled_ids`` (the last assistant turn) for the ``new`` messages."""
        if self.windowed:
            try:
                return self._bridge(window(history), new, tools, sampled_ids, thinking)
            except (TemplateBreak, jinja2.TemplateError):
                pass  # the whole history decides: a break there is real, a window's may not be
        return self._bridge(history, new, tools, sampled_ids, thinking)

    def _bridge(
        self,
        history: list[Message],
        new: list[Message],
        tools: list[dict] | None,
        sampled_ids: list[int],
        thinking: bool | None,
    ) -> list[int]:
        before = self.render(history, tools, generation_prompt=False, thinking=thinking)
        after = self.render(history + new, tools, generation_prompt=True, thinking=thinking)
        if not after.startswith(before) or not before.endswith(self.turn_end):
            raise TemplateBreak("the rendered history is not a prefix of the next render")
        junction = self.turn_end
        last = self.tokenizer.decode(sampled_ids[-1:], skip_special_tokens=False) if sampled_ids else ""
        if last and junction.startswith(last):
            junction = junction[len(last) :]
        return self.encode(junction + after[len(before) :])

    def window_is_exact(self) -> bool:
        """Whether bridging over ``window(history)``, where it gives ids, gives what bridging over the
        whole history does, on probe conversations that exercise what templates keep state for: tool
        loops, parallel calls, several queries, reasoning in the content, with and without a system
        message. (Where the window breaks or raises, ``bridge`` renders the whole history anyway.)"""
        tools = PROBE_TOOLS if self.renders_tools else None
        for conversation in PROBE_CONVERSATIONS:
            messages = parse_messages(conversation)
            turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
            for i, j in zip(turns, turns[1:]):
                history, new = messages[: i + 1], messages[i + 1 : j]
                sampled = self.encode(messages[i].content + self.turn_end)
                try:
                    part = self._bridge(window(history), new, tools, sampled, None)
                except (TemplateBreak, jinja2.TemplateError):
                    continue  # ``bridge`` goes on to the whole history, whatever it says
                try:
                    whole = self._bridge(history, new, tools, sampled, None)
                except jinja2.TemplateError:
                    continue  # the template refuses this history (its earlier turn was refused already)
                except TemplateBreak:
                    return False
                if part != whole:
                    return False
        return True

    def _renders_tools(self) -> bool:
        """Whether the template writes a tool's definition into the prompt at all."""
        tool = {
            "type": "function",
            "function": {
                "name": "inverted_probe_tool",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}], tools=[tool], tokenize=False, add_generation_prompt=True
        )
        return "inverted_probe_tool" in text

    def _has_thinking_switch(self) -> bool:
        """Whether the template reads ``enable_thinking`` (Qwen3's): its generation prompt differs by it."""
        probe = [{"role": "user", "content": "u"}]
        on, off = (
            self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, enable_thinking=flag)
            for flag in (True, False)
        )
        return on != off

    def _assistant_turn_end(self) -> str:
        """The text the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``)."""
        probe = [Message(role="user", content="u"), Message(role="assistant", content=_SENTINEL)]
        text = self.render(probe, None, generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError("the chat template does not render assistant content verbatim")
        return text[text.index(_SENTINEL) + len(_SENTINEL) :]


def window(history: list[Message]) -> list[Message]:
    """What a bridge after ``history`` renders: the leading system messages, the last user message
    before the last assistant turn, and that turn on (see the module docstring)."""
    head = next((i for i, m in enumerate(history) if m.role != "system"), len(history))
    last = next((i for i in range(len(history) - 1, head - 1, -1) if history[i].role == "assistant"), head)
    query = next((i for i in range(last - 1, head - 1, -1) if history[i].role == "user"), None)
    return history[:head] + ([history[query]] if query is not None else []) + history[last:]


_WINDOW_VERDICTS: dict[str | None, bool] = {}  # chat template -> window_is_exact (a property of the template)

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]


def _call(i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "w{i}"}}'}}


def _probe(system: bool, parallel: bool) -> list[dict[str, Any]]:
    calls = [_call(2), _call(3)] if parallel else [_call(2)]
    return ([{"role": "system", "content": "You help."}] if system else []) + [
        {"role": "user", "content": "Find w1."},
        {"role": "assistant", "content": "", "tool_calls": [_call(1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r1"},
        {"role": "assistant", "content": "<think>\nmore\n</think>\n\nNext.", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "r" + c["id"][-1]} for c in calls),
        {"role": "assistant", "content": "<think>\ndone\n</think>\n\nFound."},
        {"role": "user", "content": "And w4?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call(4)]},
        {"role": "tool", "tool_call_id": "call_4", "content": "r4"},
        {"role": "assistant", "content": "Found it."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ]


PROBE_CONVERSATIONS = [_probe(system, parallel) for system in (True, False) for parallel in (True, False)]


# ---- tool calls -------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """The ``--proxy-tool-parser-path`` contract: a no-argument factory of objects like this."""

    start: str  # the text that opens a tool call; streaming holds back anything that may begin it

    def parse(self, text: str) -> ParsedReply: ...

    # Optional: ``forced(name)``, the text that opens a call of tool ``name`` (of any tool when
    # ``name`` is ""). With it, ``tool_choice`` required or named is served by writing that text
    # after the generation prompt; without it, such a call is refused.


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class HermesToolParser:
    """Qwen2.5/Qwen3/Hermes format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def forced(self, name: str) -> str:
        # Cut where the tokenizer splits the whole call anyway (before ' {"'), so that the model
        # continues from the tokens it would have sampled itself.
        return self.start + (f'\n{{"name": {json.dumps(name)}, "arguments":' if name else "")

    def parse(self, text: str) -> ParsedReply:
        at = text.find(self.start)
        if at < 0:
            return ParsedReply(content=text)
        calls = []
        for match in self._block.finditer(text, at):
            try:
                obj = json.loads(match.group(1))
            except ValueError:
                return ParsedReply(content=text)  # not a well-formed call: the model's text, as it is
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedReply(content=text)
            arguments = obj.get("arguments", {})
            calls.append(
                ToolCall(
                    id=new_call_id(),
                    name=obj["name"],
                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
                )
            )
        content = text[:at].rstrip()
        return ParsedReply(content=content or None, tool_calls=calls)
