"""Agents that send the model's reply back rewritten: smolagents' ToolCallingAgent, unchanged, stays
on one branch, each turn exact; a rewrite that does not match the recorded reply still forks."""

from __future__ import annotations

import json

import httpx
import pytest
import smolagents
from smolagents import tool
from transformers import AutoTokenizer

from inverted.rollout.chat import ParsedReply, ToolCall, new_call_id, parse_messages
from inverted.rollout.proxy.rewrites import same, smolagents_tool_calls
from inverted.types import Sample
from tests.rollout.proxy.test_recording import check_exact

STEPS = 3


class EveryReplyALookup:
    """A tool parser (``--proxy-tool-parser-path``) that reads any reply as a call of ``lookup``
    with the reply as its city: the random tiny model never writes a well-formed call itself."""

    start = "<tool_call>"

    def forced(self, name: str) -> str:
        return ""

    def parse(self, text: str) -> ParsedReply:
        return ParsedReply(content=None, tool_calls=[ToolCall(new_call_id(), "lookup", json.dumps({"city": text}))])


@tool
def lookup(city: str) -> str:
    """The weather of a city.

    Args:
        city: the city
    """
    return f"sunny in {city[:8]}"


def key(message: dict) -> tuple:
    (parsed,) = parse_messages([message])
    return parsed.key


RECORDED = key(
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    }
)


def smolagents_text(text: str, arguments) -> str:
    return (
        text
        + "\nCalling tools:\n"
        + str([{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}])
    )


def test_smolagents_rewrite_is_recognised_only_when_it_says_what_was_recorded():
    rewritten = smolagents_text("Let me look.", {"days": 2, "city": "Paris"})  # key order is not significant
    assert smolagents_tool_calls(RECORDED, key({"role": "assistant", "content": rewritten}))
    for wrong in (
        smolagents_text("Let me look again.", {"city": "Paris", "days": 2}),  # other text
        smolagents_text("Let me look.", {"city": "Rome", "days": 2}),  # other arguments
        "Let me look.\nCalling tools:\n[{'id': 'call_1', 'type': 'function'",  # cut off
        "Let me look.\nCalling tools:\n__import__('os').system('true')",  # code: never evaluated
        "Let me look.",
    ):
        assert not smolagents_tool_calls(RECORDED, key({"role": "assistant", "content": wrong})), wrong
    assert not same(RECORDED, key({"role": "user", "content": rewritten}))
    assert same(RECORDED, RECORDED)


@pytest.fixture
def stack(tiny_model, procs):
    model = tiny_model()
    engine = procs.engine(model, "--log-requests")
    proxy = procs.proxy(
        engine.url, model, "--proxy-api-key", "k", "--proxy-tool-parser-path", f"{__name__}:EveryReplyALookup"
    )
    return model, engine, proxy


def engine_requests(engine) -> list[dict]:
    lines = engine.log_path.read_text().splitlines()
    return [json.loads(line.split(" request ", 1)[1]) for line in lines if " request {" in line]


def test_an_unchanged_smolagents_tool_calling_agent_is_one_branch_until_its_final_answer(stack):
    model_dir, engine, proxy = stack
    admin = {"Authorization": "Bearer k"}
    session = httpx.post(proxy.url + "/sessions", json={"sampling_params": {"max_tokens": 5}}, headers=admin).json()
    model = smolagents.OpenAIServerModel(model_id="policy", api_base=session["base_url"], api_key=session["token"])
    agent = smolagents.ToolCallingAgent(tools=[lookup], model=model, max_steps=STEPS, verbosity_level=0)
    agent.run("What is the weather in Paris?")
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    assert [len(s.tool_calls or []) for s in steps[:STEPS]] == [1] * STEPS  # each step called the tool

    finished = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish", headers=admin).json()
    samples = [Sample.from_json(s) for s in finished["samples"]]
    # Every step continued the branch, though smolagents sent each earlier call back as
    # "Calling tools:" text and its result as a user "Observation:"; only the final-answer call,
    # which asks something else of a shortened history, forks.
    assert [len(s.metadata["turns"]) for s in samples] == [STEPS, 1]
    log = engine_requests(engine)
    for sample in samples:
        check_exact(sample, log)
    # The model sees its own calls as it wrote them, and the agent's words for what followed.
    first_reply = samples[0].metadata["turns"][0]["start"]
    later = AutoTokenizer.from_pretrained(model_dir).decode(samples[0].tokens[first_reply:])
    assert later.count("Observation:") == STEPS - 1 and "Calling tools:" not in later
