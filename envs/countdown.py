"""Countdown: reach the target with the given numbers, each used at most once, and + - * /.

The verifier is exact (fractions, no ``eval``): the answer is the expression inside the last
``<answer>…</answer>``; it must use only the given numbers (each at most as often as given) and
evaluate to the target. The reward is a dict: ``correct`` (1 or 0) and ``format`` (0.1 when an
answer tag holds a parsable expression), so ``--reward-key correct`` trains on correctness alone.
It is meant for real models (a random tiny one will not solve it).

Rows: ``{"input": prompt, "label": {"numbers": [...], "target": N}}``;
``python -m envs.countdown --out FILE.jsonl`` writes solvable ones.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from envs.arithmetic import BadExpression, evaluate, numbers_in
from envs.datasets import main

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def verify(text: str, numbers: list[int], target: int) -> dict[str, float]:
    found = ANSWER.findall(text or "")
    if not found:
        return {"correct": 0.0, "format": 0.0}
    expression = found[-1]
    try:
        value, used = evaluate(expression), numbers_in(expression)
    except (BadExpression, SyntaxError):
        return {"correct": 0.0, "format": 0.0}
    allowed = not (Counter(used) - Counter(numbers))
    return {"correct": float(allowed and value == target), "format": 0.1}


def prompt_for(numbers: list[int], target: int) -> str:
    return (
        f"Using the numbers {numbers}, each at most once, and + - * /, make {target}. "
        "Put the expression in <answer></answer>, e.g. <answer>(1 + 2) * 3</answer>."
    )


async def episode(task, client) -> dict[str, float]:
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    return verify(reply.choices[0].message.content or "", task.label["numbers"], task.label["target"])


def rows(count: int, rng: random.Random) -> list[dict]:
    out = []
    while len(out) < count:
        numbers = [rng.randint(1, 25) for _ in range(4)]
        a, b, c = rng.sample(numbers, 3)
        target = int(evaluate(f"({a} {rng.choice('+-*')} {b}) {rng.choice('+-*')} {c}"))
        if target > 0:
            out.append({"input": prompt_for(numbers, target), "label": {"numbers": numbers, "target": target}})
    return out


if __name__ == "__main__":
    main(rows, __doc__, 256)
