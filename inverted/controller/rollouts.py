"""What both loops do with the rollout function: call it, check it, measure it, evaluate with it.

``context`` builds the ``RolloutContext`` a rollout function receives; ``run_rollout`` calls the
function on leased tasks and checks its answer (user code: one Sample per task), ``run_evaluation``
the evaluation's (which may also answer per dataset, as slime's do: ``EvalResults``); the metrics and
the saved rollout data are the same whichever loop produced the Samples, and so are the end of a
step: ``sync_when_due`` (every ``--update-weights-interval`` steps) and ``step_row``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from inverted.buffer.datasets import load_prompts
from inverted.config import BufferConfig, JobConfig, plugin_flags
from inverted.controller.job import Job, Plugins
from inverted.errors import PluginError
from inverted.plugins import DUMP_FORMATS, EvalResults, RolloutContext
from inverted.types import Sample, Task, reward_number

USABLE = (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)


def read_prompts(buffer: BufferConfig, path: str):
    return load_prompts(path, input_key=buffer.input_key, label_key=buffer.label_key,
                        metadata_key=buffer.metadata_key, tool_key=buffer.tool_key)


def context(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int, evaluation: bool = False,
            variant: str = "") -> RolloutContext:
    """What a rollout function gets: its section, the services' addresses, sampling, the version serving,
    and every flag of the job by name (from which adapters build other frameworks' ``args``). An
    evaluation's environment is its ``variant``'s (``Plugins.eval_envs``)."""
    rollout = cfg.rollout
    temperature = rollout.eval_temperature if evaluation else rollout.rollout_temperature
    longest = rollout.rollout_max_response_len
    if evaluation and rollout.eval_max_response_len is not None:
        longest = rollout.eval_max_response_len
    sampling = {"temperature": temperature, "top_p": rollout.rollout_top_p if temperature else 1.0,
                "max_tokens": longest}
    if temperature and rollout.rollout_top_k > 0:
        sampling["top_k"] = rollout.rollout_top_k
    return RolloutContext(rollout_id=rollout_id, config=cfg.rollout, proxy_url=job.proxy_url, proxy_api_key=job.proxy_key,
                          router_url=job.servers.router_url, hf_checkpoint=cfg.train.hf_checkpoint,
                          chat_template=cfg.proxy.chat_template, sampling=sampling,
                          env=plugins.eval_envs.get(variant, plugins.env) if evaluation else plugins.env,
                          generate=plugins.generate, evaluation=evaluation,
                          flags=job_flags(cfg), weight_version=job.weight_version, async_mode=cfg.loop.async_mode,
                          lora_path=job.adapter,
                          routed_experts=cfg.train.moe.use_rollout_routing_replay,
                          router_api_key=job.servers.config.router_api_key,
                          router_admin_api_key=job.servers.config.admin_api_key)


def job_flags(cfg: JobConfig) -> dict[str, Any]:
    """Every flag of the job by name (``config.plugin_flags``)."""
    return plugin_flags(*(getattr(cfg, f.name) for f in dataclasses.fields(cfg)))


async def run_rollout(ctx: RolloutContext, plugins: Plugins, tasks: list[Task]) -> list[Sample]:
    """The rollout function's Samples, one per task, checked (the function is user code), then scored
    by ``--custom-rm-path`` where they have no reward yet."""
    answer = await plugins.rollout(ctx, tasks)
    return await checked(ctx, plugins, tasks, answer, f"--rollout-function-path {ctx.config.rollout_function_path}")


async def run_evaluation(ctx: RolloutContext, plugins: Plugins, tasks: list[Task]) -> list[Sample] | EvalResults:
    """``--eval-function-path`` (else the rollout function) on the evaluation's tasks: one Sample per
    task, checked as a rollout's, or ``EvalResults`` (per dataset, any number: slime's answer)."""
    function, where = ((plugins.evaluate, f"--eval-function-path {ctx.config.eval_function_path}") if plugins.evaluate
                       else (plugins.rollout, f"--rollout-function-path {ctx.config.rollout_function_path}"))
    answer = await function(ctx, tasks)
    if isinstance(answer, EvalResults):
        return answer
    return await checked(ctx, plugins, tasks, answer, where)


async def checked(ctx: RolloutContext, plugins: Plugins, tasks: list[Task], samples: Any, where: str) -> list[Sample]:
    """``samples`` in the tasks' order if they are one Sample per task, rewarded by ``--custom-rm-path``
    where they have none yet; else a ``PluginError`` naming ``where``."""
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        raise PluginError(f"{where}: expected a list of Samples, got {type(samples).__name__}")
    by_key = {(s.group_index, s.index): s for s in samples}
    missing = [(t.group_index, t.index) for t in tasks if (t.group_index, t.index) not in by_key]
    if missing or len(samples) != len(tasks):
        raise PluginError(f"{where}: expected one Sample per task ({len(tasks)}), got "
                          f"{len(samples)}; tasks without one (group_index, index): {missing[:5]}")
    ordered = [by_key[(t.group_index, t.index)] for t in tasks]
    for sample in ordered:  # which rollout played each task: the buffer keeps it beside the Sample
        sample.metadata.setdefault("rollout_id", ctx.rollout_id)
    if plugins.reward is not None:
        await plugins.reward.score(ctx, ordered)
    return ordered


def take_batch(cfg: JobConfig, plugins: Plugins, rollout_id: int, samples: list[Sample], trained: list[Sample],
               seconds: float) -> dict[str, float]:
    """What both loops do with a batch before training: the sample filter, the debug dump, the
    metrics (and a slime rollout log function's say over them)."""
    filter_samples(plugins, trained)
    save_rollout_data(cfg.rollout.save_debug_rollout_data, rollout_id, trained, job_flags(cfg))
    metrics = rollout_metrics(cfg.train.loss.reward_key, samples, trained)
    if cfg.rollout.biased_ratios:  # said on every row: the ratios of this run's cut sampling are not exact
        metrics["rollout/biased_ratios"] = 1.0
    return log_rollout(plugins, rollout_id, trained, metrics, seconds)



def filter_samples(plugins: Plugins, samples: list[Sample]) -> None:
    """``--rollout-sample-filter-path`` sees the batch by group and sets ``remove_sample`` on the Samples
    the trainer is to leave out of the loss."""
    if plugins.sample_filter is None:
        return
    groups: dict[Any, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    plugins.sample_filter(list(groups.values()))


def log_rollout(plugins: Plugins, rollout_id: int, samples: list[Sample], metrics: dict[str, float],
                seconds: float) -> dict[str, float]:
    """``--custom-rollout-log-function-path`` sees the rollout; if it returns True, the default
    ``rollout/*`` metrics are left out of the row (slime: it did the logging itself)."""
    if plugins.rollout_log is None:
        return metrics
    if plugins.rollout_log(rollout_id, samples, dict(metrics), seconds):
        return {k: v for k, v in metrics.items() if not k.startswith("rollout/")}
    return metrics


def phase_times(clock: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of one step (a phase that did not happen is absent)."""
    marks = list(clock.items())
    names = {"leased": "lease", "rolled_out": "rollout", "batched": "buffer", "waited": "wait", "trained": "train",
             "synced": "sync"}
    times = {f"time/{names[name]}_s": at - before for (_, before), (name, at) in zip(marks, marks[1:])}
    times["time/step_s"] = marks[-1][1] - marks[0][1]
    return times


def episode_metrics(prefix: str, samples: list[Sample]) -> dict[str, float]:
    """The shape of proxy-recorded episodes (``metadata.turns``): model calls per episode, and the
    share of episodes with at least one well-formed tool call (a turn the tool parser turned into
    ``tool_calls``). Nothing for rollouts that record no turns (single_turn, slime's)."""
    turns = [s.metadata["turns"] for s in samples if s.metadata.get("turns")]
    if not turns:
        return {}
    return {f"{prefix}/turns_mean": sum(map(len, turns)) / len(turns),
            f"{prefix}/tool_call_rate": sum(any(t["finish_reason"] == "tool_calls" for t in ts) for ts in turns) / len(turns)}


def rollout_metrics(reward_key: str | None, samples: list[Sample], trained: list[Sample]) -> dict[str, float]:
    usable = [s for s in samples if s.status in USABLE]
    # a raw reward slime's post-process makes a number in the trainer (OPD's: the teacher's answer) is not
    # averaged here; the trainer refuses one it cannot read
    rewards = [r for r in (reward_number(s.reward, reward_key) for s in usable) if r is not None]
    lengths = [s.response_length for s in usable]
    return {
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollout/samples": float(len(samples)), "rollout/trained_samples": float(len(trained)),
        "rollout/failed": float(sum(s.status == Sample.Status.FAILED for s in samples)),
        # episodes whose proxy session was lost (a restarted proxy): their tasks are played again
        "rollout/aborted": float(sum(s.status == Sample.Status.ABORTED for s in samples)),
        "rollout/truncated": float(sum(s.status == Sample.Status.TRUNCATED for s in samples)),
        "rollout/response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "rollout/response_tokens": float(sum(sum(s.loss_mask) for s in usable)),
        # Partial rollouts: model calls that a weight update interrupted and that went on from their
        # tokens, and the samples whose tokens therefore carry more than one weight version.
        "rollout/resumed_calls": float(sum(t.get("resumes", 0) for s in usable for t in s.metadata.get("turns", []))),
        "rollout/mixed_version_samples": float(sum(len(set(s.weight_versions)) > 1 for s in usable)),
        # tokens sampled from a cut distribution whose set was recorded (sampling masks), for the trainer to replay
        "rollout/kept_set_tokens": float(sum(sum(b > a for a, b in zip(s.rollout_top_p_token_offsets,
                                                                      s.rollout_top_p_token_offsets[1:]))
                                             for s in usable if s.rollout_top_p_token_offsets)),
    } | episode_metrics("rollout", usable)


async def sync_when_due(interval: int, job: Job, rollout_id: int, clock: dict[str, float]) -> dict[str, float]:
    """After training step ``rollout_id``: push the weights every ``interval`` (``--update-weights-interval``) steps."""
    if (rollout_id + 1) % interval:
        return {}
    metrics = await job.sync_weights(rollout_id + 1)
    clock["synced"] = time.perf_counter()
    return metrics


async def step_row(job: Job, metrics: dict[str, float], clock: dict[str, float]) -> dict[str, float]:
    """A step's metrics row: its own metrics, phase times, the buffer's totals, faults, the servers' version."""
    return (metrics | phase_times(clock) | await buffer_metrics(job) | job.fault_metrics()
            | {"weight_version": float(job.version)})


async def buffer_metrics(job: Job) -> dict[str, float]:
    """The buffer's running totals: what was set aside and why (nothing leaves it uncounted)."""
    stats = await job.buffer.stats()
    counters = stats["counters"]
    names = ("groups_filtered", "groups_failed", "groups_dropped_stale", "groups_retried_stale",
             "samples_requeued_partial", "samples_requeued_aborted", "leases_expired", "leases_released")
    return {f"buffer/{name}": float(counters.get(name, 0)) for name in names} | {
        "buffer/groups_waiting": float(stats["groups"]["complete"])}


def save_rollout_data(template: str | None, rollout_id: int, samples: list[Sample], flags: dict[str, Any]) -> None:
    """``--save-debug-rollout-data TEMPLATE``: what this rollout trains on, in the form
    ``--load-debug-rollout-data`` reads: one Sample per line (jsonl), or another framework's dump by
    the path's suffix (``plugins.DUMP_FORMATS``: ``.pt``, slime's)."""
    import orjson

    if not template:
        return
    path = Path(template.format(rollout_id=rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in DUMP_FORMATS:
        DUMP_FORMATS[path.suffix].write(path, rollout_id, samples, flags)
        return
    mode = "wb" if "{rollout_id}" in template or rollout_id == 0 else "ab"
    with path.open(mode) as out:
        out.writelines(orjson.dumps(s.to_json()) + b"\n" for s in samples)


async def evaluate(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int) -> dict[str, float]:
    """The rollout function on ``--eval-prompt-data`` at ``--eval-temperature`` (through no buffer:
    nothing here is trained on), once for the main evaluation (``eval/*``) and once per
    ``--eval-variants`` entry (``eval/NAME/*``). A pass is a sample whose reward reaches 1, the
    graders' "correct"."""
    records = read_prompts(cfg.buffer, cfg.rollout.eval_prompt_data)
    n = cfg.rollout.n_samples_per_eval_prompt
    tasks = [Task(lease_id="eval", group_index=i, index=i * n + j, prompt_index=i, prompt=r.prompt, label=r.label,
                  metadata=r.metadata, tools=r.tools) for i, r in enumerate(records) for j in range(n)]
    played = {variant: await run_evaluation(context(cfg, job, plugins, rollout_id, evaluation=True, variant=variant),
                                            plugins, tasks) for variant in plugins.eval_envs or [""]}
    metrics = {key: value for variant, answer in played.items()
               for key, value in eval_metrics(f"eval/{variant}" if variant else "eval", cfg.train.loss.reward_key,
                                              answer).items()}
    return log_evaluation(cfg, plugins, rollout_id, played[""], metrics)


def eval_metrics(prefix: str, reward_key: str | None, answer: list[Sample] | EvalResults) -> dict[str, float]:
    """Reward, pass rate and episodes over every Sample; for ``EvalResults`` also each dataset's, as slime
    logs them (``eval/NAME``: its mean reward, ``eval/NAME-truncated_ratio``), and the function's own."""
    if not isinstance(answer, EvalResults):
        return sample_metrics(prefix, reward_key, answer)
    samples = [s for result in answer.datasets.values() for s in result.samples]
    metrics = sample_metrics(prefix, reward_key, samples) if samples else {}
    for name, result in answer.datasets.items():
        if result.rewards:
            metrics[f"{prefix}/{name}"] = sum(result.rewards) / len(result.rewards)
        if result.truncated:
            metrics[f"{prefix}/{name}-truncated_ratio"] = sum(result.truncated) / len(result.truncated)
    return metrics | answer.metrics


def sample_metrics(prefix: str, reward_key: str | None, samples: list[Sample]) -> dict[str, float]:
    usable = [s for s in samples if s.status in USABLE]
    rewards = [s.scalar_reward(reward_key) for s in usable]
    mean = (lambda values: sum(values) / len(values) if values else float("nan"))
    return {f"{prefix}/reward_mean": mean(rewards), f"{prefix}/pass_rate": mean([float(r >= 1.0) for r in rewards]),
            f"{prefix}/failed": float(len(samples) - len(rewards))} | episode_metrics(prefix, usable)


def log_evaluation(cfg: JobConfig, plugins: Plugins, rollout_id: int, answer: list[Sample] | EvalResults,
                   metrics: dict[str, float]) -> dict[str, float]:
    """``--custom-eval-rollout-log-function-path`` sees the main evaluation; if it returns True, the
    default ``eval/*`` metrics are left out of the row (slime: it did the logging itself)."""
    if plugins.eval_log is not None:  # {dataset: {rewards, truncated, samples}}, as slime's
        if isinstance(answer, EvalResults):
            data = {name: {"rewards": r.rewards, "truncated": r.truncated, "samples": r.samples}
                    for name, r in answer.datasets.items()}
        else:
            usable = [s for s in answer if s.status in USABLE]
            data = {Path(cfg.rollout.eval_prompt_data).stem: {
                "rewards": [s.scalar_reward(cfg.train.loss.reward_key) for s in usable],
                "truncated": [s.status == Sample.Status.TRUNCATED for s in usable], "samples": usable}}
        if plugins.eval_log(rollout_id, data, dict(metrics)):
            return {}
    return metrics


def summary(metrics: dict[str, float]) -> str:
    shown = {"reward": "rollout/reward_mean", "loss": "train/loss", "eval": "eval/reward_mean", "pass": "eval/pass_rate",
             "tool_calls": "eval/tool_call_rate",
             "version": "weight_version", "staleness": "async/staleness_mean", "step_s": "time/step_s",
             "rollout_s": "time/rollout_s", "wait_s": "time/wait_s", "train_s": "time/train_s", "sync_s": "time/sync_s"}
    variants = {f"{key.split('/')[1]} {what}": key for key in metrics if key.count("/") == 2
                for what, end in (("pass", "/pass_rate"), ("tool_calls", "/tool_call_rate")) if key.endswith(end)}
    return ", ".join(f"{name} {metrics[key]:.4g}" for name, key in (shown | variants).items() if key in metrics)
