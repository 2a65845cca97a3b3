"""Group filters for ``--dynamic-sampling-filter-path``: ``fn(samples) -> bool`` keeps a complete group.

A filter sees every sample of one group (same prompt) and decides whether the trainer should see
it. Rejected groups are kept in the store as ``filtered`` and counted, never deleted.
"""

from __future__ import annotations

from inverted.types import Sample


def _scalar(reward: float | dict[str, float] | None) -> float | None:
    if isinstance(reward, dict):
        return reward.get("reward", sum(reward.values()))
    return reward


def drop_all_equal_rewards(samples: list[Sample]) -> bool:
    """Keep a group only if its rewards differ: with all rewards equal, GRPO's advantages are all zero
    and the group teaches nothing (DAPO's dynamic sampling)."""
    rewards = {_scalar(s.reward) for s in samples}
    return len(rewards) > 1
