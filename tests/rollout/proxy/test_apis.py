"""What a request may ask for, checked without a server: stop strings, the legacy logprobs count, and
every API normalised to the same messages, tools and sampling parameters."""

from __future__ import annotations

import json

import pytest

from inverted.errors import InvalidRequest
from inverted.rollout.proxy.apis import (
    APIS,
    anthropic_messages,
    call,
    openai_chat,
    openai_completions,
    openai_responses,
)


def test_the_cut_is_at_the_first_stop_string_in_the_text_not_in_the_list():
    # One sampled token can complete several stop strings; SGLang names the first in the list.
    assert call.before_stop("The answer is 5", ["5", "answer"]) == "The "
    assert call.before_stop("The answer is 5", ["answer", "5"]) == "The "
    assert call.before_stop("no stop here", ["5"]) == "no stop here"


def test_legacy_completions_take_logprobs_as_a_count():
    assert openai_completions.parse({"prompt": "p", "logprobs": 3}).top_logprobs == 3
    plain = openai_completions.parse({"prompt": "p", "logprobs": 0})
    assert plain.logprobs and plain.top_logprobs == 0
    assert not openai_completions.parse({"prompt": "p", "logprobs": None}).logprobs
    assert not openai_chat.parse({"messages": [{"role": "user", "content": "u"}], "logprobs": False}).logprobs
    for bad in (6, -1, True, "2", 1.5):
        with pytest.raises(InvalidRequest, match="between 0 and 5") as info:
            openai_completions.parse({"prompt": "p", "logprobs": bad})
        assert info.value.param == "logprobs"
    with pytest.raises(InvalidRequest, match="expected a boolean"):
        openai_chat.parse({"messages": [{"role": "user", "content": "u"}], "logprobs": 3})


# ---- every API to the same messages and tools ------------------------------------------------------


class Stored:
    """A session's store, all ``openai_responses.parse`` reads of a session."""

    def __init__(self):
        self.stored = {}


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_responses_items_become_the_chat_messages_of_the_same_conversation():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather?"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}],
            },
            CALL,
            {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call_output", "call_id": "call_1", "output": "sun"},
        ],
        "tools": [
            {"type": "function", "name": "get_weather", "description": "d", "parameters": WEATHER, "strict": True}
        ],
    }
    chat = openai_chat.parse(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "x",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        },
                        {
                            "id": "y",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "y", "content": "rain"},
                {"role": "tool", "tool_call_id": "x", "content": "sun"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}}
            ],
        }
    )
    for req in (
        openai_responses.parse(body, Stored()),
        anthropic_messages.parse(
            {
                "max_tokens": 8,
                "system": [{"type": "text", "text": "Be brief."}],
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Let me look."},
                            {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Paris"}},
                            {"type": "tool_use", "id": "b", "name": "get_weather", "input": {"city": "Rome"}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "rain"}]},
                            {"type": "tool_result", "tool_use_id": "a", "content": "sun"},
                        ],
                    },
                ],
                "tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}],
            }
        ),
    ):
        assert [m.key for m in req.messages] == [m.key for m in chat.messages]
        assert req.tools == chat.tools and req.parse_tools


def test_each_api_maps_tool_choice_structured_output_and_sampling_alike():
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    responses = openai_responses.parse(
        {
            "input": "u",
            "tools": tools,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "temperature": 0.5,
            "max_output_tokens": 9,
        },
        Stored(),
    )
    assert responses.force_call == "get_weather" and responses.sampling == {"temperature": 0.5}
    assert responses.max_tokens == 9
    messages = anthropic_messages.parse(
        {
            "max_tokens": 9,
            "messages": [{"role": "user", "content": "u"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "any"},
            "top_k": 5,
            "stop_sequences": ["x"],
        }
    )
    # "any" with one tool offered can only mean that tool: its name is forced too
    assert messages.force_call == "get_weather" and messages.sampling == {"top_k": 5, "stop": ["x"]}
    none = anthropic_messages.parse(
        {
            "max_tokens": 9,
            "messages": [{"role": "user", "content": "u"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "none"},
        }
    )
    assert none.tools and not none.parse_tools  # rendered, never parsed: as Chat Completions' "none"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    for req in (
        openai_responses.parse(
            {"input": "u", "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}}, Stored()
        ),
        anthropic_messages.parse(
            {
                "max_tokens": 9,
                "messages": [{"role": "user", "content": "u"}],
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            }
        ),
        openai_chat.parse(
            {
                "messages": [{"role": "user", "content": "u"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            }
        ),
    ):
        assert json.loads(req.sampling["json_schema"]) == schema


def test_session_overrides_apply_to_every_api_after_parsing():
    for req in (
        openai_chat.parse(
            {"messages": [{"role": "user", "content": "u"}], "max_completion_tokens": 50, "temperature": 0.1}
        ),
        openai_responses.parse({"input": "u", "max_output_tokens": 50, "temperature": 0.1}, Stored()),
        anthropic_messages.parse(
            {"max_tokens": 50, "messages": [{"role": "user", "content": "u"}], "temperature": 0.1}
        ),
    ):
        call.apply_overrides(req, {"temperature": 1.0, "max_tokens": 7, "seed": 3})
        assert req.sampling["temperature"] == 1.0 and req.sampling["sampling_seed"] == 3 and req.max_tokens == 7
    with pytest.raises(InvalidRequest, match="cannot be set for a whole session"):
        call.check_overrides({"n": 2})
    with pytest.raises(InvalidRequest, match="between 0.0 and 2.0"):
        call.check_overrides({"temperature": 3})


def test_both_chunked_openai_apis_check_stream_options_alike():
    for parse, body in (
        (openai_chat.parse, {"messages": [{"role": "user", "content": "u"}]}),
        (openai_completions.parse, {"prompt": "p"}),
    ):
        assert parse({**body, "stream": True, "stream_options": {"include_usage": True}}).include_usage
        with pytest.raises(InvalidRequest, match="'stream_options' must be an object"):
            parse({**body, "stream_options": "yes"})


USER = [{"role": "user", "content": "u"}]
SMALLEST = {  # each API's smallest streamed request
    "chat": {"messages": USER, "stream": True},
    "completions": {"prompt": "p", "stream": True},
    "responses": {"input": "u", "stream": True},
    "messages": {"max_tokens": 8, "messages": USER, "stream": True},
    "gemini": {"contents": [{"role": "user", "parts": [{"text": "u"}]}]},
    "gemini-stream": {"contents": [{"role": "user", "parts": [{"text": "u"}]}]},
}


@pytest.mark.anyio
@pytest.mark.parametrize("api", APIS, ids=lambda api: api.name)
async def test_every_api_streams_a_call_that_opens_with_its_answer_and_refuses_one_that_does_not(api):
    req = api.parse(SMALLEST[api.name], None)

    async def stream(*events):
        for event in events:
            yield event

    answer = call.Answer(model="m", prompt_tokens=3)
    first = await anext(api.events(req, stream(answer, call.Delta(0, "hi"))))
    assert answer.id in json.dumps(first[1])
    with pytest.raises(TypeError, match="opens with its Answer, not a Delta"):
        await anext(api.events(req, stream(call.Delta(0, "hi"), answer)))
