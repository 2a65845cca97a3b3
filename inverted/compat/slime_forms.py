"""slime's plug-ins as inverted's hooks: each plug-in point's slime signature, and its adapter.

The core loader (``inverted.plugins``) knows each point's hook in inverted's terms and nothing of
slime. ``register()`` tells it, point by point, slime's signature and how a function written to it
becomes the hook, with slime's ``args`` (``compat.slime.SlimeArgs``) inside the adapter:

- on the rollout side the args are the rollout's (``args_of(ctx)``: the job's flags, the router's
  address and key), one object per rollout shared by its rollout function, generate function and
  reward model, as slime's one namespace is; the Samples cross as slime's ``Sample`` both ways
  (``compat.slime.from_inverted``, ``to_inverted``), a generate function's router answers recorded
  by ``post`` for the tokens' versions (``record_calls``), and every call it makes through ``post``
  names the run's LoRA adapter and carries the router's key (``generating_with``);
- elsewhere (the buffer's filters, the trainer's loss hooks, the sample filter and the log
  functions) the args are built once, at load, from the job's flags.

A slime rollout function (``generate_rollout(args, rollout_id, data_buffer, evaluation=False)``)
runs in a thread with a ``data_buffer`` (``SlimeDataBuffer``) whose ``get_samples(n)`` hands out the
leased tasks as groups of slime Samples to fill.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import threading
from collections.abc import Iterator
from typing import Any, Callable

from inverted.compat import slime
from inverted.errors import PluginError
from inverted.plugins import DatasetResults, EvalResults, Form, RolloutContext, call, in_daemon_thread, register_form
from inverted.types import Sample, Task

SLIME_ROLLOUT_PARAMS = ["args", "rollout_id", "data_buffer"]


@functools.lru_cache(maxsize=8)
def _args(flags: str, router_url: str, router_api_key: str | None, rollout: tuple[int, bool]) -> slime.SlimeArgs:
    return slime.SlimeArgs.of(json.loads(flags), router_url=router_url, router_api_key=router_api_key)


def args_of(ctx: RolloutContext) -> slime.SlimeArgs:
    """slime's ``args`` for one rollout: the same object for every plug-in the rollout runs."""
    return _args(
        json.dumps(ctx.flags, sort_keys=True, default=str),
        ctx.router_url,
        ctx.router_api_key,
        (ctx.rollout_id, ctx.evaluation),
    )


def serving(ctx: RolloutContext) -> slime.Serving:
    """The versions of Samples whose generate function recorded none: exact unless rollouts overlap training."""
    return slime.Serving(ctx.weight_version, inferred=ctx.async_mode)


def as_inverted(item: Any, at: slime.Serving, calls: list[slime.GenerateCall] | None = None) -> Sample:
    """A Sample a slime plug-in returned (slime's, or ours) as ours."""
    return item if isinstance(item, Sample) else slime.to_inverted(item, calls, serving=at)


@contextlib.contextmanager
def generating(ctx: RolloutContext) -> Iterator[None]:
    """What ``post`` adds to this rollout's calls: the LoRA adapter, and the router's key."""
    with slime.generating_with(ctx.lora_path, ctx.router_url, ctx.router_api_key):
        yield


# -- the rollout function ---------------------------------------------------------------------------

# The rollout a slime rollout function is running for (its context: the thread it runs on, and the
# coroutines it runs through slime's ``run``); unset on threads the plug-in starts itself.
_rollout: contextvars.ContextVar[object | None] = contextvars.ContextVar("slime_rollout", default=None)


class SlimeDataBuffer:
    """What slime's rollout functions get as ``data_buffer`` (its data source): the leased tasks as
    groups of slime Samples. One per rollout function for the whole run, as slime's data source is:
    each rollout's groups join it, so a plug-in that keeps it across rollouts (slime's fully-async
    worker, on a thread of its own) keeps being fed. A rollout function's own calls get its
    rollout's groups only (rollouts may run side by side: ``--async-mode``); calls from a thread the
    plug-in started take whichever come first."""

    def __init__(self) -> None:
        self._groups: list[tuple[object | None, list[Any]]] = []  # (the rollout it belongs to, the group)
        self._lock = threading.Lock()

    def add_tasks(self, tasks: list[Task], args: Any = None) -> None:
        groups: dict[int, list[Any]] = {}
        for task in tasks:
            sample = slime.from_inverted(task.new_sample(), args=args)
            sample.metadata.setdefault("tools", task.tools)
            groups.setdefault(task.group_index, []).append(sample)
        self.add_samples(list(groups.values()))

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        rollout = _rollout.get()
        with self._lock:
            mine = [i for i, (owner, _) in enumerate(self._groups) if rollout is None or owner is rollout][:num_samples]
            taken = [self._groups[i][1] for i in mine]
            for i in reversed(mine):
                del self._groups[i]
        return taken

    def add_samples(self, samples: list[list[Any]]) -> None:
        """slime returns unfinished groups this way; they go back to be handed out again."""
        rollout = _rollout.get()
        with self._lock:
            self._groups.extend((rollout, group) for group in samples)

    @contextlib.contextmanager
    def serving(self, tasks: list[Task], args: Any) -> Iterator[None]:
        """Within it, this rollout's groups are in the buffer, and its rollout function's calls get them."""
        token = _rollout.set(object())
        try:
            self.add_tasks(tasks, args)
            yield
        finally:
            rollout = _rollout.get()
            _rollout.reset(token)
            with self._lock:  # what this rollout left untaken goes with it
                self._groups = [entry for entry in self._groups if entry[0] is not rollout]


def adapt_rollout_function(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    buffers = {False: SlimeDataBuffer(), True: SlimeDataBuffer()}  # training's, evaluation's

    async def run_slime(ctx: RolloutContext, tasks: list[Task]) -> list[Sample] | EvalResults:
        buffer, args = buffers[ctx.evaluation], args_of(ctx)
        with generating(ctx), buffer.serving(tasks, args):
            output = await in_daemon_thread(fn, args, ctx.rollout_id, buffer, evaluation=ctx.evaluation)
        # slime's RolloutFnTrainOutput / RolloutFnEvalOutput, or what they wrap: groups, or for evaluation
        # {dataset: {"rewards", "truncated", "samples"}}
        groups = output.samples if hasattr(output, "samples") else getattr(output, "data", output)
        if isinstance(groups, dict):
            return eval_results(ctx, groups, getattr(output, "metrics", None))
        samples = [
            as_inverted(s, serving(ctx)) for group in groups for s in (group if isinstance(group, list) else [group])
        ]
        return place_strays(samples, tasks)

    return run_slime


def eval_results(ctx: RolloutContext, data: dict[str, dict[str, Any]], metrics: dict[str, Any] | None) -> EvalResults:
    """slime's evaluation answer as ours: per dataset its rewards, truncation and Samples (any number:
    slime's eval functions read their own data), and the numeric metrics it returned beside them."""
    at = serving(ctx)
    datasets = {
        name: DatasetResults(
            rewards=[float(r) for r in result["rewards"]],
            samples=[as_inverted(s, at) for s in result.get("samples") or []],
            truncated=None if result.get("truncated") is None else [bool(t) for t in result["truncated"]],
        )
        for name, result in data.items()
    }
    numbers = {
        key: float(value)
        for key, value in (metrics or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    return EvalResults(datasets, numbers)


def place_strays(samples: list[Sample], tasks: list[Task]) -> list[Sample]:
    """slime trains on whatever its rollout function returns; here each Sample answers a leased task.
    Samples that answer no task of this rollout (a rollout replayed from a dump: slime's
    ``forge_load``) take the places of the unanswered tasks, group for group in order, where the
    groups' sizes agree (their own keys stay in ``metadata["replayed_from"]``); otherwise they are
    left for the caller to report."""
    keys = {(t.group_index, t.index) for t in tasks}
    strays = [s for s in samples if (s.group_index, s.index) not in keys]
    if not strays:
        return samples
    answered = {(s.group_index, s.index) for s in samples} & keys
    open_groups: dict[int, list[Task]] = {}
    for task in tasks:
        if (task.group_index, task.index) not in answered:
            open_groups.setdefault(task.group_index, []).append(task)
    stray_groups: dict[Any, list[Sample]] = {}
    for sample in strays:
        stray_groups.setdefault(sample.group_index, []).append(sample)
    if [len(g) for g in open_groups.values()] != [len(g) for g in stray_groups.values()]:
        return samples
    for group, stray_group in zip(open_groups.values(), stray_groups.values()):
        for task, sample in zip(group, stray_group):
            sample.metadata["replayed_from"] = {"group_index": sample.group_index, "index": sample.index}
            sample.group_index, sample.index = task.group_index, task.index
    return samples


# -- the rest of the rollout side -------------------------------------------------------------------


def adapt_generate(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``async generate(args, sample, sampling_params) -> Sample | list[Sample]`` as the generate hook."""
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(
            f"--custom-generate-function-path: expected 'async def {fn.__name__}(args, sample, "
            "sampling_params) -> Sample | list[Sample]'"
        )

    async def generate(ctx: RolloutContext, sample: Sample, sampling: dict[str, Any]) -> list[Sample]:
        args = args_of(ctx)
        view = slime.from_inverted(sample, args=args)
        calls = slime.record_calls()  # this task's router answers (each gather task has its own context)
        with generating(ctx):
            out = await fn(args, view, sampling)
        views = out if isinstance(out, list) else [out]
        if len(views) > 1 and (views[0].rollout_id is None or len({v.rollout_id for v in views}) > 1):
            raise PluginError(
                "--custom-generate-function-path: the Samples one task fans out into must share a "
                f"rollout_id (got {[v.rollout_id for v in views]})"
            )
        return [as_inverted(v, serving(ctx), calls) for v in views]

    return generate


def adapt_reward(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``async (args, sample) -> reward`` as the reward hook ``(ctx, sample)``."""

    async def reward(ctx: RolloutContext, sample: Sample) -> Any:
        args = args_of(ctx)
        with generating(ctx):
            return await call(fn, args, slime.from_inverted(sample, args=args))

    return reward


def adapt_group_reward(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``async (args, samples) -> rewards`` (``--group-rm``) as the group reward hook ``(ctx, samples)``."""

    async def rewards(ctx: RolloutContext, samples: list[Sample]) -> list[Any]:
        args = args_of(ctx)
        with generating(ctx):
            return await call(fn, args, [slime.from_inverted(s, args=args) for s in samples])

    return rewards


def adapt_sample_filter(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(args, groups) -> None`` marking slime Samples ``remove_sample`` as the sample filter hook."""
    args = slime.SlimeArgs.of(flags)

    def sample_filter(groups: list[list[Sample]]) -> None:
        views = [[slime.from_inverted(s, args=args) for s in group] for group in groups]
        fn(args, views)
        for group, group_views in zip(groups, views):
            for sample, view in zip(group, group_views):
                sample.remove_sample = bool(view.remove_sample)

    return sample_filter


def adapt_rollout_log(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(rollout_id, args, samples, extra_metrics, time) -> bool`` as the rollout log hook."""
    args = slime.SlimeArgs.of(flags)
    return lambda rollout_id, samples, metrics, seconds: fn(
        rollout_id, args, [slime.from_inverted(s, args=args) for s in samples], metrics, seconds
    )


def adapt_eval_log(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(rollout_id, args, data, extra_metrics) -> bool`` as the evaluation log hook (slime Samples in ``data``)."""
    args = slime.SlimeArgs.of(flags)

    def eval_log(rollout_id: int, data: dict[str, dict[str, Any]], metrics: dict[str, float]) -> bool:
        views = {
            name: {**result, "samples": [slime.from_inverted(s, args=args) for s in result["samples"]]}
            for name, result in data.items()
        }
        return fn(rollout_id, args, views, metrics)

    return eval_log


# -- the buffer's -----------------------------------------------------------------------------------


def adapt_group_filter(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(args, samples, **kw) -> DynamicFilterOutput`` as the group filter hook (its ``keep``)."""
    args = slime.SlimeArgs.of(flags)
    return lambda samples: bool(fn(args, [slime.from_inverted(s, args=args) for s in samples]).keep)


def adapt_group_chooser(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(args, rollout_id, buffer, num_samples) -> groups`` as the group chooser hook (positions)."""
    args = slime.SlimeArgs.of(flags)

    def choose(groups: list[list[Sample]], wanted: int, version: int | None) -> list[int]:
        views = [[slime.from_inverted(s, args=args) for s in group] for group in groups]
        position = {id(group): i for i, group in enumerate(views)}
        chosen = fn(args, version or 0, list(views), wanted)
        if any(id(group) not in position for group in chosen):
            raise PluginError(
                "--buffer-filter-path: return groups of the buffer it was given (the lists themselves), not copies"
            )
        return [position[id(group)] for group in chosen]

    return choose


# -- the trainer's ----------------------------------------------------------------------------------


def adapt_reward_post_process(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
    """``(args, samples) -> (raw_rewards, rewards)`` as the post-process hook; the teacher log-probs it
    sets on slime's Samples (on-policy distillation's) are set on ours."""
    args = slime.SlimeArgs.of(flags)

    def post_process(samples: list[Sample]) -> list[float]:
        views = [slime.from_inverted(s, args=args) for s in samples]
        _, rewards = fn(args, views)
        for sample, view in zip(samples, views):
            teacher = getattr(view, "teacher_log_probs", None)
            if teacher is not None:
                values = teacher.flatten().tolist() if hasattr(teacher, "flatten") else list(teacher)
                sample.teacher_log_probs = [float(v) for v in values]
        return [float(r) for r in rewards]

    return post_process


def _tis_fits(fn: Callable[..., Any]) -> bool:
    """slime passes everything but ``args`` by keyword."""
    try:
        inspect.signature(fn).bind(
            "args", pg_loss=0, train_log_probs=0, rollout_log_probs=0, loss_masks=0, total_lengths=0, response_lengths=0
        )
    except (TypeError, ValueError):
        return False
    return True


def _loss_hook(name: str, with_args: bool = True) -> Callable[[Callable[..., Any], dict[str, Any]], Callable[..., Any]]:
    """The adapter binding a loss plug-in (and slime's args) to ``compat.slime_loss``'s ``name``,
    imported when a plug-in is loaded (torch: not for every process that registers the forms)."""

    def adapt(fn: Callable[..., Any], flags: dict[str, Any]) -> Callable[..., Any]:
        from inverted.compat import slime_loss

        bound = (fn, slime.SlimeArgs.of(flags)) if with_args else (fn,)
        return functools.partial(getattr(slime_loss, name), *bound)

    return adapt


def register() -> None:
    """Register slime's form of every plug-in point with the loader."""
    forms = {
        "rollout_function": Form(SLIME_ROLLOUT_PARAMS, adapt_rollout_function),
        "generate": Form(["args", "sample", "sampling_params"], adapt_generate),
        "reward": Form(["args", "sample"], adapt_reward),
        "group_reward": Form(["args", "samples"], adapt_group_reward),
        "sample_filter": Form(["args", "groups"], adapt_sample_filter),
        "rollout_log": Form(
            ["rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"], adapt_rollout_log
        ),
        "eval_log": Form(["rollout_id", "args", "data", "extra_metrics"], adapt_eval_log),
        "group_filter": Form(["args", "samples"], adapt_group_filter),
        "group_chooser": Form(["args", "rollout_id", "buffer", "num_samples"], adapt_group_chooser),
        "reward_post_process": Form(["args", "samples"], adapt_reward_post_process),
        "loss": Form(["args", "batch", "logits", "sum_of_sample_mean"], _loss_hook("custom_loss")),
        "tis": Form(
            ["args", "*", "pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "**kwargs"],
            _loss_hook("custom_tis"),
            fits=_tis_fits,
        ),
        "pg_reducer": Form(
            ["total_lengths", "response_lengths", "loss_masks"], _loss_hook("reduce_pg", with_args=False)
        ),
    }
    for point, form in forms.items():
        register_form(point, "slime", form)
