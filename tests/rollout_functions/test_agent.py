"""The default agent rollout against a real proxy and engine: one Sample per task, in order, with
the environment's reward, and the first wave's sessions opened in one request."""

from __future__ import annotations

import asyncio

from inverted.config import RolloutConfig
from inverted.plugins import RolloutContext
from inverted.rollout.proxy.client import ProxyClient
from inverted.types import Sample, Task
from rollout_functions.agent import generate_rollout


async def reward_by_index(task: Task, client) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"task {task.index}"}])
    return float(task.index)


def test_the_first_wave_of_sessions_opens_in_one_request(tiny_model, procs, monkeypatch):
    model = tiny_model()
    engine = procs.engine(model)
    proxy = procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
    opened = []  # sessions asked for, per request
    real = ProxyClient.create_sessions

    async def counted(self, metadata, sampling_params=None):
        opened.append(len(metadata))
        return await real(self, metadata, sampling_params)

    monkeypatch.setattr(ProxyClient, "create_sessions", counted)
    tasks = [Task(lease_id="l", group_index=i // 3, index=i % 3, prompt_index=i // 3, prompt="p", label=f"label {i}")
             for i in range(7)]
    ctx = RolloutContext(rollout_id=5, config=RolloutConfig(rollout_concurrency=4), proxy_url=proxy.url,
                         proxy_api_key="admin-key", router_url=engine.url, hf_checkpoint=str(model),
                         sampling={"temperature": 1.0, "max_tokens": 2}, env=reward_by_index)
    samples = asyncio.run(generate_rollout(ctx, tasks))

    assert opened == [4, 1, 1, 1]  # the first four together; each later one when a slot frees
    for task, sample in zip(tasks, samples, strict=True):
        assert sample.status != Sample.Status.FAILED, sample.metadata.get("error")
        assert (sample.group_index, sample.index, sample.label) == (task.group_index, task.index, task.label)
        assert sample.reward == float(task.index) and sample.metadata["rollout_id"] == 5
        assert 1 <= sample.response_length <= 2
