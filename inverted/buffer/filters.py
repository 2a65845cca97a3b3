"""Which complete groups the trainer sees: ``--dynamic-sampling-filter-path`` and ``--buffer-filter-path``.

A dynamic-sampling filter sees every sample of one group (same prompt) and decides whether the
trainer should see it (ours ``fn(samples) -> bool``, or slime's). Rejected groups are kept in the
store as ``filtered`` and counted, never deleted. A buffer filter (slime's) chooses, among the
groups waiting, which ones a batch takes; the others keep waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from inverted.compat import slime
from inverted.config import BufferConfig, to_flags
from inverted.errors import PluginError
from inverted.plugins import load_forms, load_plugin
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
    """``--dynamic-sampling-filter-path``: ours ``(samples) -> bool``, or slime's ``(args, samples, **kw) ->
    DynamicFilterOutput`` (its ``keep``)."""
    if not config.dynamic_sampling_filter_path:
        return None
    form, fn = load_forms(config.dynamic_sampling_filter_path, flag="--dynamic-sampling-filter-path",
                          forms={"ours": ["samples"], "slime": ["args", "samples"]})
    if form == "ours":
        return fn
    args = slime.SlimeArgs.of(to_flags(config))
    return lambda samples: bool(fn(args, [slime.from_inverted(s, args=args) for s in samples]).keep)


def load_group_chooser(config: BufferConfig) -> GroupChooser | None:
    """``--buffer-filter-path``, slime's ``(args, rollout_id, buffer, num_samples) -> groups``: which of
    the waiting complete groups a batch takes (the groups it returns, by identity)."""
    if not config.buffer_filter_path:
        return None
    fn = load_plugin(config.buffer_filter_path, flag="--buffer-filter-path",
                     params=["args", "rollout_id", "buffer", "num_samples"])
    args = slime.SlimeArgs.of(to_flags(config))

    def choose(groups: list[list[Sample]], wanted: int, version: int | None) -> list[int]:
        views = [[slime.from_inverted(s, args=args) for s in group] for group in groups]
        position = {id(group): i for i, group in enumerate(views)}
        chosen = fn(args, version or 0, list(views), wanted)
        if any(id(group) not in position for group in chosen):
            raise PluginError(f"--buffer-filter-path {config.buffer_filter_path}: return groups of the buffer it was "
                              "given (the lists themselves), not copies")
        return [position[id(group)] for group in chosen]

    return choose
