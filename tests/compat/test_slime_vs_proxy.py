"""One calculator task two ways, token for token: our agent rollout (``envs.calculator`` through the
proxy) and slime's custom generate function (``slime_plugins.calculator_episode``, calling the
router itself) give the same Samples for the same seed.

The engine serves a tiny model taught one calculator conversation, so the model really calls the
tool: the tool's answer (and, for a question the model gets wrong, the retry message) are tokens
it did not sample, masked out alike on both paths.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from envs import calculator as calc
from inverted.config import to_flags
from inverted.plugins import RolloutContext, load_hook
from inverted.rollout.config import RolloutConfig
from inverted.types import Sample, Task
from rollout_functions import agent, single_turn
from tests.rollout.proxy.scripted import teach

CONVERSATION = [
    {"role": "system", "content": calc.SYSTEM},
    {"role": "user", "content": "What is 12 * 7?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "84"},
    {"role": "assistant", "content": "84"},
]
KEY = "admin-key"


@pytest.fixture(scope="module")
def stack(module_procs, tiny_model, models_dir):
    model = models_dir / "taught-calculator"
    if not (model / "config.json").exists():
        teach(tiny_model("qwen2"), model, conversation=CONVERSATION, tools=calc.TOOLS)
    engine = module_procs.engine(model, "--admin-api-key", KEY, "--weight-version", "3")
    router = module_procs.routed(engine)
    proxy = module_procs.proxy(router.url, model, "--proxy-api-key", KEY)
    return model, engine, router, proxy


def run(stack, rollout, sampling: dict, **extra) -> list[Sample]:
    """Every task, one at a time, with the engine's prefix cache emptied first: both paths then put
    the same computations on the engine, so its logprobs agree to the last bit."""
    model, engine, router, proxy = stack
    assert httpx.post(engine.url + "/flush_cache", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    tasks = [
        Task(lease_id="l", group_index=g, index=0, prompt_index=g, prompt=question, label=answer, tools=calc.TOOLS)
        for g, (question, answer) in enumerate([("What is 12 * 7?", 84), ("What is 30 + 5?", 35)])
    ]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(rollout_concurrency=1),
        proxy_url=proxy.url,
        proxy_api_key=KEY,
        router_url=router.url,
        hf_checkpoint=str(model),
        sampling=sampling,
        **extra,
    )
    return asyncio.run(rollout.generate_rollout(ctx, tasks))


@pytest.mark.parametrize("seed", [1, 2])
def test_the_agent_rollout_and_a_slime_generate_function_record_the_same_tokens(stack, seed):
    model, _, router, _ = stack
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 40, "seed": seed}
    ours = run(stack, agent, sampling, env=calc.episode)
    flags = to_flags(RolloutConfig()) | {"hf_checkpoint": str(model)}
    generate = load_hook(
        "tests.compat.slime_plugins:calculator_episode",
        point="generate",
        flag="--custom-generate-function-path",
        flags=flags,
    )  # slime's form, adapted
    theirs = run(stack, single_turn, sampling, generate=generate, flags=flags)

    for a, b in zip(ours, theirs, strict=True):
        a.validate()
        b.validate()
        assert a.tokens == b.tokens and a.prompt_length == b.prompt_length
        assert a.loss_mask == b.loss_mask
        assert a.rollout_log_probs == b.rollout_log_probs
        assert a.weight_versions == b.weight_versions == ["3"] * a.response_length
        assert a.reward == b.reward and a.status == b.status
        # the model called the calculator: its first turn, then the tool's answer, masked out
        assert a.metadata["turns"][0]["finish_reason"] == "tool_calls"
        assert a.loss_mask[0] == 1 and 0 in a.loss_mask
    assert ours[0].reward == 1.0  # the taught question: the tool, then its answer
    assert len(ours[1].metadata["turns"]) == calc.MAX_TURNS  # a wrong answer gets the retry message
