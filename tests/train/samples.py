"""Synthetic training Samples (random prompts and answers in GRPO groups), deterministic per seed."""

from __future__ import annotations

import random

from inverted.types import Sample


def make_samples(seed: int, groups: int = 2, per_group: int = 4, vocab: int = 1200) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        for i in range(per_group):
            n = rng.randint(1, 8)
            mask = [1] * n
            if n > 2:
                mask[1] = 0  # a tool-output token inside the response
            samples.append(
                Sample(
                    group_index=group,
                    index=group * per_group + i,
                    tokens=prompt + [rng.randrange(3, vocab) for _ in range(n)],
                    response_length=n,
                    loss_mask=mask,
                    rollout_log_probs=[-rng.random() * 3 for _ in range(n)],
                    weight_versions=["0"] * n,
                    reward=float(rng.random() > 0.5),
                    status=Sample.Status.COMPLETED,
                )
            )
    return samples


def write_jsonl(samples: list[Sample], path) -> None:
    import json

    with open(path, "w") as f:
        for sample in samples:
            f.write(json.dumps(sample.to_json()) + "\n")
