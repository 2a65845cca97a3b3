"""What every harness's episode must show: no call refused, two model calls with a tool call between,
and a Sample that is the chat template's render of what the harness sent, token for token, with the
mask 1 exactly on sampled tokens and the engine's logprobs (checked against ``transformers``)."""

from __future__ import annotations

from typing import Any

from tests.harnesses.conftest import HarnessStack, Played
from tests.harnesses.sent import conversation
from tests.rollout.proxy.test_recording import check_exact, reference_logprobs


def check_episode(stack: HarnessStack, played: Played, request: dict[str, Any], replies: list[str]) -> None:
    """``request``: the harness's last main request, as the tap recorded it; ``replies``: what the model
    was taught to write, in order."""
    refused = [(r["path"], r.get("status")) for r in played.requests if r.get("status", 200) >= 400]
    assert not refused, refused
    calls = [turn for _, turn in played.calls]
    assert len(calls) >= 2 and calls[0]["finish_reason"] == "tool_calls", calls
    for sample in played.main:  # each branch exact: what the engine saw and sampled, the mask, the logprobs
        check_exact(sample, played.engine_log)
        expected = reference_logprobs(stack.loaded, sample)
        turns = sample.metadata["turns"]
        sampled = [(got, ref) for got, ref, m in zip(sample.rollout_log_probs, expected, sample.loss_mask) if m]
        assert len(sampled) == sum(t["end"] - t["start"] for t in turns)
        assert max(abs(got - ref) for got, ref in sampled) <= 1e-3
    episode = played.episode
    prompt = stack.tokenizer.decode(episode.tokens[: episode.metadata["turns"][-1]["start"]])
    messages, tools = conversation(request)
    rendered = render(stack, as_sampled(messages, replies), tools)
    assert prompt[: len(rendered)] == rendered, (prompt[-400:], rendered[-400:])
    # past the render, only a call's opening the proxy wrote for tool_choice required or named
    assert prompt[len(rendered) :] in ("", "<tool_call>") or prompt[len(rendered) :].startswith(
        '<tool_call>\n{"name": '
    ), prompt[len(rendered) :]


def as_sampled(messages: list[dict], replies: list[str]) -> list[dict]:
    """The conversation with each assistant message as the model wrote it (the replies, in order): the
    proxy keeps the sampled tokens, where a harness sends a reply back re-serialized (pydantic-ai's
    compact JSON arguments) or rewritten (smolagents' "Calling tools:" text)."""
    written = iter(replies)
    return [
        {"role": "assistant", "content": next(written).removesuffix("<|im_end|>")} if m["role"] == "assistant" else m
        for m in messages
    ]


def render(stack: HarnessStack, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return stack.tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=True
    )
