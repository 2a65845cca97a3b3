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
- ``HermesToolParser``: Qwen/Hermes ``<tool_call>{"name", "arguments"}</tool_call>`` blocks in the
  sampled text become OpenAI ``tool_calls``. Parsers are plug-ins (``--proxy-tool-parser-path``):
  a class with a ``start`` marker (so streaming can hold tool-call text back) and ``parse``.

Nothing here does I/O; the proxy's service calls it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

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
        try:
            return json.dumps(json.loads(self.arguments), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return self.arguments

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def key(self) -> tuple:
        """What must match for a client's message to be the one recorded (ids excluded: some SDKs remint them)."""
        return (self.role, self.content, tuple((c.name, c.canonical_arguments) for c in self.tool_calls), self.name)

    def to_template(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            data["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                                  for c in self.tool_calls]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            data["name"] = self.name
        return data


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
                raise InvalidRequest(f"content part of type {kind!r} is not supported: this model reads text parts only",
                                     param=f"{where}.content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"expected a string or a list of text parts, got {type(content).__name__}",
                         param=f"{where}.content")


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


def parse_messages(raw: Any) -> list[Message]:
    """Validate an OpenAI ``messages`` array; raise ``InvalidRequest`` naming the first bad field."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    messages: list[Message] = []
    called: set[str] = set()
    for i, item in enumerate(raw):
        where = f"messages.[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"expected an object, got {type(item).__name__}", param=where)
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"Invalid value: {role!r}. Supported values are: {', '.join(map(repr, ROLES))}.",
                                 param=f"{where}.role", code="invalid_value")
        content = item.get("content")
        calls = _tool_calls(item.get("tool_calls"), where) if role == "assistant" else ()
        if content is None and not (role == "assistant"):
            raise InvalidRequest(f"messages with role {role!r} must have content", param=f"{where}.content")
        text = "" if content is None else _text(content, where)
        tool_call_id = item.get("tool_call_id")
        if role == "tool":
            if tool_call_id not in called:
                raise InvalidRequest("messages with role 'tool' must be a response to a preceding message with "
                                     f"'tool_calls'; no call has id {tool_call_id!r}", param=f"{where}.tool_call_id")
        called.update(c.id for c in calls)
        name = item.get("name") if isinstance(item.get("name"), str) else None
        # OpenAI's newer 'developer' role is the system role for every open chat template.
        messages.append(Message(role="system" if role == "developer" else role, content=text, tool_calls=calls,
                                tool_call_id=tool_call_id if role == "tool" else None, name=name))
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

    def render(self, messages: list[Message], tools: list[dict] | None, *, generation_prompt: bool,
               thinking: bool | None = None) -> str:
        """``thinking``: the template's ``enable_thinking`` (Qwen3's switch), where it has one; None leaves
        the template's default."""
        if tools and not self.renders_tools:
            # Rendered anyway, the tools would silently vanish: the model would answer without them.
            raise InvalidRequest(f"the chat template of {self.tokenizer.name_or_path or 'this model'} cannot render "
                                 "tools (SmolLM2's, for one, has no tool support); send the request without "
                                 "'tools', or serve a model whose template renders them", param="tools")
        switch = {"enable_thinking": thinking} if thinking is not None and self.thinking_switch else {}
        return self.tokenizer.apply_chat_template([m.to_template() for m in messages], tools=tools or None,
                                                  tokenize=False, add_generation_prompt=generation_prompt, **switch)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None, *,
                   thinking: bool | None = None) -> list[int]:
        """A branch's first prompt: the whole conversation, rendered and tokenized once."""
        return self.encode(self.render(messages, tools, generation_prompt=True, thinking=thinking))

    def bridge(self, history: list[Message], new: list[Message], tools: list[dict] | None,
               sampled_ids: list[int], *, thinking: bool | None = None) -> list[int]:
        """Ids to append after ``sampled_ids`` (the last assistant turn) for the ``new`` messages."""
        before = self.render(history, tools, generation_prompt=False, thinking=thinking)
        after = self.render(history + new, tools, generation_prompt=True, thinking=thinking)
        if not after.startswith(before) or not before.endswith(self.turn_end):
            raise TemplateBreak("the rendered history is not a prefix of the next render")
        junction = self.turn_end
        last = self.tokenizer.decode(sampled_ids[-1:], skip_special_tokens=False) if sampled_ids else ""
        if last and junction.startswith(last):
            junction = junction[len(last):]
        return self.encode(junction + after[len(before):])

    def _renders_tools(self) -> bool:
        """Whether the template writes a tool's definition into the prompt at all."""
        tool = {"type": "function", "function": {"name": "inverted_probe_tool", "description": "",
                                                 "parameters": {"type": "object", "properties": {}}}}
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": "u"}], tools=[tool], tokenize=False,
                                                  add_generation_prompt=True)
        return "inverted_probe_tool" in text

    def _has_thinking_switch(self) -> bool:
        """Whether the template reads ``enable_thinking`` (Qwen3's): its generation prompt differs by it."""
        probe = [{"role": "user", "content": "u"}]
        on, off = (self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=flag) for flag in (True, False))
        return on != off

    def _assistant_turn_end(self) -> str:
        """The text the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``)."""
        probe = [Message(role="user", content="u"), Message(role="assistant", content=_SENTINEL)]
        text = self.render(probe, None, generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError("the chat template does not render assistant content verbatim")
        return text[text.index(_SENTINEL) + len(_SENTINEL):]


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
            calls.append(ToolCall(id=new_call_id(), name=obj["name"],
                                  arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
        content = text[:at].rstrip()
        return ParsedReply(content=content or None, tool_calls=calls)
