"""The Responses and Anthropic Messages APIs through the real stack, driven by the real SDKs
(``openai``, ``openai-agents``, ``anthropic``): each Sample exact token for token, and the same
conversation recorded identically whichever of the three APIs carried it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from inverted.types import Sample
from tests.rollout.proxy.scripted import CONVERSATION, TOOLS
from tests.rollout.proxy.test_recording import (
    EXPECTED,
    check_exact,
    finish,
    new_session,
    reference_logprobs,
    reply_as_message,
    scripted_history,
)

pytestmark = pytest.mark.anyio
SYSTEM = CONVERSATION[0]["content"]
FUNCTION = TOOLS[0]["function"]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": FUNCTION["name"],
        "description": FUNCTION["description"],
        "parameters": FUNCTION["parameters"],
        "strict": False,
    }
]
ANTHROPIC_TOOLS = [
    {"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
]
RESULTS = {"Paris": "sunny, 24C", "Rome": "rain, 18C"}


def user_turns() -> list[str]:
    return [m["content"] for m in CONVERSATION if m["role"] == "user"]


# ---- one conversation, three APIs -----------------------------------------------------------------


def chat_conversation(session: dict) -> None:
    client = openai.OpenAI(base_url=session["base_url"], api_key="x")
    replies = []
    for turn in range(4):
        reply = client.chat.completions.create(
            model="m", messages=scripted_history(turn, replies), tools=TOOLS, temperature=0, max_tokens=64
        )
        replies.append(reply_as_message(reply.choices[0].message))


def responses_conversation(session: dict, *, stream: bool = False, chained: bool = False) -> list:
    """The scripted conversation with ``responses.create``: the whole input each turn (the response's
    output echoed back), or only what is new with ``previous_response_id`` (``chained``)."""
    client = openai.OpenAI(base_url=session["base_url"], api_key="x")
    history: list = []
    new: list = [{"role": "user", "content": user_turns()[0]}]
    responses, previous = [], None
    for turn in range(4):
        kwargs = dict(
            model="m",
            instructions=SYSTEM,
            tools=RESPONSES_TOOLS,
            temperature=0,
            max_output_tokens=64,
            input=new if chained else history + new,
            **({"previous_response_id": previous} if chained and previous else {}),
        )
        if stream:
            with client.responses.stream(**kwargs) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        else:
            response = client.responses.create(**kwargs)
        check_response(turn, response)
        history += new + [item.model_dump(exclude_none=True) for item in response.output]
        previous, new = response.id, answers(turn, response.output)
        responses.append(response)
    return responses


def check_response(turn: int, response) -> None:
    reason, text = EXPECTED[turn]
    assert response.status == "completed" and response.object == "response"
    if reason == "tool_calls":
        (item,) = response.output
        assert item.type == "function_call" and item.name == "get_weather"
        assert json.loads(item.arguments) == {"city": text}
    else:
        (item,) = response.output
        assert item.type == "message" and response.output_text == text


def answers(turn: int, output: list) -> list:
    """What the agent sends next: each call's result, or the next user message."""
    calls = [item for item in output if item.type == "function_call"]
    if calls:
        return [
            {"type": "function_call_output", "call_id": c.call_id, "output": RESULTS[json.loads(c.arguments)["city"]]}
            for c in calls
        ]
    return [{"role": "user", "content": user_turns()[1]}] if turn == 2 else []


def messages_conversation(client: anthropic.Anthropic, *, stream: bool = False) -> list:
    messages: list = [{"role": "user", "content": user_turns()[0]}]
    replies = []
    for turn in range(4):
        kwargs = dict(
            model="m",
            max_tokens=64,
            system=SYSTEM,
            tools=ANTHROPIC_TOOLS,
            messages=messages,
            extra_body={"temperature": 0},
        )
        if stream:
            with client.messages.stream(**kwargs) as events:
                kinds = [event.type for event in events]
                reply = events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        else:
            reply = client.messages.create(**kwargs)
        reason, text = EXPECTED[turn]
        if reason == "tool_calls":
            (block,) = reply.content
            assert reply.stop_reason == "tool_use" and block.type == "tool_use" and block.input == {"city": text}
            results = [{"type": "tool_result", "tool_use_id": block.id, "content": RESULTS[text]}]
            messages += [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                {"role": "user", "content": results},
            ]
        else:
            (block,) = reply.content
            assert reply.stop_reason == "end_turn" and block.type == "text" and block.text == text
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": user_turns()[1]}]
        replies.append(reply)
    return replies


def flush(stack) -> None:
    """Each API's conversation starts from an empty prefix cache, so that their logprobs are computed alike."""
    assert httpx.post(stack.engine.url + "/flush_cache").status_code == 200


def recorded(stack, run, **kwargs) -> tuple[Sample, list[dict]]:
    flush(stack)
    session = new_session(stack)
    logged_before = len(stack.engine_requests())
    run(session, **kwargs)
    (sample,) = finish(stack, session)
    return sample, stack.engine_requests()[logged_before:]


def check_sample(stack, sample: Sample, engine_log: list[dict]) -> None:
    assert len(engine_log) == 4
    assert sample.tokens == engine_log[-1]["input_ids"] + engine_log[-1]["output_ids"]
    check_exact(sample, engine_log)
    assert [t["finish_reason"] for t in sample.metadata["turns"]] == [reason for reason, _ in EXPECTED]
    expected = reference_logprobs(stack.model, sample)
    got = [(lp, ref) for lp, ref, m in zip(sample.rollout_log_probs, expected, sample.loss_mask) if m]
    assert max(abs(a - b) for a, b in got) <= 1e-4


# ---- Responses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chained", [False, True], ids=["whole-input", "previous_response_id"])
def test_responses_api_conversation_is_recorded_token_for_token(stack, stream, chained):
    sample, log = recorded(stack, responses_conversation, stream=stream, chained=chained)
    check_sample(stack, sample, log)
    assert sample.prompt[0] == {"role": "system", "content": SYSTEM}


def test_the_same_conversation_gives_the_same_sample_through_all_three_apis(stack):
    chat, _ = recorded(stack, chat_conversation)
    responses, _ = recorded(stack, responses_conversation)
    messages, _ = recorded(
        stack,
        lambda s: messages_conversation(anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="x")),
    )
    for other in (responses, messages):
        assert other.tokens == chat.tokens and other.loss_mask == chat.loss_mask
        assert other.rollout_log_probs == chat.rollout_log_probs and other.weight_versions == chat.weight_versions
        assert other.prompt_length == chat.prompt_length


def test_previous_response_id_is_resolved_in_its_own_session_only_and_store_false_keeps_nothing(stack):
    mine, other = new_session(stack), new_session(stack)
    client = openai.OpenAI(base_url=mine["base_url"], api_key="x")
    first = client.responses.create(model="m", input="Hello", max_output_tokens=4, temperature=0)
    unstored = client.responses.create(model="m", input="Hello", max_output_tokens=4, temperature=0, store=False)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    follow = client.responses.create(model="m", input="Again", previous_response_id=first.id, max_output_tokens=4)
    assert follow.previous_response_id == first.id
    for client_, response_id in (
        (openai.OpenAI(base_url=other["base_url"], api_key="x"), first.id),
        (client, unstored.id),
        (client, "resp_unknown"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client_.responses.create(model="m", input="Again", previous_response_id=response_id)
        assert info.value.body["code"] == "previous_response_not_found"
    # the chained call continued the first call's branch
    samples = finish(stack, mine)
    assert [len(s.metadata["turns"]) for s in samples] == [2, 1]


def test_responses_refuse_what_they_cannot_honour_in_openais_shape(stack):
    session = new_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    bad = [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", **body)
        assert info.value.body["param"] == param, info.value.body
    assert (
        httpx.get(f"{session['base_url'].removesuffix('/v1')}", headers={"Authorization": "Bearer admin-key"}).json()[
            "refused"
        ][-1]["route"]
        == "POST /sessions/{session_id}/v1/responses"
    )


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("model", ["gpt-5", "gpt-5.2"])
def test_an_openai_agents_agent_at_the_sdks_defaults_runs_unchanged(stack, api, model):
    """The agent as the SDK's documentation writes one: no model, no ``ModelSettings``; base URL, key
    and default model from the environment. The SDK then sends its default settings for the model
    (``reasoning`` effort ``low`` or ``none``, ``verbosity: low``), which the proxy accepts with a
    reason on the turn, and which change nothing: the Sample is the engine's, token for token."""
    session = new_session(stack, sampling_params={"temperature": 0})  # the session's setting, not the agent's
    logged_before = len(stack.engine_requests())
    env = {
        **os.environ,
        "OPENAI_BASE_URL": session["base_url"],
        "OPENAI_API_KEY": "x",
        "OPENAI_DEFAULT_MODEL": model,
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.rollout.proxy.agents.openai_agents_default",
            *(["chat"] if api == "chat" else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == EXPECTED[2][1]
    (sample,) = finish(stack, session)
    log = stack.engine_requests()[logged_before:]
    assert len(log) == 3 and sample.tokens == log[-1]["input_ids"] + log[-1]["output_ids"]
    check_exact(sample, log)
    effort = "reasoning.effort" if api == "responses" else "reasoning_effort"
    verbosity = "text.verbosity" if api == "responses" else "verbosity"
    for turn in sample.metadata["turns"]:
        assert turn["model"] == model
        assert set(turn["accepted"]) >= {effort, verbosity}, turn["accepted"]
        assert "no thinking mode" in turn["accepted"][effort]


# ---- Anthropic Messages --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_conversation_is_recorded_token_for_token(stack, stream):
    sample, log = recorded(
        stack,
        lambda s: messages_conversation(
            anthropic.Anthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="x"), stream=stream
        ),
    )
    check_sample(stack, sample, log)


def test_anthropic_sdk_with_the_session_token_as_its_api_key(stack):
    """``x-api-key`` carries the session's token on the token route; another session's token is refused."""
    session, other = new_session(stack), new_session(stack)
    client = anthropic.Anthropic(base_url=stack.proxy.url, api_key=session["token"], max_retries=0)
    reply = client.messages.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": "Hi"}], stop_sequences=["never"]
    )
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic.Anthropic(
            base_url=f"{stack.proxy.url}/sessions/{session['session_id']}", api_key=other["token"], max_retries=0
        ).messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert len(finish(stack, session)[0].metadata["turns"]) == 1


def test_anthropic_errors_have_anthropics_shape(stack):
    session = new_session(stack)
    url = session["base_url"] + "/messages"
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        ({"model": "m", "messages": user}, "max_tokens: Field required"),
        (
            {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "blocks of type 'image'",
        ),
        (
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}
                ],
            },
            "unexpected `tool_use_id`",
        ),
        ({"model": "m", "max_tokens": 8, "messages": user, "frequency_penalty": 1}, "Extra inputs"),
        ({"model": "m", "max_tokens": 8, "messages": user, "temperature": 1.5}, "between 0.0 and 1.0"),
    ]
    for body, words in cases:
        response = httpx.post(url, json=body)
        assert response.status_code == 400
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert words in error["error"]["message"], error
    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[
                {
                    "role": "assistant",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
                    ],
                }
            ],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    # a bad session's 404 is Anthropic-shaped too
    missing = httpx.post(stack.proxy.url + "/sessions/sess_nope/v1/messages", json=copy.deepcopy(cases[0][0]))
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_a_strict_tool_renders_the_same_prompt_through_all_three_apis(stack):
    """The audit: Chat kept a tool's "strict": true, Responses and Anthropic dropped it, so one tool
    gave three different prompts. ``strict`` is a directive to the server, not text for the model."""
    session = new_session(stack)
    ask = [{"role": "user", "content": user_turns()[0]}]
    chat = openai.OpenAI(base_url=session["base_url"], api_key="x")
    chat.chat.completions.create(
        model="m", messages=ask, max_tokens=1, tools=[{"type": "function", "function": {**FUNCTION, "strict": True}}]
    )
    chat.chat.completions.create(model="m", messages=ask, max_tokens=1, tools=TOOLS)  # no strict at all
    chat.responses.create(model="m", input=ask, max_output_tokens=1, tools=[{**RESPONSES_TOOLS[0], "strict": True}])
    anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x").messages.create(
        model="m", max_tokens=1, messages=ask, tools=[{**ANTHROPIC_TOOLS[0], "strict": True}]
    )
    prompts = {tuple(s.tokens[: s.prompt_length]) for s in finish(stack, session)}
    assert len(prompts) == 1
