"""slime's default rollout: one ``/generate`` per task on the router, or slime's custom generate function.

No proxy and no environment: the prompt (chat messages through the checkpoint's chat template, or
plain text as is) is tokenized here once, and the router's SGLang ``/generate`` returns the sampled
ids with their logprobs and weight version (and, under top-p or top-k, each token's sampling mask:
``Sample.rollout_top_p_token_ids``). The job scores the finished Samples with
``--custom-rm-path`` (ours ``reward(sample)``, or slime's; see ``inverted.plugins``).

With ``--custom-generate-function-path`` the function replaces that one call, as in slime::

    async def generate(args, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

(the generate hook: its adapter, ``compat.slime_forms``, converts the Samples both ways) it gets
slime's ``Sample`` for the task and calls the router itself (``slime.utils.http_utils.post``
records each answer's weight version, so every sampled token keeps the version that sampled it).
Several Samples from one task (a fan-out) must share ``rollout_id``: each is a Sample of the task's
(its group and index), scored, stored, served and trained as one of its group.

A generation cut by the length limit is ``truncated``; an aborted one is returned ``aborted``
(with --partial-rollout the buffer keeps it to resume).
"""

from __future__ import annotations

import asyncio
import functools
import itertools

from inverted.errors import PluginError
from inverted.plugins import RolloutContext
from inverted.rollout.sglang_client import (
    GenerateClient,
    generate_client,
    read_output,
    read_routed_experts,
    read_sampling_mask,
    with_sampling_mask,
)
from inverted.types import Sample, Task

STATUS = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}


@functools.lru_cache(maxsize=4)
def tokenizer_of(checkpoint: str, chat_template: str | None):
    from inverted.hf_checkpoint import load_tokenizer

    return load_tokenizer(checkpoint, chat_template)


def prompt_ids(ctx: RolloutContext, task: Task) -> list[int]:
    tokenizer = tokenizer_of(ctx.hf_checkpoint, ctx.chat_template)
    if isinstance(task.prompt, list):
        return tokenizer.apply_chat_template(
            task.prompt, tools=task.tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return tokenizer.encode(task.prompt, add_special_tokens=False)


async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
    params = {
        "temperature": ctx.sampling["temperature"],
        "top_p": ctx.sampling["top_p"],
        "top_k": ctx.sampling.get("top_k", -1),
        "max_new_tokens": ctx.sampling["max_tokens"],
    }
    if ctx.sampling.get("seed") is not None:  # as the proxy passes an OpenAI seed on
        params["sampling_seed"] = ctx.sampling["seed"]
    lora = {"lora_path": ctx.lora_path} if ctx.lora_path else {}  # a LoRA run's policy is its adapter
    routes = {"return_routed_experts": True} if ctx.routed_experts else {}  # for the trainer to replay (R3)
    limit = asyncio.Semaphore(ctx.config.rollout_concurrency)

    async def one(client: GenerateClient, task: Task) -> Sample:
        ids = prompt_ids(ctx, task)
        async with limit:
            out = await client.generate(
                with_sampling_mask(
                    {"input_ids": ids, "sampling_params": params, "return_logprob": True, **lora, **routes},
                    ctx.config.sampling_mask_top_k,
                )
            )
        # each token's version: a call paused across a weight update holds tokens of both
        output_ids, logprobs, versions, _, finish = read_output(out, ctx.router_url)
        kept = read_sampling_mask(out, ctx.router_url)
        sample = task.new_sample()
        sample.tokens, sample.response_length = ids + output_ids, len(output_ids)
        sample.loss_mask = [1] * sample.response_length
        sample.rollout_log_probs, sample.weight_versions = logprobs, versions
        sample.status = STATUS.get((finish or {}).get("type"), Sample.Status.COMPLETED)
        sample.rollout_routed_experts = read_routed_experts(out)
        if kept is not None:  # each token's set and its probability within it, for the trainer to replay
            masks, sample.rollout_log_probs = kept
            sample.rollout_top_p_token_ids = [t for mask in masks for t in mask]
            sample.rollout_top_p_token_offsets = list(itertools.accumulate(map(len, masks), initial=0))
        return sample

    async def custom(task: Task) -> list[Sample]:
        start = task.partial if task.partial is not None else task.new_sample()
        if task.tools:
            start.metadata.setdefault("tools", task.tools)
        sampling = {
            **params,
            "top_k": -1,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        async with limit:
            samples = await ctx.generate(ctx, start, sampling)
        if not samples:
            raise PluginError(f"--custom-generate-function-path: no Sample for task {(task.group_index, task.index)}")
        for sample in samples:
            sample.group_index, sample.index = task.group_index, task.index
        return samples

    if ctx.generate is not None:
        return [sample for fanned in await asyncio.gather(*(custom(task) for task in tasks)) for sample in fanned]
    async with generate_client(
        ctx.router_url,
        routed_experts=ctx.routed_experts,
        api_key=ctx.router_api_key,
        admin_api_key=ctx.router_admin_api_key,
        max_connections=ctx.config.rollout_concurrency,
    ) as client:
        return list(await asyncio.gather(*(one(client, task) for task in tasks)))


generate_rollout.requires = ("custom_rm_path",)  # checked by the job before anything starts
