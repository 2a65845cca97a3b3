"""The default agent rollout against a real proxy and engine: one Sample per task, in order, with
the environment's reward, and the first wave's sessions opened in one request."""

from __future__ import annotations

import asyncio

import httpx
import openai

from inverted.plugins import RolloutContext
from inverted.rollout.config import RolloutConfig
from inverted.rollout.proxy.client import ProxyClient
from inverted.types import Sample, Task
from rollout_functions.agent import generate_rollout


async def reward_by_index(task: Task, client) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"task {task.index}"}])
    return float(task.index)


def test_the_first_wave_of_sessions_opens_in_one_request(agent_stack, monkeypatch):
    model, engine, proxy = agent_stack
    opened = []  # sessions asked for, per request
    real = ProxyClient.create_sessions

    async def counted(self, metadata, sampling_params=None, scripts=None):
        opened.append(len(metadata))
        return await real(self, metadata, sampling_params, scripts)

    monkeypatch.setattr(ProxyClient, "create_sessions", counted)
    tasks = [
        Task(lease_id="l", group_index=i // 3, index=i % 3, prompt_index=i // 3, prompt="p", label=f"label {i}")
        for i in range(7)
    ]
    ctx = RolloutContext(
        rollout_id=5,
        config=RolloutConfig(rollout_concurrency=4),
        proxy_url=proxy.url,
        proxy_api_key="admin-key",
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"temperature": 1.0, "max_tokens": 2},
        env=reward_by_index,
    )
    samples = asyncio.run(generate_rollout(ctx, tasks))

    assert opened == [4, 1, 1, 1]  # the first four together; each later one when a slot frees
    for task, sample in zip(tasks, samples, strict=True):
        assert sample.status != Sample.Status.FAILED, sample.metadata.get("error")
        assert (sample.group_index, sample.index, sample.label) == (task.group_index, task.index, task.label)
        assert sample.reward == float(task.index) and sample.metadata["rollout_id"] == 5
        assert 1 <= sample.response_length <= 2


async def refused_then_gives_up(task: Task, client) -> float:
    """Task 0 calls a route the proxy does not have, and the SDK raises; task 1 sends a temperature
    out of range, catches the refusal, and returns a reward without ever sampling."""
    if task.index == 0:
        await client.embeddings.create(model="policy", input="hi")
    try:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], temperature=5
        )
    except openai.BadRequestError:
        return 1.0
    raise AssertionError("the proxy took temperature 5")


def test_a_failed_episode_says_what_the_proxy_refused(agent_stack):
    model, engine, proxy = agent_stack
    tasks = [Task(lease_id="l", group_index=0, index=i, prompt_index=0, prompt="p") for i in range(2)]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(),
        proxy_url=proxy.url,
        proxy_api_key="admin-key",
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"max_tokens": 2},
        env=refused_then_gives_up,
    )
    missing_route, bad_value = asyncio.run(generate_rollout(ctx, tasks))

    assert missing_route.status == bad_value.status == Sample.Status.FAILED
    (refusal,) = missing_route.metadata["proxy_refused"]
    assert refusal["route"] == "POST /sessions/{session_id}/v1/embeddings" and refusal["status"] == 404
    assert "NotFoundError" in missing_route.metadata["error"] and "answered 404" in missing_route.metadata["error"]
    (refusal,) = bad_value.metadata["proxy_refused"]
    assert refusal["route"] == "POST /sessions/{session_id}/v1/chat/completions" and refusal["status"] == 400
    assert "temperature" in refusal["message"]
    assert bad_value.metadata["error"].startswith("the episode never called the model (the proxy refused 1 call(s)")
    # Logged with the route and reason (never the session id), and counted by route and status.
    log = proxy.log_path.read_text()
    assert "POST /sessions/{session_id}/v1/embeddings answered 404" in log and "sess_" not in log
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'inverted_proxy_rejected_total{route="(no route)",status="404"} 1.0' in metrics
    assert (
        'inverted_proxy_rejected_total{route="/sessions/{session_id}/v1/chat/completions",status="400"} 1.0' in metrics
    )
