"""Hosted tools: the tools a hosted API runs itself (web search, web fetch, file search, code
interpreter), run by the proxy with an implementation the job names, inside the same call.

A hosted API does not hand these calls to the agent: the model calls the tool, the service runs it,
the model reads the result and goes on, all within one response, whose output then holds the call
as an item of its own (Responses' ``web_search_call``, Messages' ``server_tool_use`` and
``web_search_tool_result``). Agents send them by default: Codex declares ``web_search`` for any
model name it does not know. So:

- **configured** (``--proxy-hosted-tools web_search=envs.local_search:search``): the model is shown
  the tool as a function (``DEFINITIONS``) where the request declared it; a call of it is run
  (``HostedTools.run``), its result joins the branch as a tool message (prompt tokens, out of the
  loss), and the call samples again, until the model answers without one, calls one of the agent's
  own tools too (then the answer carries both), or the call's limit of hosted calls is reached;
- **not configured**: the request is served without the tool, and the turn's ``accepted`` names
  the field and says why, so nothing is silent.

An implementation is ``async def f(arguments: dict) -> str | dict`` (or a plain function, run on a
thread), given the arguments the model wrote: the text the model reads, or ``{"text", "sources"}``
with the pages a web search found (``[{"url", "title"}]``), for the API's own output items. A failure is the
call's result (``failed``), as a hosted API reports one, so the model can go on.

The agent sends each hosted call back in its next request in its API's own shape; every call the
proxy ran is kept on the session (``Session.hosted``), so the API modules render it back to the
call and the result the model saw (``recall``), and the next request continues the same branch.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from inverted.errors import InvalidRequest
from inverted.plugins import load_plugin
from inverted.rollout.chat import Message, ParsedReply, ToolCall, join_reasoning

# How the model is shown each kind: a function, its description, and its one argument.
DEFINITIONS: dict[str, tuple[str, str, str]] = {
    "web_search": (
        "web_search",
        "Search the web. Returns the most relevant pages, each with its title, URL and an excerpt.",
        "query",
    ),
    "web_fetch": ("web_fetch", "Fetch a web page by its URL and return its text.", "url"),
    "file_search": ("file_search", "Search the user's files. Returns the most relevant passages.", "query"),
    "code_interpreter": ("code_interpreter", "Run Python code in a sandbox and return what it printed.", "code"),
}
KINDS = tuple(DEFINITIONS)
RUN_TIMEOUT_S = 60.0  # one hosted call; past it the call fails and the model reads why
MAX_CALLS = 8  # hosted calls one API call may run, unless the request sets its own limit (max_tool_calls, max_uses)


@dataclass(frozen=True, slots=True)
class HostedResult:
    """What an implementation returns: the text the model reads, and (web search) the pages found."""

    text: str
    sources: tuple[dict[str, str], ...] = ()  # each {"url", "title"}


@dataclass(slots=True)
class Ask:
    """A hosted tool a request declared: its kind, where (``tools[8]``), and the name the model is shown."""

    kind: str
    where: str
    position: int  # its index among the request's tools, where the model is shown it
    name: str | None = None  # a name the request gives it (Anthropic's tools have one)
    limit: int | None = None  # a limit of calls it sets (Anthropic's max_uses)


@dataclass(slots=True)
class HostedCall:
    """A hosted call the proxy ran (or refused to run, past the limit): what the model saw as its result."""

    kind: str
    call: ToolCall
    result: HostedResult
    status: str  # "completed" | "failed"
    round: tuple[str, ...] = ()  # the ids of every call the model wrote in the same reply, in order

    @property
    def argument(self) -> str:
        """The one argument the model wrote (the query, the URL, the code), or its arguments as written."""
        try:
            written = json.loads(self.call.arguments)
        except ValueError:
            return self.call.arguments
        value = written.get(DEFINITIONS[self.kind][2]) if isinstance(written, dict) else None
        return value if isinstance(value, str) else self.call.arguments

    def message(self) -> Message:
        return Message(role="tool", content=self.result.text, tool_call_id=self.call.id)


@dataclass(slots=True)
class Round:
    """One reply of the model within a call, whose hosted calls were run before it sampled again."""

    reply: ParsedReply
    hosted: dict[str, HostedCall]  # by call id
    tokens: int


def offered(
    tools: list[dict[str, Any]], asks: list[Ask], names: dict[str, str], accepted: dict[str, str], configured: set[str]
) -> list[dict[str, Any]]:
    """The request's tools with each hosted one it declared shown where it stood, when configured;
    else left out, with why on the turn. ``names`` gets each offered function name's kind."""
    shown = list(tools)
    for ask in sorted(asks, key=lambda a: a.position, reverse=True):
        if ask.kind not in configured:
            accepted[ask.where] = (
                f"{ask.kind}: a hosted tool, run by the service; none is configured here "
                f"(--proxy-hosted-tools {ask.kind}=module:function), so the model is not offered "
                "it and answers without it"
            )
            continue
        name, description, argument = DEFINITIONS[ask.kind]
        name = ask.name or name
        names[name] = ask.kind
        shown.insert(
            ask.position,
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {argument: {"type": "string"}},
                        "required": [argument],
                    },
                },
            },
        )
    return shown


class HostedTools:
    """The implementations ``--proxy-hosted-tools`` names (``KIND=module:function`` each)."""

    def __init__(self, specs: list[str]):
        self.run_by_kind: dict[str, Callable[[dict[str, Any]], Any]] = {}
        for spec in specs:
            kind, _, path = spec.partition("=")
            if kind not in KINDS or not path:
                raise InvalidRequest(
                    f"--proxy-hosted-tools {spec!r}: expected KIND=module:function with KIND one of {list(KINDS)}",
                    param="proxy_hosted_tools",
                )
            self.run_by_kind[kind] = load_plugin(path, flag=f"--proxy-hosted-tools {kind}", params=["arguments"])

    @property
    def kinds(self) -> set[str]:
        return set(self.run_by_kind)

    async def run(self, kind: str, made: ToolCall, round_ids: tuple[str, ...]) -> HostedCall:
        """Run one call; any failure (bad arguments, an exception, the timeout) is its result."""
        try:
            arguments = json.loads(made.arguments)
            if not isinstance(arguments, dict):
                raise ValueError("the arguments are not a JSON object")
        except ValueError as exc:
            return failed(kind, made, round_ids, f"its arguments are not a JSON object ({exc})")
        fn = self.run_by_kind[kind]
        try:
            pending = fn(arguments) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, arguments)
            out = await asyncio.wait_for(pending, RUN_TIMEOUT_S)
        except TimeoutError:
            return failed(kind, made, round_ids, f"it took longer than {RUN_TIMEOUT_S:.0f} s")
        except Exception as exc:  # noqa: BLE001 - the implementation is the user's code: its failure is the result
            return failed(kind, made, round_ids, f"{type(exc).__name__}: {exc}")
        if isinstance(out, str):
            return HostedCall(kind, made, HostedResult(out), "completed", round_ids)
        sources = out.get("sources") or [] if isinstance(out, dict) else None
        if not (
            isinstance(out, dict)
            and isinstance(out.get("text"), str)
            and isinstance(sources, list)
            and all(isinstance(s, dict) for s in sources)
        ):
            return failed(
                kind,
                made,
                round_ids,
                f"its implementation returned {type(out).__name__}, not a string "
                "or {'text': str, 'sources': [{'url', 'title'}]}",
            )
        return HostedCall(kind, made, HostedResult(out["text"], tuple(sources)), "completed", round_ids)


def failed(kind: str, made: ToolCall, round_ids: tuple[str, ...], why: str) -> HostedCall:
    return HostedCall(kind, made, HostedResult(f"{kind} failed: {why}"), "failed", round_ids)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def follow_up(messages: list[Message], reply: ParsedReply, ran: list[HostedCall]) -> list[Message]:
    """The conversation after a reply whose hosted calls ran: the reply, then each call's result."""
    return [
        *messages,
        Message(role="assistant", content=reply.content or "", tool_calls=tuple(reply.tool_calls)),
        *(h.message() for h in ran),
    ]


def expanded(rounds: list[Round], reply: ParsedReply) -> list[Message]:
    """A call's whole reply as the conversation holds it: each round and its results, then the last reply."""
    out: list[Message] = []
    for r in rounds:
        out = follow_up(out, r.reply, list(r.hosted.values()))
    return out + [Message(role="assistant", content=reply.content or "", tool_calls=tuple(reply.tool_calls))]


class Regrouper:
    """Rebuilds, from a request's echoed items or blocks, the assistant messages a call left: one per
    reply, its reasoning (sent apart) rejoined to its text, its hosted calls' results right after it
    (before the agent's own tool outputs). Items come in order: ``reasoning``, ``text``, ``call``,
    ``hosted``; ``flush`` at each boundary."""

    def __init__(self, session: Any):
        self.known: dict[str, HostedCall] = getattr(session, "hosted", None) or {}
        self.messages: list[Message] = []
        self.thought: list[str] = []  # the reply's reasoning, sent apart (a thinking block, a reasoning item)
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.results: list[HostedCall] = []

    def recall(self, item_id: Any, where: str) -> HostedCall:
        found = self.known.get(item_id) if isinstance(item_id, str) else None
        if found is None:
            raise InvalidRequest(
                f"{where}: hosted tool call {item_id!r} was not made in this session: the proxy "
                "renders back only the hosted calls it ran itself",
                param=where,
            )
        return found

    def _same_reply(self, call_id: str) -> bool:
        return not self.results or call_id in self.results[-1].round

    def text(self, text: str) -> None:
        if self.results:  # text after a hosted result is the model's next reply
            self.flush()
        self.content.append(text)

    def reasoning(self, text: str) -> None:
        """A reply's reasoning, which opens it: it starts the next reply when this one has begun."""
        if self.results or self.content or self.calls:
            self.flush()
        self.thought.append(text)

    def call(self, made: ToolCall) -> None:
        if not self._same_reply(made.id):
            self.flush()
        self.calls.append(made)

    def hosted(self, found: HostedCall) -> None:
        if not self._same_reply(found.call.id):
            self.flush()
        if all(c.id != found.call.id for c in self.calls):
            self.calls.append(found.call)
        if found not in self.results:
            self.results.append(found)

    def flush(self) -> None:
        """End the assistant message being built, and add its hosted results."""
        if self.content or self.calls or self.thought:
            content = join_reasoning("".join(self.thought), "".join(self.content))
            self.messages.append(Message(role="assistant", content=content, tool_calls=tuple(self.calls)))
        self.messages.extend(h.message() for h in self.results)
        self.thought, self.content, self.calls, self.results = [], [], [], []
