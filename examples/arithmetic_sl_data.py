"""Write addition conversations for tinker-cookbook's ``chat_sl`` recipe, none of them a problem ``math_rl`` will pose.

    python examples/arithmetic_sl_data.py --out data/arithmetic_sl.jsonl --count 2048

Each line is ``{"messages": [...]}`` (the cookbook's conversation file format): the arithmetic
environment's own few-shot exchange, then ``What is X + Y?`` and the sum, as ``math_rl env=arithmetic``
renders them. A short supervised warm-up on these is how a model that cannot add yet starts the RL
recipe with some right answers in each group (``make tinker-rl-warm``). The RL recipe draws batch
``i``'s problems from ``numpy.random.RandomState(i)``; the problems of its first ``--rl-batches`` batches
of up to ``--rl-batch-size`` groups are left out here, so its reward stays a held-out measure.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv

HIGH = 101  # the recipe's operands are randint(0, 101): 0 to 100


def rl_problems(batches: int, batch_size: int) -> set[tuple[int, int]]:
    """The (x, y) pairs ``ArithmeticDataset.get_batch(i)`` poses for each i < ``batches``, at any batch size up
    to ``batch_size`` (a smaller batch poses a prefix of a larger one's)."""
    posed = set()
    for index in range(batches):
        rng = np.random.RandomState(index)
        for _ in range(batch_size):
            posed.add((int(rng.randint(0, HIGH)), int(rng.randint(0, HIGH))))
    return posed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--rl-batches", type=int, default=64)
    parser.add_argument("--rl-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    posed = rl_problems(args.rl_batches, args.rl_batch_size)
    pool = [(x, y) for x in range(HIGH) for y in range(HIGH) if (x, y) not in posed]
    if args.count > len(pool):
        parser.error(f"--count {args.count}: only {len(pool)} problems are left once the RL recipe's are out")
    chosen = random.Random(args.seed).sample(pool, args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for x, y in chosen:
            messages = [
                *ArithmeticEnv.standard_fewshot_prefix(),
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    print(f"{args.count} conversations -> {args.out} ({len(posed)} of the RL recipe's problems left out)")


if __name__ == "__main__":
    main()
