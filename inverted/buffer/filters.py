"""Group filters for ``--dynamic-sampling-filter-path``: ``fn(samples) -> bool`` keeps a complete group.

A filter sees every sample of one group (same prompt) and decides whether the trainer should see
it. Rejected groups are kept in the store as ``filtered`` and counted, never deleted.
"""

from __future__ import annotations

from inverted.types import Sample


def drop_all_equal_rewards(samples: list[Sample]) -> bool:
    """Keep a group only if its rewards differ: with all rewards equal, GRPO's advantages are all zero
    and the group teaches nothing (DAPO's dynamic sampling). A dict reward counts as its sum, as the
    trainer sees it by default."""
    rewards = {s.scalar_reward() if s.reward is not None else None for s in samples}
    return len(rewards) > 1
