"""Recorded replies that agents send back rewritten, recognised so that their episode stays one branch.

A turn's history ends with the reply as the proxy returned it, and a later call continues that
branch when its messages begin with that history (``session.extends``). Some agent libraries send
the reply back in a form of their own, and each such call would fork a branch: only the last one
would be trained on. Each function here recognises one known rewrite of a recorded assistant
message (both as ``chat.Message.key``: role, text, tool calls as (name, canonical arguments), name).

A recognised message counts as the recorded one. The branch keeps the tokens the model sampled and
bridges what follows the reply as usual: the model sees its own reply as it wrote it, and the
agent's messages for everything after it. What is not recognised still forks, as any edit does.

- **smolagents** (1.x) ``ToolCallingAgent``: the reply's tool calls come back as assistant text,
  the reply's own text (stripped), a newline, then ``"Calling tools:\\n" + str([call.dict(), ...])``,
  each call ``{"id", "type": "function", "function": {"name", "arguments"}}`` with its arguments
  parsed (``memory.ActionStep.to_messages``, merged by ``models.get_clean_message_list``).
"""

from __future__ import annotations

import ast
import json
from typing import Any, Callable

SMOLAGENTS_CALLS = "Calling tools:\n"


def _canonical(arguments: Any) -> str:
    """``chat.ToolCall.canonical_arguments`` of arguments an agent parsed: JSON, or the text it could not parse."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


def smolagents_tool_calls(recorded: tuple, incoming: tuple) -> bool:
    role, content, calls, _ = recorded
    if role != "assistant" or not calls or incoming[0] != "assistant" or incoming[2]:
        return False
    text, marker, listed = incoming[1].partition(SMOLAGENTS_CALLS)  # the agent stops sampling at this marker
    if not marker or text.strip() != content.strip():
        return False
    try:
        said = ast.literal_eval(listed)  # Python's repr of a list of dicts: literals only, never evaluated code
        return [(c["function"]["name"], _canonical(c["function"]["arguments"])) for c in said] == list(calls)
    except (ValueError, TypeError, KeyError, SyntaxError, MemoryError, RecursionError):
        return False


REWRITES: list[Callable[[tuple, tuple], bool]] = [smolagents_tool_calls]


def same(recorded: tuple, incoming: tuple) -> bool:
    """Whether ``incoming`` is the recorded message, as sent or in a known rewrite."""
    return recorded == incoming or any(rewrite(recorded, incoming) for rewrite in REWRITES)
