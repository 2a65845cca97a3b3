"""Multi-turn tool use: arithmetic questions with a ``calculator`` tool (OpenAI ``tools``).

Each episode asks "What is A op B?" with the calculator offered as an OpenAI function tool. When
the model calls it, the environment runs the call and sends the result back as a ``tool``
message; when it answers in text, a correct number ends the episode with reward 1, and a wrong
one gets a short user reply asking it to try again, up to ``MAX_TURNS`` model calls. So every
episode is a real multi-turn conversation: tool results and feedback are tokens the policy did
not sample, which the proxy records with loss mask 0.

    python -m envs.calculator --out data/calculator.jsonl [--count 64] [--seed 0]
"""

from __future__ import annotations

import json
import random
import re

from envs.arithmetic import calculate, evaluate
from envs.datasets import main

MAX_TURNS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "You can use the calculator tool. Answer with the number only."
RETRY = "That is not right. Try again, or use the calculator."


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer as text; a bad call gets an error message, as a real tool would give."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
    return calculate(str(expression))


def is_correct(text: str, label: int) -> bool:
    numbers = re.findall(r"-?\d+", text or "")
    return bool(numbers) and int(numbers[-1]) == label


async def episode(task, client) -> float:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=task.tools or TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": run_tool(call.function.name, call.function.arguments),
                    }
                )
        elif is_correct(message.content, task.label):
            return 1.0
        else:
            messages.append({"role": "user", "content": RETRY})
    return 0.0


def rows(count: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(count):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        out.append({"input": f"What is {a} {op} {b}?", "label": int(evaluate(f"{a} {op} {b}")), "tools": TOOLS})
    return out


if __name__ == "__main__":
    main(rows, __doc__, 64)
