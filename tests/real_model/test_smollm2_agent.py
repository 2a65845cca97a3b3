"""The agent path on the real model: SmolLM2 with ``--chat-template``, driven by an unchanged openai-agents agent.

``make agent``'s stage-1 agent (``envs/calculator_agent.py``'s coached one) plays greedily through the real proxy and
engine, as the job plays it. The recorded Sample of each episode must be the shipped template's
render of the conversation the SDK holds (``RunResult.to_input_list``), token for token, with the
model's sampled tokens, and only those, in the loss, each with the log-prob ``transformers`` gives
it. Then one GRPO step of the Megatron trainer on such episodes must move the policy toward the
rewarded one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from envs import calculator_agent, reasoning_gym
from envs.arithmetic import calculate
from inverted.config import from_flags
from inverted.controller.batches import episode_metrics
from inverted.hf_checkpoint import load_tokenizer
from inverted.rollout.chat import HermesToolParser
from inverted.rollout.proxy.client import ProxyClient
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from inverted.types import Sample
from tests.train.workers import grpo_step

pytestmark = pytest.mark.slow  # a real model through every part: left out of make test-fast

TEMPLATE = Path(__file__).resolve().parents[2] / "inverted" / "chat_template.jinja"
CONFIG = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"]}
# The tool as the proxy renders it from the Responses request the SDK sends.
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": calculator_agent.calculator.description,
        "parameters": calculator_agent.calculator.params_json_schema,
    },
}


@pytest.fixture(scope="module")
def episodes(module_procs, smollm2):
    """Eight greedy episodes of the agent through the proxy: (row, agent result, Sample) each."""
    engine = module_procs.engine(smollm2, name="smollm2-agent")
    proxy = module_procs.proxy(engine.url, smollm2, "--chat-template", str(TEMPLATE))
    rows = reasoning_gym.rows("basic_arithmetic", CONFIG, 8, 1000000)

    async def play(row: dict, proxy_client: ProxyClient):
        session = await proxy_client.create_session(Sample(), {"temperature": 0, "max_tokens": 32})
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token) as client:
            result = await calculator_agent.run(row["input"], client, calculator_agent.coached_agent)
        (sample,) = await proxy_client.finish(session.session_id, 0.0)
        return row, result, sample

    async def play_all():
        async with ProxyClient(proxy.url) as proxy_client:
            return await asyncio.gather(*(play(row, proxy_client) for row in rows))

    return asyncio.run(play_all())


def as_chat(question: str, items: list[dict]) -> list[dict]:
    """The SDK's record of a run (Responses input items) as the Chat Completions messages a template renders."""
    messages = [
        {"role": "system", "content": calculator_agent.COACHED_INSTRUCTIONS},
        {"role": "user", "content": question},
    ]
    for item in items[1:]:
        kind = item.get("type")
        if kind == "function_call":
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": item["call_id"],
                            "type": "function",
                            "function": {"name": item["name"], "arguments": json.loads(item["arguments"])},
                        }
                    ],
                }
            )
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": "assistant", "content": "".join(part["text"] for part in item["content"])})
    return messages


def test_a_tool_calling_episode_is_recorded_as_the_template_renders_it(episodes, smollm2):
    tokenizer = load_tokenizer(smollm2, TEMPLATE)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    finished = [(row, result, sample) for row, result, sample in episodes if result is not None]
    with_tool = [e for e in finished if any(t["finish_reason"] == "tool_calls" for t in e[2].metadata["turns"])]
    assert with_tool, [s.metadata["turns"] for _, _, s in episodes]  # greedy SmolLM2 calls it on most questions
    for row, result, sample in with_tool:
        messages = as_chat(row["input"], result.to_input_list())
        assert [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant"]
        (call,) = messages[2]["tool_calls"]
        assert messages[3]["content"] == calculate(call["function"]["arguments"]["expression"])
        call_turn = sample.metadata["turns"][0]
        assert call_turn["forced"] == HermesToolParser().forced("calculator")  # what the proxy wrote, said
        written = tokenizer.decode(sample.tokens[call_turn["start"] : call_turn["end"]], skip_special_tokens=True)
        if not written.endswith("</tool_call>"):
            # The model wrote on after its call (untrained SmolLM2 does, until max_tokens): the parser
            # leaves that text out of the message, as SGLang's does, and the SDK never sees it, but
            # the model did sample it and the next turn's prompt holds it. So the conversation to
            # render is the one the model wrote: its whole reply, after the opening the proxy forced.
            messages[2] = {"role": "assistant", "content": HermesToolParser().forced("calculator") + written}
        rendered = tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False)
        # token for token: the episode ends at the sampled <|im_end|>, before the template's "\n"
        assert sample.tokens == tokenizer.encode(rendered, add_special_tokens=False)[:-1]
        # in the loss: exactly what the model sampled in its two turns; the forced opening of the
        # call (tool_choice "required"), the tool's answer and the template's glue are not
        mask = [0] * len(sample.tokens)
        for turn in sample.metadata["turns"]:
            mask[turn["start"] : turn["end"]] = [1] * (turn["end"] - turn["start"])
        assert sample.loss_mask == mask[sample.prompt_length :] and len(sample.metadata["turns"]) == 2
        glue = tokenizer.decode([t for t, m in zip(sample.response_tokens, sample.loss_mask) if not m])
        assert f"<tool_response>\n{messages[3]['content']}\n</tool_response>" in glue
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([sample.tokens])).logits[0], dim=-1)
        for i, (token, logprob, trained) in enumerate(
            zip(sample.response_tokens, sample.rollout_log_probs, sample.loss_mask)
        ):
            at = sample.prompt_length + i
            assert abs(logprob - reference[at - 1, token].item()) <= 1e-4 if trained else logprob == 0.0
        # the reward is reasoning-gym's grade of the SDK's final output
        assert calculator_agent.grade(result, row["metadata"]) == reasoning_gym.score(
            messages[-1]["content"], row["metadata"]
        )


def test_one_grpo_step_on_agent_episodes_moves_the_policy_toward_the_rewarded_one(episodes, smollm2, tmp_path):
    """Two recorded multi-turn episodes as one group, the first rewarded: after one step its sampled
    tokens are likelier and the other's less likely (the trainer is under test, so the rewards are set)."""
    recorded = [sample for _, result, sample in episodes if result is not None][:2]
    assert len(recorded) == 2
    # copies: the module's episodes stay as recorded for the other tests
    two = [
        dataclasses.replace(sample, group_index=0, index=index, reward=reward)
        for index, (sample, reward) in enumerate(zip(recorded, (1.0, 0.0)))
    ]
    cfg = from_flags(TrainConfig, hf_checkpoint=str(smollm2), lr=1e-5, output_dir=str(tmp_path))
    spawn(grpo_step, 1, cfg, two, str(tmp_path / "grpo.pt"))
    result = torch.load(tmp_path / "grpo.pt")
    gains = []
    for index, sample in enumerate(two):
        trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
        before, after = result["before"][index][trained], result["after"][index][trained]
        # before the step the trainer scores the sampled tokens as the engine did
        assert (before - torch.tensor(sample.rollout_log_probs)[trained]).abs().max() <= 1e-4
        gains.append(float(after.sum() - before.sum()))
    assert gains[0] > 0 > gains[1], gains


def test_the_tool_call_rate_and_turns_count_what_the_agent_did(episodes):
    """``eval/tool_call_rate`` and ``eval/turns_mean`` come from the proxy's record; they must say what
    the SDK says happened: its model calls, and whether one of them called the tool."""
    finished = [(result, sample) for _, result, sample in episodes if result is not None]
    items = [result.to_input_list() for result, _ in finished]
    calls = [sum(i.get("type") == "function_call" for i in run) for run in items]
    turns = [sum(i.get("type") == "function_call" or i.get("role") == "assistant" for i in run) for run in items]
    metrics = episode_metrics("eval", [sample for _, sample in finished])
    assert metrics["eval/tool_call_rate"] == sum(n > 0 for n in calls) / len(finished) > 0
    assert metrics["eval/turns_mean"] == sum(turns) / len(finished) > 1
