"""A tiny checkpoint taught one tool-using conversation, so greedy decoding replays it exactly.

A random tiny model never emits a tool call. To test tool calls end to end against the real
engine, the fixture fine-tunes a tiny Qwen2 checkpoint (``transformers``, CPU, seconds) on the
conversation below with loss on the assistant turns only; greedy decoding then reproduces each
assistant turn, tool calls included, given the same history. It is test scaffolding, not product.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inverted.rollout.chat import ChatRenderer, parse_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def call(cid: str, city: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [call("c1", "Paris")]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24C"},
    {"role": "assistant", "content": None, "tool_calls": [call("c2", "Rome")]},
    {"role": "tool", "tool_call_id": "c2", "content": "rain, 18C"},
    {"role": "assistant", "content": "Paris is sunny; Rome is rainy."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


def teach(
    base: Path, out: Path, steps: int = 300, conversation: list[dict] = CONVERSATION, tools: list[dict] = TOOLS
) -> Path:
    """Fine-tune ``base`` on ``conversation`` (loss on assistant turns) and save it to ``out``."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    renderer = ChatRenderer(tokenizer)
    messages = parse_messages(conversation)
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        prompt = renderer.prompt_ids(messages[:i], tools)
        full = renderer.encode(renderer.render(messages[: i + 1], tools, generation_prompt=False))
        assert full[: len(prompt)] == prompt
        end = full.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), len(prompt)) + 1
        mask += [0] * (len(prompt) - len(ids)) + [1] * (end - len(prompt))
        ids = full[:end]
        assert len(mask) == len(ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    for _ in range(steps):
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
