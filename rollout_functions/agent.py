"""The default rollout: run the ``--env-path`` environment once per task, through the proxy.

Each episode gets its own proxy session and an ``openai.AsyncOpenAI`` client whose ``base_url``
is that session, so every token the environment's calls produce is recorded exactly, whatever
the environment does with the replies. The environment's return value is the reward.

The clients share one connection pool (``openai_pool``).
"""

from __future__ import annotations

import openai

from inverted.plugins import RolloutContext
from inverted.rollout.proxy.client import openai_pool
from inverted.types import Sample, Task
from rollout_functions.episodes import run_all


async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
    return await play_envs(ctx, tasks)


async def play_envs(
    ctx: RolloutContext, tasks: list[Task], scripts: list[list[list[int]]] | None = None
) -> list[Sample]:
    """Each task's episode of ``ctx.env`` (``scripts``: each session answers from its own, ``run_all``)."""
    env = ctx.env
    async with openai_pool() as pool:

        def play_for(task: Task):
            async def play(session, proxy):
                # The SDK's retries are safe: the proxy answers a retried call from its record.
                client = openai.AsyncOpenAI(
                    base_url=session.base_url,
                    api_key=session.token,
                    http_client=pool,
                    timeout=ctx.config.rollout_episode_timeout,
                )
                return await env(task, client)

            return play

        return await run_all(ctx, tasks, play_for, scripts)


generate_rollout.requires = ("env_path",)  # checked by the job before anything starts
