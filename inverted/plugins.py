"""Loading user plug-ins by path: ``module:function`` (slime's dotted ``module.function`` too).

Each plug-in point has a flag ending in ``-path`` and an expected signature. ``load_plugin``
imports once at startup and checks the callable's parameters against the expected names, so a
wrong path or signature fails before any process starts, with the flag, the path and the
signature in the message. Defaults are loaded the same way, through their path strings.

It also holds the contract of the biggest plug-in point, the rollout function (``--rollout-function-path``):

    async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]

one Sample per task (``task.new_sample()`` gives one with the task's group and index; match is by
``(group_index, index)``, order does not matter). A rollout function names the flags it cannot run
without in a ``requires`` attribute (``RolloutConfig`` field names, e.g. ``("env_path",)``); the job
checks them before anything starts. slime's ``generate_rollout(args, rollout_id,
data_buffer, evaluation=False) -> list[list[Sample]]`` is accepted too: it runs in a thread with a
``data_buffer`` whose ``get_samples(n)`` hands out the leased tasks as groups of Samples to fill.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from inverted.config import RolloutConfig
from inverted.errors import PluginError
from inverted.types import Reward, Sample, Task


def load_plugin(path: str, *, flag: str, params: list[str]) -> Callable[..., Any]:
    """Import ``path`` and check that it accepts ``params`` positionally (extra defaults are fine)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    expected = f"def {attr or 'fn'}({', '.join(params)})"
    if not module_name or not attr:
        raise PluginError(f"{flag}={path!r}: expected 'module:function' with signature {expected}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{flag}={path!r}: cannot load it ({exc}); expected {expected}") from None
    if not callable(fn):
        raise PluginError(f"{flag}={path!r}: not callable; expected {expected}")
    try:
        signature = inspect.signature(fn)
        signature.bind(*params)
    except ValueError:  # builtins and some extension types publish no signature
        raise PluginError(f"{flag}={path!r}: its signature cannot be read; expected {expected}") from None
    except TypeError as exc:
        raise PluginError(f"{flag}={path!r}: signature {signature} does not match {expected} ({exc})") from None
    return fn


@dataclass(slots=True)
class RolloutContext:
    """What a rollout function gets besides its tasks: where to send requests, and how to sample."""

    rollout_id: int
    config: RolloutConfig
    proxy_url: str  # the token-recording proxy: open one session per episode there
    proxy_api_key: str | None
    router_url: str  # sgl-router's SGLang /generate, for rollouts that record tokens themselves
    hf_checkpoint: str  # the tokenizer and chat template the policy uses
    sampling: dict[str, Any]  # OpenAI request fields every episode samples with (temperature, top_p, max_tokens)
    env: Callable[[Task, Any], Awaitable[Reward]] | None = None  # from --env-path
    reward_fn: Callable[[Sample], Any] | None = None  # from --custom-rm-path
    evaluation: bool = False
    slime_args: argparse.Namespace | None = None  # the flags under slime's names, for slime rollout functions


RolloutFunction = Callable[[RolloutContext, list[Task]], Awaitable[list[Sample]]]
SLIME_PARAMS = ["args", "rollout_id", "data_buffer"]


class SlimeDataBuffer:
    """What slime's ``generate_rollout`` expects as ``data_buffer``: leased tasks as groups of Samples."""

    def __init__(self, tasks: list[Task]) -> None:
        groups: dict[int, list[Sample]] = {}
        for task in tasks:
            sample = task.new_sample()
            sample.metadata.setdefault("tools", task.tools)
            groups.setdefault(task.group_index, []).append(sample)
        self._groups = list(groups.values())

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        taken, self._groups = self._groups[:num_samples], self._groups[num_samples:]
        return taken

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """slime returns unfinished groups this way; they go back to be handed out again."""
        self._groups.extend(samples)


def _as_sample(item: Any) -> Sample:
    """A slime Sample (or ours) as ours: the shared field names carry over."""
    if isinstance(item, Sample):
        return item
    names = {f.name for f in dataclasses.fields(Sample)}
    return Sample(**{name: getattr(item, name) for name in names if hasattr(item, name)})


def load_rollout_function(path: str) -> RolloutFunction:
    """Load ``--rollout-function-path``: our async contract as is, slime's signature adapted to it."""
    flag = "--rollout-function-path"
    try:
        fn = load_plugin(path, flag=flag, params=["ctx", "tasks"])
    except PluginError as ours:  # slime's takes three arguments; if it is not that either, say what ours wants
        try:
            slime_fn = load_plugin(path, flag=flag, params=SLIME_PARAMS)
        except PluginError:
            raise ours from None
        return _adapt_slime(slime_fn)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{flag}={path!r}: expected 'async def {fn.__name__}(ctx, tasks) -> list[Sample]' "
                          "(or slime's generate_rollout(args, rollout_id, data_buffer, evaluation=False))")
    return fn


def required_flags(fn: RolloutFunction) -> tuple[str, ...]:
    """The ``RolloutConfig`` fields a rollout function cannot run without (its ``requires`` attribute)."""
    return tuple(getattr(fn, "requires", ()))


def _adapt_slime(fn: Callable[..., Any]) -> RolloutFunction:
    async def run_slime(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
        buffer = SlimeDataBuffer(tasks)
        groups = await asyncio.to_thread(fn, ctx.slime_args, ctx.rollout_id, buffer, evaluation=ctx.evaluation)
        return [_as_sample(s) for group in groups for s in (group if isinstance(group, list) else [group])]

    return run_slime
