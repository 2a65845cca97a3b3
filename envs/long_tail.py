"""A long-tailed agent: the letters task with a slow "tool" between two model calls.

Agentic workloads are long-tailed: most episodes are quick, a few wait long on tools, sandboxes
or other services. Here each episode asks the model, then waits for a simulated tool (the
prompt's ``metadata.latency_s`` seconds, as a real tool call would, without using a core), then
asks again with the tool's answer appended. The reward is the letters task's, on the last reply.
The dataset makes about one prompt in ten twenty times slower than the rest, so a synchronous
loop waits for its slowest episode every step while an asynchronous one keeps the servers busy
(``bench/async_speedup.py``).

    python -m envs.long_tail --out data/long_tail.jsonl [--count 256] [--seed 0]
"""

from __future__ import annotations

import asyncio
import random

from envs import letters
from envs.datasets import main

SHORT_S = 0.25  # latency of a quick episode's tool
LONG_EVERY = 10  # about one prompt in this many is slow ...
LONG_FACTOR = 20  # ... and this many times slower


async def episode(task, client) -> float:
    messages = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    await asyncio.sleep(task.metadata["latency_s"])
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "The tool is done. " + task.prompt},
    ]
    last = await client.chat.completions.create(model="policy", messages=messages)
    return letters.score(last.choices[0].message.content or "", task.label)


def rows(count: int, rng: random.Random) -> list[dict]:
    out = letters.rows(count, rng)
    for row in out:
        slow = rng.randrange(LONG_EVERY) == 0
        row["metadata"] = {"latency_s": SHORT_S * (LONG_FACTOR if slow else 1)}
    return out


if __name__ == "__main__":
    main(rows, __doc__, 256)
