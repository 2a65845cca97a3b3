"""What a harness sent, read independently of the proxy from each API's documented shapes, as the chat
messages and tools a chat template renders: the reference a harness's Sample is checked against."""

from __future__ import annotations

import json
from typing import Any

CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def conversation(request: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A request the tap recorded, by the API its path names."""
    for route, read in (
        ("/messages", messages_api),
        ("/responses", responses_api),
        ("/chat/completions", chat_api),
        (":streamGenerateContent", gemini_api),
        (":generateContent", gemini_api),
    ):
        if request["path"].endswith(route):
            return read(request["body"])
    raise AssertionError(f"not a model call: {request['path']}")


def chat_api(body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A Chat Completions request as the template reads it: ``developer`` is a system message, and a tool's
    ``strict`` (a directive to the server, not text for the model) is not rendered."""
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
    tools = [
        {
            "type": "function",
            "function": {k: t["function"][k] for k in ("name", "description", "parameters") if k in t["function"]},
        }
        for t in body.get("tools") or []
    ]
    return messages, tools


def messages_api(body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A Messages request as chat messages and tools, read from Anthropic's documented shapes."""

    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(b["text"] for b in content if b["type"] == "text")

    system = body.get("system")
    messages = [{"role": "system", "content": text(system)}] if system else []
    for message in body["messages"]:
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        results = [b for b in blocks if b["type"] == "tool_result"]
        for block in results:
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text(block["content"])})
        rest = [b for b in blocks if b["type"] != "tool_result"]
        if not rest:
            continue
        calls = [
            {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
            for b in rest
            if b["type"] == "tool_use"
        ]
        messages.append(
            {
                "role": message["role"],
                "content": text([b for b in rest if b["type"] == "text"]),
                **({"tool_calls": calls} if calls else {}),
            }
        )
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in body.get("tools", [])
        if not t.get("defer_loading")
    ]
    return messages, tools


def tools_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses tools as the functions a chat template renders: a custom tool takes one string, ``input``."""
    found = []
    for tool in items:
        if tool["type"] == "namespace":
            found += tools_of(tool["tools"])
        elif tool["type"] in ("function", "custom"):
            parameters = tool["parameters"] if tool["type"] == "function" else CUSTOM_INPUT
            found.append(
                {
                    "type": "function",
                    "function": {"name": tool["name"], "description": tool["description"], "parameters": parameters},
                }
            )
    return found


def responses_api(body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A Responses request as chat messages and tools, read from OpenAI's documented item shapes."""

    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(part["text"] for part in content)

    messages: list[dict] = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    tools = tools_of(body.get("tools", []))
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind == "additional_tools":
            tools += tools_of(item["tools"])
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": text(item["content"])})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item["arguments"] if kind == "function_call" else json.dumps({"input": item["input"]})
            made = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(made)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [made]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text(item["output"])})
        else:
            raise AssertionError(f"an input item this test does not know: {kind}")
    return messages, tools


def gemini_api(body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A Gemini request as chat messages and tools, read from Google's documented shapes: a model turn's
    ``functionCall`` parts are its calls, a user turn's ``functionResponse`` parts tool messages (the
    ``output`` a response holds alone is its text; thought summaries are not part of the conversation).
    Google's JSON takes the proto (snake_case) field names too, as the Python SDK sends them."""

    def field(message: dict, name: str) -> Any:
        return message.get(name, message.get("".join("_" + c.lower() if c.isupper() else c for c in name)))

    system = "".join(p["text"] for p in (field(body, "systemInstruction") or {}).get("parts", []))
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for content in body["contents"]:
        texts, calls = [], []
        for part in content["parts"]:
            made, answered = field(part, "functionCall"), field(part, "functionResponse")
            if part.get("thought"):
                continue
            if "text" in part:
                texts.append(part["text"])
            elif made:
                calls.append(
                    {
                        "id": f"call_{len(calls)}",
                        "type": "function",
                        "function": {"name": made["name"], "arguments": json.dumps(made.get("args") or {})},
                    }
                )
            elif answered:
                response = answered["response"]
                output = (
                    response["output"]
                    if set(response) == {"output"} and isinstance(response["output"], str)
                    else json.dumps(response)
                )
                messages.append({"role": "tool", "tool_call_id": answered["name"], "content": output})
        if texts or calls:
            role = "assistant" if content.get("role") == "model" else "user"
            messages.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    tools = [
        {
            "type": "function",
            "function": {
                "name": f["name"],
                "description": f["description"],
                "parameters": field(f, "parametersJsonSchema") or f["parameters"],
            },
        }
        for t in body.get("tools", [])
        for f in field(t, "functionDeclarations") or []
    ]
    return messages, tools
