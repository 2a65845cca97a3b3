"""Loading user plug-ins by path: ``module:function`` (``module.function`` too).

Each plug-in point has a flag ending in ``-path``, a hook type in inverted's own terms, and the
signature a function must have to be that hook. ``load_plugin`` imports once at startup and checks
the callable's parameters against the expected names, so a wrong path or signature fails before
any process starts, with the flag, the path and the signature in the message.

A point may also take functions written for another framework (slime's plug-ins). The core does
not know those frameworks: an adapter package registers, per point, a ``Form`` (the foreign
signature, and how a function written to it becomes the point's hook), and ``load_forms`` tries the
point's own signature first, then the registered forms. The entry point fills the registry before
anything loads: the command line (``inverted.cli``, which every service runs under), and the set-up
it hands to the processes those start afresh (the trainer's Ray workers, the buffer's workers).

The points and their hooks (each point's name is what an adapter registers a form for):

- ``rollout_function`` (``--rollout-function-path``): ``async def generate_rollout(ctx, tasks) ->
  list[Sample]``, one Sample per task (``task.new_sample()`` gives one with the task's group and
  index; match is by ``(group_index, index)``). It names the flags it cannot run without in a
  ``requires`` attribute (``RolloutConfig`` field names); the job checks them before anything starts.
  An evaluation (``ctx.evaluation``, ``--eval-function-path``) may answer ``EvalResults`` instead:
  per dataset, any number of Samples, logged per dataset.
- ``reward`` (``--custom-rm-path``): ``(sample) -> reward``, sync or async; with ``--group-rm``
  ``group_reward``: ``(samples) -> rewards``, once per group. Applied after any rollout function,
  to every usable Sample it left without a reward.
- ``generate`` (``--custom-generate-function-path``, run inside the default rollout): no form of
  ours; the hook is ``async (ctx, sample, sampling_params) -> list[Sample]``.
- ``sample_filter``: ``(groups) -> None``, setting ``Sample.remove_sample``; ``rollout_log``:
  ``(rollout_id, samples, metrics, seconds) -> bool``; ``eval_log``: ``(rollout_id, data, metrics) ->
  bool`` (True: it logged them, leave the defaults out).
- ``group_filter``, ``group_chooser``: the buffer's (``inverted.buffer.filters``).
- ``reward_post_process``, ``loss``, ``tis``, ``pg_reducer``: the trainer's (``LossPlugins``).

``Plugins`` is what the job's controller runs, every rollout-side point loaded and checked at once;
``LossPlugins`` the trainer's.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from inverted.config import flag_name
from inverted.errors import ConfigError, PluginError, PluginFailed
from inverted.rollout.config import RolloutConfig
from inverted.train.config import LossConfig
from inverted.types import Reward, Sample, Task

# -- the registry of foreign forms ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Form:
    """A signature a plug-in point takes besides its own, and how a function written to it becomes
    the point's hook: ``adapt(fn, flags)``, ``flags`` being every flag of the job by name (what a
    foreign framework's ``args`` is built from)."""

    params: list[str]
    adapt: Callable[[Callable[..., Any], dict[str, Any]], Callable[..., Any]]
    fits: Callable[[Callable[..., Any]], bool] | None = None  # a check of its own, where positions do not say


FORMS: dict[str, dict[str, Form]] = {}  # point -> form name -> Form, filled by adapter packages


def register_form(point: str, name: str, form: Form) -> None:
    """Let ``point`` take functions written to ``form`` (an adapter package calls it at start-up)."""
    FORMS.setdefault(point, {})[name] = form


@dataclass(frozen=True, slots=True)
class DumpFormat:
    """Another framework's rollout dump, by file suffix: ``--save-debug-rollout-data`` writes it,
    ``--load-debug-rollout-data`` reads it (``read(path) -> Samples``, ``write(path, rollout_id, samples, flags)``)."""

    read: Callable[..., list[Sample]]
    write: Callable[..., None]


DUMP_FORMATS: dict[str, DumpFormat] = {}  # ".pt" -> slime's, registered by its adapter


def _import(path: str, *, flag: str, expected: str) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{flag}={path!r}: expected 'module:function' with signature {expected}")
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


def load_plugin(
    path: str, *, flag: str, params: list[str], keywords: Keywords | None = None, guard: bool = True
) -> Callable[..., Any]:
    """Import ``path`` and check that it accepts ``params`` positionally (extra defaults are fine)."""
    return load_forms(path, flag=flag, forms={"": params}, keywords=keywords, guard=guard)[1]


def load_optional(
    path: str | None, *, flag: str, params: list[str], keywords: Keywords | None = None, guard: bool = True
) -> Callable[..., Any] | None:
    """``load_plugin`` for a flag that may be unset (None then)."""
    return load_plugin(path, flag=flag, params=params, keywords=keywords, guard=guard) if path else None


def guarded(fn: Callable[..., Any], flag: str, path: str) -> Callable[..., Any]:
    """``fn`` whose exceptions become ``PluginFailed``: the flag, the path and the plug-in's traceback,
    which then reach the job's console from whichever process ran it."""

    def failed(exc: Exception) -> PluginFailed:
        trace = "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__ and exc.__traceback__.tb_next)
        )  # less this frame
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


def load_forms(
    path: str,
    *,
    flag: str,
    forms: dict[str, list[str]],
    point: str | None = None,
    flags: dict[str, Any] | None = None,
    keywords: Keywords | None = None,
    guard: bool = True,
) -> tuple[str, Callable[..., Any]]:
    """Import ``path`` and name the first of ``forms`` (name -> parameters) its signature accepts, then
    of the forms registered for ``point``; a registered form's function comes back adapted to the
    point's hook (``Form.adapt`` with the job's ``flags``). With ``keywords``, the function returned
    has them bound. ``guard``: its exceptions become ``PluginFailed`` (``guarded``); an
    environment's are left as they are (they fail one episode)."""
    attr = path.replace(":", ".").rpartition(".")[2] or "fn"
    foreign = FORMS.get(point, {}) if point else {}
    expected = " or ".join(
        [
            *(_signature(params, attr) for params in forms.values()),
            *(f"{name}'s {_signature(form.params, attr)}" for name, form in foreign.items()),
        ]
    )
    fn = _import(path, flag=flag, expected=expected or "a function")
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
    for name, form in foreign.items():
        if (form.fits or functools.partial(_fits, params=form.params))(fn):
            return name, form.adapt(guarded(fn, flag, path) if guard else fn, dict(flags or {}))
    if not expected:
        raise PluginError(
            f"{flag}={path!r}: no plug-in form is registered for it (the command line registers "
            "the adapters, e.g. slime's: run it through `inverted`, or call inverted.compat.register())"
        )
    if any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in inspect.signature(fn).parameters.values()):
        expected += f" (its keyword-only arguments come from {keywords.flag if keywords else 'the command line'})"
    raise PluginError(f"{flag}={path!r}: signature {signature} does not match {expected}")


def load_hook(
    path: str | None,
    *,
    point: str,
    flag: str,
    forms: dict[str, list[str]] | None = None,
    flags: dict[str, Any] | None = None,
) -> Callable[..., Any] | None:
    """The hook of an optional plug-in point (None where its flag is unset): a function in the point's
    own form (``forms``) as it is, one in a registered form adapted."""
    return load_forms(path, flag=flag, forms=forms or {}, point=point, flags=flags)[1] if path else None


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
    generate: Callable[..., Awaitable[list[Sample]]] | None = None  # GenerateHook (--custom-generate-function-path)
    evaluation: bool = False
    flags: dict[str, Any] = field(
        default_factory=dict
    )  # every flag of the job by name (adapters build foreign args from it)
    weight_version: str = "default"  # the version the servers held when this rollout started
    async_mode: bool = False  # rollouts overlap training, so a version may change under a rollout
    lora_path: str | None = None  # the LoRA adapter a LoRA run's policy is: name it in every /generate (None: base)
    routed_experts: bool = False  # ask every /generate for return_routed_experts and keep them (rollout routing replay)
    chat_template: str | None = None  # --chat-template: the Jinja file rendered instead of the checkpoint's own
    router_api_key: str | None = None  # the router's /generate key ('Authorization: Bearer KEY')
    router_admin_api_key: str | None = None  # its worker list's (routed experts go to the workers directly)


@dataclass(slots=True)
class DatasetResults:
    """One dataset's evaluation as the function reports it (slime's ``{"rewards", "truncated", "samples"}``)."""

    rewards: list[float]
    samples: list[Sample] = field(default_factory=list)
    truncated: list[bool] | None = None


@dataclass(slots=True)
class EvalResults:
    """What an evaluation function may answer instead of one Sample per task: its results per dataset,
    with any number of Samples (it may read data of its own), and numeric metrics of its own to log
    as they are named (slime's ``RolloutFnEvalOutput``)."""

    datasets: dict[str, DatasetResults]
    metrics: dict[str, float] = field(default_factory=dict)


RolloutFunction = Callable[[RolloutContext, list[Task]], Awaitable[list[Sample] | EvalResults]]


def load_rollout_function(
    path: str, flag: str = "--rollout-function-path", flags: dict[str, Any] | None = None
) -> RolloutFunction:
    """Load a rollout function: our async contract as is, a registered form (slime's) adapted to it."""
    form, fn = load_forms(path, flag=flag, forms={"ours": ["ctx", "tasks"]}, point="rollout_function", flags=flags)
    if form == "ours" and not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{flag}={path!r}: expected 'async def {fn.__name__}(ctx, tasks) -> list[Sample]'")
    return fn


def required_flags(fn: RolloutFunction) -> tuple[str, ...]:
    """The ``RolloutConfig`` fields a rollout function cannot run without (its ``requires`` attribute)."""
    return tuple(getattr(fn, "requires", ()))


async def in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``asyncio.to_thread`` on a daemon thread of its own: a plug-in that never returns (one stuck on
    a socket) cannot keep the job from stopping, as a thread of the loop's executor would (the loop
    and the interpreter wait for those at exit)."""
    import contextvars

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


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a plug-in that may be sync or async."""
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


# The hooks of the points beyond the rollout function, in inverted's terms. The trainer's take its
# micro-batch (``train.packing.MicroBatch``) and tensors, which this shared module does not import.
RewardHook = Callable[[RolloutContext, Sample], Awaitable[Reward]]
GroupRewardHook = Callable[[RolloutContext, list[Sample]], Awaitable[list[Reward]]]
GenerateHook = Callable[[RolloutContext, Sample, dict[str, Any]], Awaitable[list[Sample]]]
RewardPostProcess = Callable[[list[Sample]], list[float]]
LossHook = Callable[..., tuple[Any, dict[str, Any]]]  # (mb, logits, per_token, weight) -> (loss, metrics)
TISHook = Callable[..., tuple[Any, Any, Any]]  # (mb, pg, old, rollout, mask, weight, aggregation) -> (pg, weight, tis)
ReducerHook = Callable[..., Any]  # (mb, pg, mask, divisor, per_token) -> the policy-gradient term


@dataclass(slots=True)
class RewardModel:
    """``--custom-rm-path`` as a hook: ``one(ctx, sample) -> reward``, or with ``--group-rm``
    ``group(ctx, samples) -> rewards``; ``score`` fills the rewards a rollout left missing."""

    one: RewardHook | None = None
    group: GroupRewardHook | None = None

    @classmethod
    def load(cls, path: str, group: bool, flags: dict[str, Any] | None = None) -> "RewardModel":
        if group:
            form, fn = load_forms(
                path, flag="--custom-rm-path", forms={"ours": ["samples"]}, point="group_reward", flags=flags
            )
            return cls(group=(lambda ctx, samples: call(fn, samples)) if form == "ours" else fn)
        form, fn = load_forms(path, flag="--custom-rm-path", forms={"ours": ["sample"]}, point="reward", flags=flags)
        return cls(one=(lambda ctx, sample: call(fn, sample)) if form == "ours" else fn)

    async def score(self, ctx: RolloutContext, samples: list[Sample]) -> None:
        """Reward every usable Sample that has none (a rollout or generate function may score its own)."""
        todo = [
            s for s in samples if s.reward is None and s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        ]
        if self.group is not None:
            groups: dict[Any, list[Sample]] = {}
            for sample in todo:
                groups.setdefault(sample.group_index, []).append(sample)
            answers = await asyncio.gather(*(self.group(ctx, group) for group in groups.values()))
            for group, rewards in zip(groups.values(), answers):
                if len(rewards) != len(group):
                    raise PluginError(
                        f"--custom-rm-path (--group-rm): {len(rewards)} rewards for a group of {len(group)}"
                    )
                for sample, reward in zip(group, rewards):
                    sample.reward = reward
            return
        one = self.one
        if one is None:  # load sets exactly one of the two hooks
            raise PluginError("--custom-rm-path: no reward hook loaded")
        for sample, reward in zip(todo, await asyncio.gather(*(one(ctx, s) for s in todo))):
            sample.reward = reward


SINGLE_TURN = "rollout_functions.single_turn:generate_rollout"  # slime's default rollout, ours too


@dataclass(slots=True)
class Plugins:
    """The user code the job's controller runs, loaded (and checked) before any process starts, each
    as its hook (slime's forms come adapted)."""

    rollout: RolloutFunction
    env: Callable[..., Any] | None = None
    reward: RewardModel | None = None
    generate: Callable[..., Any] | None = None  # (ctx, sample, sampling_params) -> Samples, run inside single_turn
    evaluate: RolloutFunction | None = None  # --eval-function-path (else the rollout function)
    sample_filter: Callable[..., Any] | None = None  # (groups) -> None, setting Sample.remove_sample
    rollout_log: Callable[..., Any] | None = None  # (rollout_id, samples, metrics, seconds) -> bool
    eval_log: Callable[..., Any] | None = None  # (rollout_id, data, metrics) -> bool
    # the environment of each evaluation, by name: "" the main one (--eval-env-args), then --eval-variants
    eval_envs: dict[str, Callable[..., Any] | None] = field(default_factory=dict)

    @classmethod
    def load(cls, cfg: RolloutConfig, flags: dict[str, Any] | None = None) -> "Plugins":
        """``flags``: every flag of the job by name, for the adapters of other frameworks' plug-ins."""
        env = load_env(cfg.env_path, cfg.env_args, "--env-args")
        eval_envs = {
            "": env if cfg.eval_env_args is None else load_env(cfg.env_path, cfg.eval_env_args, "--eval-env-args")
        }
        for name, args in json.loads(cfg.eval_variants or "{}").items():
            eval_envs[name] = load_env(cfg.env_path, json.dumps(args), f"--eval-variants {name}")
        generate = load_hook(
            cfg.custom_generate_function_path, point="generate", flag="--custom-generate-function-path", flags=flags
        )
        path = cfg.rollout_function_path
        if generate is not None:  # as in slime, a custom generate runs inside the default rollout
            default = RolloutConfig.__dataclass_fields__["rollout_function_path"].default
            if path not in (default, SINGLE_TURN):
                raise ConfigError(
                    f"--custom-generate-function-path runs inside {SINGLE_TURN} (slime's default "
                    f"rollout), not inside --rollout-function-path {path}"
                )
            path = SINGLE_TURN
        rollout = load_rollout_function(path, flags=flags)
        for name in required_flags(rollout):
            if not getattr(cfg, name) and not (name == "custom_rm_path" and generate is not None):
                raise ConfigError(f"--rollout-function-path {path} needs {flag_name(name)}")
        return cls(
            rollout,
            env,
            generate=generate,
            reward=RewardModel.load(cfg.custom_rm_path, cfg.group_rm, flags) if cfg.custom_rm_path else None,
            evaluate=(
                load_rollout_function(cfg.eval_function_path, "--eval-function-path", flags)
                if cfg.eval_function_path
                else None
            ),
            sample_filter=load_hook(
                cfg.rollout_sample_filter_path,
                point="sample_filter",
                flag="--rollout-sample-filter-path",
                forms={"ours": ["groups"]},
                flags=flags,
            ),
            rollout_log=load_hook(
                cfg.custom_rollout_log_function_path,
                point="rollout_log",
                flag="--custom-rollout-log-function-path",
                forms={"ours": ["rollout_id", "samples", "metrics", "seconds"]},
                flags=flags,
            ),
            eval_log=load_hook(
                cfg.custom_eval_rollout_log_function_path,
                point="eval_log",
                flag="--custom-eval-rollout-log-function-path",
                forms={"ours": ["rollout_id", "data", "metrics"]},
                flags=flags,
            ),
            eval_envs=eval_envs,
        )


def load_env(path: str | None, args: str | None, flag: str) -> Callable[..., Any] | None:
    """``--env-path`` called with ``args`` (a JSON object of keyword arguments, ``flag`` naming where
    they came from)."""
    env = load_optional(
        path,
        flag="--env-path",
        params=["task", "client"],
        keywords=Keywords(json.loads(args or "{}"), flag),
        guard=False,
    )  # an environment's exception fails its episode only
    if env is not None and not inspect.iscoroutinefunction(env):
        raise PluginError(
            f"--env-path={path!r}: expected 'async def {getattr(env, '__name__', 'episode')}(task, client) -> reward'"
        )
    return env


@dataclass(slots=True)
class LossPlugins:
    """The trainer's hooks, loaded on every rank and, to fail before anything starts, once by the job.
    None has a form of ours yet; each comes from a registered form (slime's: ``compat.slime_loss``):

    - ``loss(mb, logits, per_token, weight) -> (loss, metrics)``: the loss of one micro-batch
      (``--loss-type custom_loss``), ``per_token`` its flat tensors by name, ``weight`` each token's
      weight in the step;
    - ``tis(mb, pg, old, rollout, mask, weight, aggregation) -> (pg, weight, tis)``: importance weights;
    - ``reducer(mb, pg, mask, divisor, per_token) -> pg_term``: the policy-gradient term's reduction;
    - ``reward_post_process(samples) -> rewards``: the numbers trained on, from the Samples' rewards
      (it may set ``Sample.teacher_log_probs``).
    """

    loss: LossHook | None = None
    tis: TISHook | None = None
    reducer: ReducerHook | None = None
    reward_post_process: RewardPostProcess | None = None

    @classmethod
    def load(cls, cfg: LossConfig, flags: dict[str, Any] | None = None) -> "LossPlugins":
        return cls(
            loss=(
                load_hook(cfg.custom_loss_function_path, point="loss", flag="--custom-loss-function-path", flags=flags)
                if cfg.loss_type == "custom_loss"
                else None
            ),
            tis=load_hook(cfg.custom_tis_function_path, point="tis", flag="--custom-tis-function-path", flags=flags),
            reducer=load_hook(
                cfg.custom_pg_loss_reducer_function_path,
                point="pg_reducer",
                flag="--custom-pg-loss-reducer-function-path",
                flags=flags,
            ),
            reward_post_process=load_hook(
                cfg.custom_reward_post_process_path,
                point="reward_post_process",
                flag="--custom-reward-post-process-path",
                forms={"ours": ["samples"]},
                flags=flags,
            ),
        )
