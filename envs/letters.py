"""The demo task: start the reply with one of the letters the prompt names.

The prompt names one of two letter groups (``a b c d e`` or ``n o p q r s``), each asked equally often;
the reward is 1 when the reply's first character (after spaces) is a letter of that group, else 0. A
random policy starts its reply that way about one time in eight, and a policy that ignores the prompt
can score at most 0.5 (all its first letters in one group): to pass 0.8 the model must read which group
is asked for and move its first token's probability there. The tiny random-weight model learns this in a
few dozen GRPO steps on a laptop CPU, which makes it a real, quick end-to-end check of the loop:
proxy-recorded tokens, rewards, training and weight sync all have to be right for the reward to rise.

    python -m envs.letters --out data/letters.jsonl [--count 256] [--seed 0]
"""

from __future__ import annotations

import random

from envs.datasets import main

GROUPS = ("abcde", "nopqrs")


def prompt_for(group: str) -> str:
    return f"Start your reply with one of the letters {' '.join(group)}."


def first_character(text: str) -> str:
    return text.lstrip()[:1].lower()


def score(reply: str, group: str) -> float:
    return float(bool(first_character(reply)) and first_character(reply) in group)


async def episode(task, client) -> float:
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    return score(reply.choices[0].message.content or "", task.label)


def rows(count: int, rng: random.Random) -> list[dict]:
    groups = [GROUPS[i % len(GROUPS)] for i in range(count)]  # each group equally often
    rng.shuffle(groups)
    return [{"input": prompt_for(g), "label": g} for g in groups]


if __name__ == "__main__":
    main(rows, __doc__, 256)
