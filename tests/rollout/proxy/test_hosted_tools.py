"""Hosted tools (web search) run by the proxy inside the call, through the real stack and the real SDKs.

A tiny model is taught one conversation in which it searches before it answers, with the search
offered where the request declared it. Then, through each API as its SDK sends it, the proxy runs
the search with ``envs.local_search``, the model reads the result and answers within the same
call, and the answer carries the API's own items for the search. The agent sends them back on its
next call (or, in Chat and Gemini, which have no such items, the one reply it was shown) and the
episode stays one branch, recorded token for token, the results out of the loss.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from envs import local_search
from inverted.rollout.proxy.hosted import DEFINITIONS
from inverted.types import Sample
from tests.rollout.proxy.conftest import Stack
from tests.rollout.proxy.scripted import TOOLS, teach
from tests.rollout.proxy.test_gemini_api import generate
from tests.rollout.proxy.test_recording import ADMIN, check_exact

QUESTION = "What does the with statement do?"
QUERY = "with statement"
ANSWER = "It runs a block inside a context manager."
SEARCH = {
    "type": "function",
    "function": {
        "name": "web_search",
        "description": DEFINITIONS["web_search"][1],
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
FLAGS = ("--proxy-hosted-tools", "web_search=envs.local_search:search")
WEATHER = TOOLS[0]["function"]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["parameters"],
    },
    {"type": "web_search"},
]
ANTHROPIC_TOOLS = [
    {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
]


def conversation() -> list[dict]:
    found = local_search.search({"query": QUERY})["text"]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "web_search", "arguments": json.dumps({"query": QUERY})},
    }
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": found},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]


@pytest.fixture(scope="module")
def searching(tiny_model, models_dir, module_procs) -> Stack:
    """A model that searches, in the embedded engine behind the router, and two proxies: one that runs
    the search, one with no implementation configured."""
    model = models_dir / "taught-search-qwen2"
    if not (model / "config.json").exists():
        teach(tiny_model("qwen2"), model, conversation=conversation(), tools=[TOOLS[0], SEARCH])
    engine = module_procs.logged_server("embedded", model)
    router = module_procs.routed(engine)
    stack = Stack(engine, router, module_procs.proxy(router.url, model, "--proxy-api-key", "admin-key", *FLAGS), model)
    stack.bare = module_procs.proxy(router.url, model, "--proxy-api-key", "admin-key")
    return stack


def session(url: str) -> dict:
    return httpx.post(url + "/sessions", json={"sampling_params": {"temperature": 0}}, headers=ADMIN).json()


def finish(url: str, opened: dict) -> list[Sample]:
    answer = httpx.post(f"{url}/sessions/{opened['session_id']}/finish", headers=ADMIN).json()
    return [Sample.from_json(s) for s in answer["samples"]]


def check_searched(stack: Stack, sample: Sample, turns: int) -> None:
    """One branch: the search call, its result (out of the loss), the answer, each as the engine saw it."""
    assert len(sample.metadata["turns"]) == turns
    check_exact(sample, stack.engine_requests())
    text = stack_text(stack, sample)
    found = local_search.search({"query": QUERY})["text"]
    assert found in text and ANSWER in text
    first, second = sample.metadata["turns"][:2]
    result_span = range(first["end"], second["start"])
    assert all(sample.loss_mask[i - (len(sample.tokens) - sample.response_length)] == 0 for i in result_span)


def stack_text(stack: Stack, sample: Sample) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.model).decode(sample.tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_web_search_runs_in_the_call_and_the_next_call_continues_the_branch(searching, stream):
    opened = session(searching.proxy.url)
    client = openai.OpenAI(base_url=opened["base_url"], api_key="x", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    kwargs = {"model": "my-policy", "tools": RESPONSES_TOOLS, "include": ["web_search_call.action.sources"]}
    if stream:
        with client.responses.stream(input=ask, **kwargs) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert {"response.web_search_call.searching", "response.web_search_call.completed"} <= set(kinds)
    else:
        response = client.responses.create(input=ask, **kwargs)
    search, message = response.output
    assert (search.type, search.status, search.action.type, search.action.query) == (
        "web_search_call",
        "completed",
        "search",
        QUERY,
    )
    assert search.action.sources[0].url == local_search.search({"query": QUERY})["sources"][0]["url"]
    assert (message.type, response.output_text) == ("message", ANSWER)
    assert response.usage.output_tokens > len(ANSWER.split())  # both replies' tokens
    again = client.responses.create(
        input=ask
        + [item.model_dump(exclude_none=True) for item in response.output]
        + [{"role": "user", "content": "Thanks!"}],
        **kwargs,
    )
    assert again.output_text == "You are welcome."
    (sample,) = finish(searching.proxy.url, opened)
    check_searched(searching, sample, turns=3)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_server_web_search_runs_in_the_call_and_the_next_call_continues_the_branch(searching, stream):
    opened = session(searching.proxy.url)
    client = anthropic.Anthropic(base_url=opened["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    if stream:
        with client.messages.stream(
            model="claude-opus-5-5", max_tokens=200, messages=ask, tools=ANTHROPIC_TOOLS
        ) as events:
            for _ in events:  # the SDK parses every event
                pass
            message = events.get_final_message()
    else:
        message = client.messages.create(model="claude-opus-5-5", max_tokens=200, messages=ask, tools=ANTHROPIC_TOOLS)
    use, result, text = message.content
    assert (use.type, use.name, use.input) == ("server_tool_use", "web_search", {"query": QUERY})
    assert result.type == "web_search_tool_result" and result.tool_use_id == use.id
    assert [r.url for r in result.content] == [s["url"] for s in local_search.search({"query": QUERY})["sources"]]
    assert text.text == ANSWER and message.stop_reason == "end_turn"
    assert message.usage.server_tool_use.web_search_requests == 1
    again = client.messages.create(
        model="claude-opus-5-5",
        max_tokens=200,
        tools=ANTHROPIC_TOOLS,
        messages=ask
        + [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
            {"role": "user", "content": "Thanks!"},
        ],
    )
    assert again.content[0].text == "You are welcome."
    (sample,) = finish(searching.proxy.url, opened)
    check_searched(searching, sample, turns=3)


def test_chat_web_search_options_search_in_the_call_and_the_next_call_continues_the_branch(searching):
    """A Chat client sees one reply and sends it back as one message: the branch goes on after the search."""
    opened = session(searching.proxy.url)
    client = openai.OpenAI(base_url=opened["base_url"], api_key="x", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]
    reply = (
        client.chat.completions.create(model="gpt-4o-search-preview", tools=TOOLS, web_search_options={}, messages=ask)
        .choices[0]
        .message
    )
    assert reply.content == ANSWER and not reply.tool_calls
    again = client.chat.completions.create(
        model="gpt-4o-search-preview",
        tools=TOOLS,
        web_search_options={},
        messages=ask + [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Thanks!"}],
    )
    assert again.choices[0].message.content == "You are welcome."
    (sample,) = finish(searching.proxy.url, opened)
    check_searched(searching, sample, turns=3)


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_google_search_runs_in_the_call_and_the_next_call_continues_the_branch(searching, stream):
    opened = session(searching.proxy.url)
    base = opened["base_url"].removesuffix("/v1")
    tools = [
        {
            "functionDeclarations": [
                {
                    "name": WEATHER["name"],
                    "description": WEATHER["description"],
                    "parametersJsonSchema": WEATHER["parameters"],
                }
            ]
        },
        {"googleSearch": {}},
    ]
    contents = [{"role": "user", "parts": [{"text": QUESTION}]}]
    parts = generate(base, {"contents": contents, "tools": tools}, stream=stream)["candidates"][0]["content"]["parts"]
    assert parts == [{"text": ANSWER}]
    contents += [{"role": "model", "parts": parts}, {"role": "user", "parts": [{"text": "Thanks!"}]}]
    again = generate(base, {"contents": contents, "tools": tools}, stream=stream)
    assert again["candidates"][0]["content"]["parts"] == [{"text": "You are welcome."}]
    (sample,) = finish(searching.proxy.url, opened)
    check_searched(searching, sample, turns=3)


def test_without_an_implementation_the_tool_is_not_offered_and_the_turn_says_why(searching):
    """Codex declares web_search for any model name: served without it, never refused."""
    opened = session(searching.bare.url)
    client = openai.OpenAI(base_url=opened["base_url"], api_key="x", max_retries=0)
    response = client.responses.create(model="my-policy", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=8)
    assert all(item.type != "web_search_call" for item in response.output)
    (sample,) = finish(searching.bare.url, opened)
    (turn,) = sample.metadata["turns"]
    assert "none is configured" in turn["accepted"]["tools[1]"]
    assert "web_search" not in stack_text(searching, sample)[: turn["start"]]  # not in the prompt


def test_a_limit_of_hosted_calls_and_a_failing_search_are_results_the_model_reads(searching):
    opened = session(searching.proxy.url)
    client = openai.OpenAI(base_url=opened["base_url"], api_key="x", max_retries=0)
    response = client.responses.create(model="my-policy", input=QUESTION, tools=RESPONSES_TOOLS, max_tool_calls=0)
    (search,) = response.output  # the call is the answer: it was not run
    assert (search.type, search.status) == ("web_search_call", "failed")
    (sample,) = finish(searching.proxy.url, opened)
    assert len(sample.metadata["turns"]) == 1
    with pytest.raises(openai.BadRequestError) as info:  # a hosted call the proxy never made
        client.responses.create(
            model="my-policy",
            tools=RESPONSES_TOOLS,
            input=[
                {"role": "user", "content": QUESTION},
                {
                    "type": "web_search_call",
                    "id": "ws_elsewhere",
                    "status": "completed",
                    "action": {"type": "search", "query": "x"},
                },
            ],
        )
    assert info.value.body["param"] == "input[1].id"
