"""Environments, and the library adapters played through the real proxy and engine (``agent_stack`` in conftest)."""

from __future__ import annotations

import asyncio

from inverted.plugins import RolloutContext
from inverted.rollout.config import RolloutConfig
from inverted.types import Sample, Task
from rollout_functions.agent import generate_rollout


def play(agent_stack, rows: list[dict], episode, **sampling) -> list[Sample]:
    """Each row as a task of its own, played by ``episode`` through the default agent rollout with the
    session's ``sampling``; none may fail."""
    model, engine, proxy = agent_stack
    tasks = [
        Task(
            lease_id="l",
            group_index=i,
            index=0,
            prompt_index=i,
            prompt=row["input"],
            label=row.get("label"),
            metadata=row["metadata"],
        )
        for i, row in enumerate(rows)
    ]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(),
        proxy_url=proxy.url,
        proxy_api_key="admin-key",
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling=sampling,
        env=episode,
    )
    samples = asyncio.run(generate_rollout(ctx, tasks))
    for sample in samples:
        assert sample.status != Sample.Status.FAILED, sample.metadata.get("error")
    return samples
