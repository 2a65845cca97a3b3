"""What every harness's episode must show: no call refused, two model calls with a tool call between,
and a Sample that is the chat template's render of what the harness sent, token for token, with the
mask 1 exactly on sampled tokens and the engine's logprobs (checked against ``transformers``)."""

from __future__ import annotations

from typing import Any

from tests.harnesses.conftest import HarnessStack, Played
from tests.rollout.proxy.test_recording import check_exact, reference_logprobs


def check_episode(stack: HarnessStack, played: Played, last_render: str) -> None:
    """``last_render``: the template's render of the harness's last main request (with the generation prompt)."""
    refused = [(r["path"], r.get("status")) for r in played.requests if r.get("status", 200) >= 400]
    assert not refused, refused
    sample = played.episode
    turns = sample.metadata["turns"]
    assert len(turns) >= 2 and turns[0]["finish_reason"] == "tool_calls", turns
    check_exact(sample, [r for r in played.engine_log])
    prompt = stack.tokenizer.decode(sample.tokens[:turns[-1]["start"]])
    assert prompt == last_render
    expected = reference_logprobs(stack.loaded, sample)
    sampled = [(got, ref) for got, ref, m in zip(sample.rollout_log_probs, expected, sample.loss_mask) if m]
    assert len(sampled) == sum(t["end"] - t["start"] for t in turns)
    assert max(abs(got - ref) for got, ref in sampled) <= 1e-3


def render(stack: HarnessStack, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return stack.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                               add_generation_prompt=True)
