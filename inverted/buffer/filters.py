"""Which complete groups the trainer sees: ``--dynamic-sampling-filter-path`` and ``--buffer-filter-path``.

A dynamic-sampling filter sees every sample of one group (same prompt) and decides whether the
trainer should see it (ours ``fn(samples) -> bool``, or slime's). Rejected groups are kept in the
store as ``filtered`` and counted, never deleted. A buffer filter (slime's) chooses, among the
groups waiting, which ones a batch takes; the others keep waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from inverted.buffer.config import BufferConfig
from inverted.config import plugin_flags
from inverted.plugins import load_hook
from inverted.types import Sample

GroupFilter = Callable[[list[Sample]], bool]
# (waiting groups, groups wanted, the trainer's version) -> positions of the groups to serve, in order
GroupChooser = Callable[[list[list[Sample]], int, "int | None"], list[int]]


def drop_all_equal_rewards(samples: list[Sample]) -> bool:
    """Keep a group only if its rewards differ: with all rewards equal, GRPO's advantages are all zero
    and the group teaches nothing (DAPO's dynamic sampling). A dict reward counts as its sum, as the
    trainer sees it by default."""
    rewards = {s.scalar_reward() if s.reward is not None else None for s in samples}
    return len(rewards) > 1


def load_group_filter(config: BufferConfig) -> GroupFilter | None:
    """``--dynamic-sampling-filter-path``: ``(samples) -> bool``, or a registered form (slime's
    ``(args, samples, **kw) -> DynamicFilterOutput``, its ``keep``)."""
    return load_hook(
        config.dynamic_sampling_filter_path,
        point="group_filter",
        flag="--dynamic-sampling-filter-path",
        forms={"ours": ["samples"]},
        flags=plugin_flags(config),
    )


def load_group_chooser(config: BufferConfig) -> GroupChooser | None:
    """``--buffer-filter-path``: which of the waiting complete groups a batch takes, ``(groups, wanted,
    version) -> positions``, or a registered form (slime's ``(args, rollout_id, buffer, num_samples) ->
    groups``)."""
    return load_hook(
        config.buffer_filter_path,
        point="group_chooser",
        flag="--buffer-filter-path",
        forms={"ours": ["groups", "wanted", "version"]},
        flags=plugin_flags(config),
    )
