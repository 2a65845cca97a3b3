"""Calling the rollout function: the context it gets, the Samples it answers, checked; its saved data.

``context`` builds the ``RolloutContext`` a rollout function receives; ``run_rollout`` calls the
function on leased tasks and checks its answer (user code: one Sample per task, or several, a
fan-out, rewarded by ``--custom-rm-path`` where it left none; ``by_task`` pairs each with its task),
``run_evaluation`` the evaluation's (which may also answer per dataset, as slime's do:
``EvalResults``); ``save_rollout_data`` writes a batch where
``--save-debug-rollout-data`` says, in the form ``--load-debug-rollout-data`` reads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from inverted.buffer.config import BufferConfig
from inverted.buffer.datasets import PromptRecord, load_prompts
from inverted.config import plugin_flags
from inverted.controller.config import JobConfig
from inverted.controller.job import Job
from inverted.errors import PluginError
from inverted.plugins import DUMP_FORMATS, EvalResults, Plugins, RolloutContext
from inverted.types import Sample, Task


def read_prompts(buffer: BufferConfig, path: str) -> list[PromptRecord]:
    return load_prompts(
        path,
        input_key=buffer.input_key,
        label_key=buffer.label_key,
        metadata_key=buffer.metadata_key,
        tool_key=buffer.tool_key,
    )


def context(
    cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int, evaluation: bool = False, variant: str = ""
) -> RolloutContext:
    """What a rollout function gets: its section, the services' addresses, sampling, the version serving,
    and every flag of the job by name (from which adapters build other frameworks' ``args``). An
    evaluation's environment is its ``variant``'s (``Plugins.eval_envs``)."""
    rollout = cfg.rollout
    temperature = rollout.eval_temperature if evaluation else rollout.rollout_temperature
    longest = rollout.rollout_max_response_len
    if evaluation and rollout.eval_max_response_len is not None:
        longest = rollout.eval_max_response_len
    sampling = {
        "temperature": temperature,
        "top_p": rollout.rollout_top_p if temperature else 1.0,
        "max_tokens": longest,
    }
    if temperature and rollout.rollout_top_k > 0:
        sampling["top_k"] = rollout.rollout_top_k
    return RolloutContext(
        rollout_id=rollout_id,
        config=cfg.rollout,
        proxy_url=job.proxy_url,
        proxy_api_key=job.proxy_key,
        router_url=job.servers.router_url,
        hf_checkpoint=cfg.train.hf_checkpoint,
        chat_template=cfg.proxy.chat_template,
        sampling=sampling,
        env=plugins.eval_envs.get(variant, plugins.env) if evaluation else plugins.env,
        generate=plugins.generate,
        evaluation=evaluation,
        flags=job_flags(cfg),
        weight_version=job.weight_version,
        async_mode=cfg.loop.async_mode,
        lora_path=job.adapter,
        routed_experts=cfg.train.moe.use_rollout_routing_replay,
        router_api_key=job.servers.config.router_api_key,
        router_admin_api_key=job.servers.config.admin_api_key,
    )


def job_flags(cfg: JobConfig) -> dict[str, Any]:
    """Every flag of the job by name (``config.plugin_flags``)."""
    return plugin_flags(*(getattr(cfg, f.name) for f in dataclasses.fields(cfg)))


async def run_rollout(ctx: RolloutContext, plugins: Plugins, tasks: list[Task]) -> list[Sample]:
    """The rollout function's Samples, one or more per task, checked (the function is user code), then
    scored by ``--custom-rm-path`` where they have no reward yet."""
    answer = await plugins.rollout(ctx, tasks)
    return await checked(ctx, plugins, tasks, answer, f"--rollout-function-path {ctx.config.rollout_function_path}")


async def run_evaluation(ctx: RolloutContext, plugins: Plugins, tasks: list[Task]) -> list[Sample] | EvalResults:
    """``--eval-function-path`` (else the rollout function) on the evaluation's tasks: one Sample per
    task, checked as a rollout's, or ``EvalResults`` (per dataset, any number: slime's answer)."""
    function, where = (
        (plugins.evaluate, f"--eval-function-path {ctx.config.eval_function_path}")
        if plugins.evaluate
        else (plugins.rollout, f"--rollout-function-path {ctx.config.rollout_function_path}")
    )
    answer = await function(ctx, tasks)
    if isinstance(answer, EvalResults):
        return answer
    return await checked(ctx, plugins, tasks, answer, where)


async def checked(ctx: RolloutContext, plugins: Plugins, tasks: list[Task], samples: Any, where: str) -> list[Sample]:
    """``samples`` in the tasks' order if each task has one (or several of its own: a fan-out, kept in
    their order), rewarded by ``--custom-rm-path`` where they have none yet; else a ``PluginError``
    naming ``where``."""
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        raise PluginError(f"{where}: expected a list of Samples, got {type(samples).__name__}")
    if len({id(s) for s in samples}) != len(samples):  # a fan-out's Samples are each its own
        raise PluginError(f"{where}: the same Sample object is in its answer twice")
    by_key: dict[tuple[int | None, int | None], list[Sample]] = {}
    for sample in samples:
        by_key.setdefault((sample.group_index, sample.index), []).append(sample)
    keys = {(t.group_index, t.index) for t in tasks}
    missing = [(t.group_index, t.index) for t in tasks if (t.group_index, t.index) not in by_key]
    strangers = [key for key in by_key if key not in keys]
    if missing or strangers:
        raise PluginError(
            f"{where}: expected one Sample per task ({len(tasks)}), got {len(samples)} (or a task's fan-out: "
            f"several with its group_index and index); tasks without one (group_index, index): {missing[:5]}; "
            f"Samples of no task: {strangers[:5]}"
        )
    for fan_out in by_key.values():
        numbered(fan_out)
    ordered = [sample for t in tasks for sample in by_key[(t.group_index, t.index)]]
    for sample in ordered:  # which rollout played each task: the buffer keeps it beside the Sample
        sample.metadata.setdefault("rollout_id", ctx.rollout_id)
    if plugins.reward is not None:
        await plugins.reward.score(ctx, ordered)
    return ordered


def numbered(fan_out: list[Sample]) -> None:
    """A task's Samples each with its own ``metadata["branch"]`` (of ``"branches"``), the key that tells
    them apart beside ``(group_index, index)`` in the trainer's details and ``inverted view``. A proxy
    session's branches come numbered; a plug-in's fan-out is numbered here in its order."""
    if len(fan_out) > 1 and len({s.metadata.get("branch", 0) for s in fan_out}) < len(fan_out):
        for branch, sample in enumerate(fan_out):
            sample.metadata["branch"], sample.metadata["branches"] = branch, len(fan_out)


def by_task(tasks: list[Task], samples: list[Sample]) -> list[tuple[Task | str, Sample]]:
    """Each Sample with the task it played (a task's fan-out shares it), to submit with its lease."""
    lease: dict[tuple[int | None, int | None], Task] = {(t.group_index, t.index): t for t in tasks}
    return [(lease[(s.group_index, s.index)], s) for s in samples]


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
