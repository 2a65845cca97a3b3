"""Loading user plug-ins by path: ``module:function`` (slime's dotted ``module.function`` too).

Each plug-in point has a flag ending in ``-path`` and an expected signature. ``load_plugin``
imports once at startup and checks the callable's parameters against the expected names, so a
wrong path or signature fails before any process starts, with the flag, the path and the
signature in the message. Where a point takes both our signature and slime's, ``load_forms``
recognises which one a function has. Before importing, ``compat.slime.install`` makes slime's
module paths (``slime.utils.types``, ...) resolve to inverted's, so a slime plug-in loads unchanged.

It also holds the contract of the biggest plug-in point, the rollout function (``--rollout-function-path``):

    async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]

one Sample per task (``task.new_sample()`` gives one with the task's group and index; match is by
``(group_index, index)``, order does not matter). A rollout function names the flags it cannot run
without in a ``requires`` attribute (``RolloutConfig`` field names, e.g. ``("env_path",)``); the job
checks them before anything starts. slime's ``generate_rollout(args, rollout_id,
data_buffer, evaluation=False) -> list[list[Sample]]`` is accepted too: it runs in a thread with a
``data_buffer`` whose ``get_samples(n)`` hands out the leased tasks as groups of slime Samples to fill.

The reward model (``--custom-rm-path``) is applied here too, after any rollout function, to every
usable Sample it left without a reward: ours ``(sample)``, slime's ``async (args, sample)``, or with
``--group-rm`` slime's ``async (args, samples) -> rewards`` once per group.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import inspect
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from inverted.compat import slime
from inverted.config import LossConfig, RolloutConfig
from inverted.errors import PluginError, PluginFailed
from inverted.types import Reward, Sample, Task


def _import(path: str, *, flag: str, expected: str) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{flag}={path!r}: expected 'module:function' with signature {expected}")
    slime.install()
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{flag}={path!r}: cannot load it ({exc}); expected {expected}") from None
    if not callable(fn):
        raise PluginError(f"{flag}={path!r}: not callable; expected {expected}")
    return fn


def _fits(fn: Callable[..., Any], params: list[str]) -> bool:
    """Whether ``fn`` accepts ``params`` positionally (extra defaults are fine)."""
    try:
        inspect.signature(fn).bind(*params)
    except TypeError:
        return False
    return True


def _signature(params: list[str], name: str = "fn") -> str:
    return f"def {name}({', '.join(params)})"


@dataclass(frozen=True, slots=True)
class Keywords:
    """Keyword arguments a plug-in is called with, given on the command line by ``flag``."""

    values: dict[str, Any]
    flag: str


def load_plugin(path: str, *, flag: str, params: list[str], keywords: Keywords | None = None,
                guard: bool = True) -> Callable[..., Any]:
    """Import ``path`` and check that it accepts ``params`` positionally (extra defaults are fine)."""
    return load_forms(path, flag=flag, forms={"": params}, keywords=keywords, guard=guard)[1]


def load_optional(path: str | None, *, flag: str, params: list[str], keywords: Keywords | None = None,
                  guard: bool = True) -> Callable[..., Any] | None:
    """``load_plugin`` for a flag that may be unset (None then)."""
    return load_plugin(path, flag=flag, params=params, keywords=keywords, guard=guard) if path else None


def guarded(fn: Callable[..., Any], flag: str, path: str) -> Callable[..., Any]:
    """``fn`` whose exceptions become ``PluginFailed``: the flag, the path and the plug-in's traceback,
    which then reach the job's console from whichever process ran it."""
    def failed(exc: Exception) -> PluginFailed:
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))  # less this frame
        return PluginFailed(f"{flag}={path!r} raised {type(exc).__name__}: {exc}\n{trace.rstrip()}")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except PluginFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever user code raises
                raise failed(exc) from exc
        return call_async

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PluginFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever user code raises
            raise failed(exc) from exc
    return call


def load_forms(path: str, *, flag: str, forms: dict[str, list[str]],
               keywords: Keywords | None = None, guard: bool = True) -> tuple[str, Callable[..., Any]]:
    """Import ``path`` and name the first of ``forms`` (name -> parameters) its signature accepts;
    with ``keywords``, the function returned has them bound. ``guard``: its exceptions become
    ``PluginFailed`` (``guarded``); an environment's are left as they are (they fail one episode)."""
    attr = path.replace(":", ".").rpartition(".")[2] or "fn"
    expected = " or ".join(_signature(params, attr) for params in forms.values())
    fn = _import(path, flag=flag, expected=expected)
    try:
        signature = inspect.signature(fn)
    except ValueError:  # builtins and some extension types publish no signature
        raise PluginError(f"{flag}={path!r}: its signature cannot be read; expected {expected}") from None
    if keywords is not None and keywords.values:
        try:
            signature.bind_partial(**keywords.values)
        except TypeError as exc:
            raise PluginError(f"{keywords.flag}: {flag}={path!r} {signature} refuses them: {exc}") from None
        fn = functools.partial(fn, **keywords.values)
    for name, params in forms.items():
        if _fits(fn, params):
            return name, guarded(fn, flag, path) if guard else fn
    if any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in inspect.signature(fn).parameters.values()):
        expected += f" (its keyword-only arguments come from {keywords.flag if keywords else 'the command line'})"
    raise PluginError(f"{flag}={path!r}: signature {signature} does not match {expected}")


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
    generate: Callable[..., Awaitable[Any]] | None = None  # slime's custom generate (--custom-generate-function-path)
    evaluation: bool = False
    slime_args: Any = None  # the flags under slime's names (compat.slime.SlimeArgs), for slime plug-ins
    lora_path: str | None = None  # the LoRA adapter a LoRA run's policy is: name it in every /generate (None: base)
    routed_experts: bool = False  # ask every /generate for return_routed_experts and keep them (rollout routing replay)
    chat_template: str | None = None  # --chat-template: the Jinja file rendered instead of the checkpoint's own
    router_api_key: str | None = None  # the router's /generate key ('Authorization: Bearer KEY')
    router_admin_api_key: str | None = None  # its worker list's (routed experts go to the workers directly)


RolloutFunction = Callable[[RolloutContext, list[Task]], Awaitable[list[Sample]]]
SLIME_PARAMS = ["args", "rollout_id", "data_buffer"]


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


def as_inverted(item: Any, args: Any = None) -> Sample:
    """A Sample a slime plug-in returned (slime's, or ours) as ours."""
    return item if isinstance(item, Sample) else slime.to_inverted(item, args=args)


def load_rollout_function(path: str, flag: str = "--rollout-function-path") -> RolloutFunction:
    """Load a rollout function: our async contract as is, slime's signature adapted to it."""
    form, fn = load_forms(path, flag=flag, forms={"ours": ["ctx", "tasks"], "slime": SLIME_PARAMS})
    if form == "slime":
        return _adapt_slime(fn)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{flag}={path!r}: expected 'async def {fn.__name__}(ctx, tasks) -> list[Sample]' "
                          "(or slime's generate_rollout(args, rollout_id, data_buffer, evaluation=False))")
    return fn


def required_flags(fn: RolloutFunction) -> tuple[str, ...]:
    """The ``RolloutConfig`` fields a rollout function cannot run without (its ``requires`` attribute)."""
    return tuple(getattr(fn, "requires", ()))


async def in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``asyncio.to_thread`` on a daemon thread of its own: a plug-in that never returns (slime's
    ``sleep_rollout``, or one stuck on a socket) cannot keep the job from stopping, as a thread of
    the loop's executor would (the loop and the interpreter wait for those at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(method: str, value: Any) -> None:
        if not future.done():
            getattr(future, method)(value)

    def work() -> None:
        try:
            result = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, "set_exception", exc)
        else:
            loop.call_soon_threadsafe(settle, "set_result", result)

    threading.Thread(target=work, name=f"plugin-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future


def _adapt_slime(fn: Callable[..., Any]) -> RolloutFunction:
    buffers = {False: SlimeDataBuffer(), True: SlimeDataBuffer()}  # training's, evaluation's

    async def run_slime(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
        buffer = buffers[ctx.evaluation]
        with buffer.serving(tasks, ctx.slime_args):
            output = await in_daemon_thread(fn, ctx.slime_args, ctx.rollout_id, buffer, evaluation=ctx.evaluation)
        # slime's RolloutFnTrainOutput / RolloutFnEvalOutput, or what they wrap: groups, or for evaluation
        # {dataset: {"rewards", "truncated", "samples"}}
        groups = output.samples if hasattr(output, "samples") else getattr(output, "data", output)
        if isinstance(groups, dict):
            groups = [result["samples"] for result in groups.values()]
        samples = [as_inverted(s, ctx.slime_args) for group in groups
                   for s in (group if isinstance(group, list) else [group])]
        return place_strays(samples, tasks)

    return run_slime


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


REWARD_FORMS = {"ours": ["sample"], "slime": ["args", "sample"]}


@dataclass(slots=True)
class RewardModel:
    """``--custom-rm-path``, in whichever form it was written; ``score`` fills the missing rewards."""

    fn: Callable[..., Any]
    form: str  # "ours" (sample), "slime" (args, sample), "group" (args, samples) -> rewards

    @classmethod
    def load(cls, path: str, group: bool) -> "RewardModel":
        if group:
            fn = load_plugin(path, flag="--custom-rm-path", params=["args", "samples"])
            return cls(fn, "group")
        form, fn = load_forms(path, flag="--custom-rm-path", forms=REWARD_FORMS)
        return cls(fn, form)

    async def score(self, samples: list[Sample], args: Any) -> None:
        """Reward every usable Sample that has none (a rollout or generate function may score its own)."""
        todo = [s for s in samples if s.reward is None and s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)]
        if self.form == "group":
            groups: dict[Any, list[Sample]] = {}
            for sample in todo:
                groups.setdefault(sample.group_index, []).append(sample)
            answers = await asyncio.gather(*(_call(self.fn, args, [slime.from_inverted(s, args=args) for s in group])
                                             for group in groups.values()))
            for group, rewards in zip(groups.values(), answers):
                if len(rewards) != len(group):
                    raise PluginError(f"--custom-rm-path (--group-rm): {len(rewards)} rewards for a group of {len(group)}")
                for sample, reward in zip(group, rewards):
                    sample.reward = reward
            return
        calls = [_call(self.fn, s) if self.form == "ours" else _call(self.fn, args, slime.from_inverted(s, args=args))
                 for s in todo]
        for sample, reward in zip(todo, await asyncio.gather(*calls)):
            sample.reward = reward


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


@dataclass(slots=True)
class LossPlugins:
    """The trainer's plug-ins, in slime's signatures (see ``inverted.train.slime_loss``), loaded on
    every rank and, to fail before anything starts, once by the job."""

    loss: Callable[..., Any] | None = None
    tis: Callable[..., Any] | None = None
    reducer: Callable[..., Any] | None = None
    reward_post_process: Callable[..., Any] | None = None

    @classmethod
    def load(cls, cfg: LossConfig) -> "LossPlugins":
        tis = None
        if path := cfg.custom_tis_function_path:  # slime passes everything but args by keyword
            expected = ("def fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> "
                        "(pg_loss, loss_masks, metrics)")
            tis = _import(path, flag="--custom-tis-function-path", expected=expected)
            try:
                inspect.signature(tis).bind("args", pg_loss=0, train_log_probs=0, rollout_log_probs=0, loss_masks=0,
                                            total_lengths=0, response_lengths=0)
            except (TypeError, ValueError) as exc:
                raise PluginError(f"--custom-tis-function-path={path!r}: expected {expected} ({exc})") from None
            tis = guarded(tis, "--custom-tis-function-path", path)
        return cls(
            loss=(load_optional(cfg.custom_loss_function_path, flag="--custom-loss-function-path",
                                params=["args", "batch", "logits", "sum_of_sample_mean"])
                  if cfg.loss_type == "custom_loss" else None),
            tis=tis,
            reducer=load_optional(cfg.custom_pg_loss_reducer_function_path, flag="--custom-pg-loss-reducer-function-path",
                                  params=["total_lengths", "response_lengths", "loss_masks"]),
            reward_post_process=load_optional(cfg.custom_reward_post_process_path,
                                              flag="--custom-reward-post-process-path", params=["args", "samples"]))
