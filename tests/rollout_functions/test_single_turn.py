"""slime's default rollout against a real engine over HTTP: exact prompt ids, logprobs, versions, reward."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from inverted.plugins import RewardModel, RolloutContext
from inverted.rollout.config import RolloutConfig
from inverted.types import Sample, Task
from rollout_functions.single_turn import generate_rollout


async def reward_by_length(sample: Sample) -> dict[str, float]:
    return {"length": float(sample.response_length)}


def test_single_turn_records_what_the_engine_sampled(tiny_model, procs):
    model = tiny_model()
    engine = procs.engine(model, "--weight-version", "7")
    messages = [{"role": "user", "content": "Name a color."}]
    tasks = [
        Task(lease_id="l", group_index=0, index=i, prompt_index=0, prompt=p, label="x")
        for i, p in enumerate([messages, messages, "plain text prompt"])
    ]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(rollout_max_response_len=5),
        proxy_url="",
        proxy_api_key=None,
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 5},
    )
    samples = asyncio.run(generate_rollout(ctx, tasks))
    assert {s.reward for s in samples} == {None}  # the job scores them, for every rollout function alike
    asyncio.run(RewardModel(one=lambda ctx, sample: reward_by_length(sample)).score(ctx, samples))

    tokenizer = AutoTokenizer.from_pretrained(model)
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected_prompts = [chat_ids, chat_ids, tokenizer.encode("plain text prompt", add_special_tokens=False)]
    for task, sample, prompt in zip(tasks, samples, expected_prompts):
        sample.validate()
        assert (sample.group_index, sample.index, sample.label) == (task.group_index, task.index, "x")
        assert sample.tokens[: sample.prompt_length] == prompt and 1 <= sample.response_length <= 5
        assert sample.weight_versions == ["7"] * sample.response_length
        assert sample.loss_mask == [1] * sample.response_length
        assert sample.reward == {"length": float(sample.response_length)}
        assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        assert all(lp <= 0 for lp in sample.rollout_log_probs)


def test_single_turn_logprobs_are_the_engines(tiny_model, procs):
    """The recorded logprobs are what the engine gives the same tokens when it scores them again."""
    import httpx

    model = tiny_model()
    engine = procs.engine(model)
    task = Task(lease_id="l", group_index=0, index=0, prompt_index=0, prompt="hello world")
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(),
        proxy_url="",
        proxy_api_key=None,
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4},
    )
    (sample,) = asyncio.run(generate_rollout(ctx, [task]))
    scored = httpx.post(
        engine.url + "/generate",
        timeout=60,
        json={
            "input_ids": sample.tokens,
            "return_logprob": True,
            "logprob_start_len": sample.prompt_length - 1,
            "sampling_params": {"max_new_tokens": 0},
        },
    ).json()
    recomputed = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"]][1:]
    assert recomputed == pytest.approx(sample.rollout_log_probs, abs=1e-4)
