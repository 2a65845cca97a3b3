"""A thinking model (a tiny one taught to open each reply with a ``<think>`` block, behind a template
with Qwen3's switch, and behind one that opens the block in the prompt, as the templates of models
that always think do) through all four APIs and their own SDKs: each returns the reasoning in its
own channel (Chat's ``reasoning_content``, Responses' reasoning items, Messages' signed ``thinking``
blocks, Gemini's thought parts), streamed as each streams it; sent back the way each client sends
it, it continues the same branch, and every API gives the same Sample, token for token."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from inverted.processes import ManagedProcess
from inverted.types import Sample
from tests.harnesses.conftest import HARNESSES
from tests.rollout.proxy.conftest import Stack
from tests.rollout.proxy.scripted import TOOLS, teach
from tests.rollout.proxy.test_fields import thinking_template
from tests.rollout.proxy.test_gemini_api import generate
from tests.rollout.proxy.test_recording import ADMIN, check_exact

QUESTION = "Weather in Paris?"
THOUGHTS = ("The user asks about Paris. I should call the tool.", "The tool says sunny.")
ANSWER = "Paris is sunny, 24C."
RESULT = "sunny, 24C"
WEATHER = TOOLS[0]["function"]


def conversation() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": f"<think>\n{THOUGHTS[0]}\n</think>\n\n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": RESULT},
        {"role": "assistant", "content": f"<think>\n{THOUGHTS[1]}\n</think>\n\n{ANSWER}"},
    ]


def always_thinking_template(model: Path, out: Path) -> Path:
    """Our template as DeepSeek-R1's, QwQ's and Qwen3-Thinking-2507's are: the generation prompt opens
    the think block, so each reply starts inside its reasoning and closes it with ``</think>``."""
    template = (model / "chat_template.jinja").read_text()
    plain_tail = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    assert plain_tail in template
    out.write_text(template.replace(plain_tail, plain_tail.replace("assistant\\n", "assistant\\n<think>\\n")))
    return out


@pytest.fixture(scope="module")
def taught(tiny_model, models_dir, module_procs) -> tuple[Path, ManagedProcess, ManagedProcess]:
    """The taught model in an engine behind the real router: one for both templates."""
    model = models_dir / "taught-thinking-qwen2"
    if not (model / "config.json").exists():
        teach(tiny_model("qwen2"), model, conversation=conversation())
    engine = module_procs.logged_server("embedded", model)
    return model, engine, module_procs.routed(engine)


@pytest.fixture(scope="module", params=[thinking_template, always_thinking_template], ids=["switch", "opened"])
def thinker(request, taught, module_procs, tmp_path_factory) -> Stack:
    """Qwen3's template (a switch; the model opens ``<think>``) or one that opens it in the prompt."""
    model, engine, router = taught
    template = request.param(model, tmp_path_factory.mktemp("template") / "thinking.jinja")
    proxy = module_procs.proxy(router.url, model, "--proxy-api-key", "admin-key", "--chat-template", str(template))
    return Stack(engine, router, proxy, model)


def opened(stack: Stack) -> dict:
    return httpx.post(
        stack.proxy.url + "/sessions", json={"sampling_params": {"temperature": 0, "max_tokens": 64}}, headers=ADMIN
    ).json()


def finished(stack: Stack, session: dict) -> Sample:
    answer = httpx.post(f"{stack.proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN).json()
    (sample,) = [Sample.from_json(s) for s in answer["samples"]]  # one branch: the reasoning sent back placed it
    assert len(sample.metadata["turns"]) == 2
    return sample


def chat(stack: Stack, *, stream: bool, send_back: bool) -> Sample:
    session = opened(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    for turn in range(2):
        if stream:
            reasoning, content, calls = "", "", {}
            for chunk in client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None:
                    reasoning += getattr(delta, "reasoning_content", None) or ""
                    content += delta.content or ""
                    for c in delta.tool_calls or []:
                        calls[c.index] = {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
            reply = {
                "role": "assistant",
                "content": content or None,
                "reasoning_content": reasoning,
                **({"tool_calls": list(calls.values())} if calls else {}),
            }
        else:
            message = client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS).choices[0].message
            reply = message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})
        assert reply["reasoning_content"] == THOUGHTS[turn] and "<think>" not in (reply.get("content") or "")
        if not send_back:
            del reply["reasoning_content"]
        messages.append(reply)
        if turn == 0:
            (made,) = reply["tool_calls"]
            assert json.loads(made["function"]["arguments"]) == {"city": "Paris"}
            messages.append({"role": "tool", "tool_call_id": made["id"], "content": RESULT})
        else:
            assert reply["content"] == ANSWER
    return finished(stack, session)


def responses(stack: Stack, *, stream: bool) -> Sample:
    session = opened(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    tools = [
        {
            "type": "function",
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["parameters"],
        }
    ]
    history: list = [{"role": "user", "content": QUESTION}]
    kwargs = {"model": "qwen3", "tools": tools, "include": ["reasoning.encrypted_content"], "store": False}
    for turn in range(2):
        if stream:
            with client.responses.stream(input=history, **kwargs) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
        else:
            response = client.responses.create(input=history, **kwargs)
        reasoning = response.output[0]
        assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHTS[turn]
        assert reasoning.encrypted_content  # sealed, as Codex asks for it
        history += [item.model_dump(exclude_none=True) for item in response.output]
        if turn == 0:
            made = response.output[1]
            assert made.type == "function_call"
            history.append({"type": "function_call_output", "call_id": made.call_id, "output": RESULT})
        else:
            assert response.output_text == ANSWER
    return finished(stack, session)


def messages(stack: Stack, *, stream: bool) -> Sample:
    session = opened(stack)
    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    history: list = [{"role": "user", "content": QUESTION}]
    kwargs = {
        "model": "claude-opus-5-5",
        "max_tokens": 64,
        "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    for turn in range(2):
        if stream:
            with client.messages.stream(messages=history, **kwargs) as events:
                kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in events]
                reply = events.get_final_message()
            assert ("content_block_delta", "thinking_delta") in kinds and (
                "content_block_delta",
                "signature_delta",
            ) in kinds
        else:
            reply = client.messages.create(messages=history, **kwargs)
        thinking = reply.content[0]
        assert thinking.type == "thinking" and thinking.thinking == THOUGHTS[turn] and thinking.signature
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if turn == 0:
            use = reply.content[1]
            assert use.type == "tool_use" and use.input == {"city": "Paris"} and reply.stop_reason == "tool_use"
            history.append(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}
            )
        else:
            assert reply.content[1].text == ANSWER
    sample = finished(stack, session)
    assert all(not any(k.endswith(".thinking") for k in t.get("accepted", {})) for t in sample.metadata["turns"])
    return sample


def gemini(stack: Stack, *, stream: bool) -> Sample:
    session = opened(stack)
    base = session["base_url"].removesuffix("/v1")
    tools = [
        {
            "functionDeclarations": [
                {
                    "name": WEATHER["name"],
                    "description": WEATHER["description"],
                    "parametersJsonSchema": WEATHER["parameters"],
                }
            ]
        }
    ]
    contents: list = [{"role": "user", "parts": [{"text": QUESTION}]}]
    for turn in range(2):
        body = {"contents": contents, "tools": tools, "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}
        parts = generate(base, body, stream=stream)["candidates"][0]["content"]["parts"]
        if stream:  # the helper joins every text; the thought chunks come first, marked
            parts = [{"text": THOUGHTS[turn], "thought": True}] + [
                p if "functionCall" in p else {"text": p["text"].removeprefix(THOUGHTS[turn])} for p in parts
            ]
            parts = [p for p in parts if p.get("text") != ""]
        assert parts[0] == {"text": THOUGHTS[turn], "thought": True}
        contents.append({"role": "model", "parts": parts})
        if turn == 0:
            assert parts[1]["functionCall"] == {"name": "get_weather", "args": {"city": "Paris"}}
            contents.append(
                {
                    "role": "user",
                    "parts": [{"functionResponse": {"name": "get_weather", "response": {"output": RESULT}}}],
                }
            )
        else:
            assert parts[1] == {"text": ANSWER}
    return finished(stack, session)


@pytest.mark.parametrize("stream", [False, True])
def test_every_api_returns_the_reasoning_in_its_own_shape_and_takes_it_back_into_one_branch(thinker, stream):
    reference = chat(thinker, stream=False, send_back=True)
    assert "<think>" in thinker_text(thinker, reference)
    check_exact(reference, thinker.engine_requests())
    for sample in (
        chat(thinker, stream=stream, send_back=False),
        responses(thinker, stream=stream),
        messages(thinker, stream=stream),
        gemini(thinker, stream=stream),
    ):
        assert sample.tokens == reference.tokens and sample.loss_mask == reference.loss_mask


def test_a_reply_cut_inside_its_reasoning_is_all_reasoning(thinker):
    """At ``max_tokens`` before ``</think>``: the reply is reasoning and no answer, streamed or not."""
    client = openai.OpenAI(base_url=opened(thinker)["base_url"], api_key="x", max_retries=0)
    ask = {"model": "qwen3", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS, "max_tokens": 14}
    message = client.chat.completions.create(**ask).choices[0].message
    streamed = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            streamed["reasoning"] += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            streamed["content"] += chunk.choices[0].delta.content or ""
    assert message.reasoning_content and THOUGHTS[0].startswith(message.reasoning_content) and not message.content
    assert streamed == {"reasoning": message.reasoning_content, "content": ""}


def test_reasoning_signed_elsewhere_is_rendered_as_plain_reasoning_and_said(thinker):
    session = opened(thinker)
    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
    history = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Greet back.", "signature": "Eu8B"},
                {"type": "redacted_thinking", "data": "EmwKAh"},
                {"type": "text", "text": "Hello!"},
            ],
        },
        {"role": "user", "content": QUESTION},
    ]
    client.messages.create(model="claude-opus-5-5", max_tokens=8, messages=history)
    answer = httpx.post(f"{thinker.proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN).json()
    (sample,) = [Sample.from_json(s) for s in answer["samples"]]
    accepted = sample.metadata["turns"][0]["accepted"]
    assert "signed elsewhere" in accepted["messages.1.thinking"] and "redacted_thinking" in accepted
    assert "<think>\nGreet back.\n</think>\n\nHello!" in thinker_text(thinker, sample)


def thinker_text(stack: Stack, sample: Sample) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.model).decode(sample.tokens)


@pytest.mark.slow  # the TypeScript SDK comes with the harnesses (make harnesses)
def test_the_anthropic_typescript_sdk_parses_every_thinking_event(thinker):
    sdk = HARNESSES.parent / "@anthropic-ai" / "sdk"
    if not sdk.exists():
        pytest.fail(f"{sdk} is missing: `make harnesses` installs the Anthropic TypeScript SDK (make test does)")
    session = opened(thinker)
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    done = subprocess.run(
        [
            "node",
            str(Path(__file__).with_name("anthropic_ts_stream.js")),
            session["base_url"].removesuffix("/v1"),
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NODE_PATH": str(HARNESSES.parent)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    deltas = {line["delta"] for line in lines if line.get("event") == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= deltas
    final = lines[-1]["final"]
    assert [b["type"] for b in final["content"]] == ["thinking", "tool_use"]
    assert final["content"][0]["thinking"] == THOUGHTS[0] and final["content"][0]["signature"]
