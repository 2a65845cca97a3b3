"""slime's default rollout: one ``/generate`` per task on the router, scored by ``--custom-rm-path``.

No proxy and no environment: the prompt (chat messages through the checkpoint's chat template, or
plain text as is) is tokenized here once, the router's SGLang ``/generate`` returns the sampled ids
with their logprobs and weight version, and the reward function scores the finished Sample::

    def reward(sample: Sample) -> float | dict[str, float]   # or async def

A generation cut by the length limit is ``truncated``; an aborted one is returned ``aborted``
(with --partial-rollout the buffer keeps it to resume).
"""

from __future__ import annotations

import asyncio
import functools
import inspect

from inverted.plugins import RolloutContext
from inverted.rollout.sglang_client import SGLangClient
from inverted.types import Sample, Task

STATUS = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}


@functools.lru_cache(maxsize=4)
def tokenizer_of(checkpoint: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def prompt_ids(checkpoint: str, task: Task) -> list[int]:
    tokenizer = tokenizer_of(checkpoint)
    if isinstance(task.prompt, list):
        return tokenizer.apply_chat_template(task.prompt, tools=task.tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    return tokenizer.encode(task.prompt, add_special_tokens=False)


async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
    params = {"temperature": ctx.sampling["temperature"], "top_p": ctx.sampling["top_p"],
              "max_new_tokens": ctx.sampling["max_tokens"]}
    limit = asyncio.Semaphore(ctx.config.rollout_concurrency)

    async def one(client: SGLangClient, task: Task) -> Sample:
        ids = prompt_ids(ctx.hf_checkpoint, task)
        async with limit:
            out = await client.generate({"input_ids": ids, "sampling_params": params, "return_logprob": True})
        meta = out["meta_info"]
        sample = task.new_sample()
        sample.tokens, sample.response_length = ids + out["output_ids"], len(out["output_ids"])
        sample.loss_mask = [1] * sample.response_length
        sample.rollout_log_probs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        sample.weight_versions = [str(meta["weight_version"])] * sample.response_length
        sample.status = STATUS.get(meta["finish_reason"]["type"], Sample.Status.COMPLETED)
        reward = ctx.reward_fn(sample)
        sample.reward = await reward if inspect.isawaitable(reward) else reward
        return sample

    async with SGLangClient(ctx.router_url, max_connections=ctx.config.rollout_concurrency) as client:
        return list(await asyncio.gather(*(one(client, task) for task in tasks)))


generate_rollout.requires = ("custom_rm_path",)  # checked by the job before anything starts
