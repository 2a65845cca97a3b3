"""Plug-ins written as slime's customization guide shows them: our own code, slime's API and imports.

Nothing here knows inverted: the imports are slime's module paths, which the plug-in loader makes
resolve to ``inverted.compat.slime`` (slime itself is not installed).
"""

import asyncio
import copy
import json
import os
import queue
import re
import threading
import time
from pathlib import Path

import torch
from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.http_utils import post
from slime.utils.misc import load_function
from slime.utils.types import Sample

from envs import calculator as calc

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
LOG = Path(os.environ.get("SLIME_PLUGIN_LOG", "slime_log.jsonl"))  # the test says where


def calculator(expression: str) -> str:
    if not re.fullmatch(r"[0-9+\-*/() ]+", expression):
        return "error: not an expression"
    return str(eval(expression))  # noqa: S307 (digits and operators only)


def append_sampled(sample: Sample, output: dict) -> None:
    """One router answer onto the sample: its tokens trained, with their logprobs and version."""
    meta = output["meta_info"]
    sample.tokens = sample.tokens + output["output_ids"]
    sample.loss_mask += [1] * len(output["output_ids"])
    sample.rollout_log_probs += [logprob for logprob, _, _ in meta["output_token_logprobs"]]
    sample.weight_versions.append(meta["weight_version"])


def append_observation(sample: Sample, ids: list[int]) -> None:
    """Tokens the model did not sample (a tool's output, the template's glue): masked out."""
    sample.tokens = sample.tokens + ids
    sample.loss_mask += [0] * len(ids)
    sample.rollout_log_probs += [0.0] * len(ids)


def finish(sample: Sample, prompt_length: int, last: dict) -> Sample:
    sample.response_length = len(sample.tokens) - prompt_length
    sample.status = (
        Sample.Status.TRUNCATED if last["meta_info"]["finish_reason"]["type"] == "length" else Sample.Status.COMPLETED
    )
    return sample


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """A two-turn calculator loop (search-r1's pattern): the model answers, the calculator's result on
    the question comes back as a tool message (masked out), and the model answers again."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    messages = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    sample.tokens = state.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt_length = len(sample.tokens)
    sample.loss_mask, sample.rollout_log_probs = [], []
    for turn in range(2):
        output = await post(
            url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        )
        append_sampled(sample, output)
        sample.response += output["text"]
        if turn == 0:
            expression = re.sub(r"[^0-9+\-*/() ]", "", messages[-1]["content"])
            append_observation(
                sample,
                state.tokenizer(
                    f"\n<tool_response>\n{calculator(expression)}\n</tool_response>\n", add_special_tokens=False
                )["input_ids"],
            )
    return finish(sample, prompt_length, output)


async def calculator_episode(args, sample: Sample, sampling_params: dict) -> Sample:
    """``envs.calculator``'s episode as a slime generate function, to compare with the agent rollout.

    The model may call the calculator (Hermes ``<tool_call>`` blocks); a wrong answer gets the same
    retry message, up to ``MAX_TURNS`` calls. Each turn's new messages are tokenized as the
    template's text after the conversation so far, preceded by what is left of the assistant
    turn's end (``<|im_end|>\\n``) after the last sampled token: what the proxy records for an agent.
    The reward is set here, so slime (and inverted) run no reward model for it.
    """
    tokenizer = GenerateState(args).tokenizer
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tools = sample.metadata.get("tools") or calc.TOOLS
    messages = [{"role": "system", "content": calc.SYSTEM}, {"role": "user", "content": sample.prompt}]

    def render(generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    sample.tokens = tokenizer(render(True), add_special_tokens=False)["input_ids"]
    prompt_length = len(sample.tokens)
    sample.loss_mask, sample.rollout_log_probs, sample.reward = [], [], 0.0
    for turn in range(calc.MAX_TURNS):
        output = await post(
            url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        )
        append_sampled(sample, output)
        ids = output["output_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        sample.response += text
        try:
            calls = [json.loads(block) for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)]
        except ValueError:
            calls = []
        if calls:
            messages.append(
                {
                    "role": "assistant",
                    "content": text[: text.index("<tool_call>")].rstrip() or None,
                    "tool_calls": [
                        {"id": f"call_{i}", "type": "function", "function": call} for i, call in enumerate(calls)
                    ],
                }
            )
            new = [
                {
                    "role": "tool",
                    "tool_call_id": f"call_{i}",
                    "content": calc.run_tool(call["name"], json.dumps(call.get("arguments", {}))),
                }
                for i, call in enumerate(calls)
            ]
        elif calc.is_correct(text, sample.label):
            sample.reward = 1.0
            break
        else:
            messages.append({"role": "assistant", "content": text})
            new = [{"role": "user", "content": calc.RETRY}]
        if turn == calc.MAX_TURNS - 1:
            break
        before = render(False)
        messages.extend(new)
        after = render(True)
        turn_end, last = "<|im_end|>\n", tokenizer.decode(ids[-1:])
        junction = turn_end[len(last) :] if last and turn_end.startswith(last) else turn_end
        append_observation(sample, tokenizer(junction + after[len(before) :], add_special_tokens=False)["input_ids"])
    return finish(sample, prompt_length, output)


async def group_rm(args, samples: list[Sample]) -> list[float]:
    """Batched (--group-rm): the group's longest response scores 1, the others 0."""
    longest = max(s.response_length for s in samples)
    return [float(s.response_length == longest) for s in samples]


def keep_differing_rewards(args, samples, **kwargs) -> DynamicFilterOutput:
    rewards = {s.reward for s in samples}
    return DynamicFilterOutput(keep=len(rewards) > 1, reason=None if len(rewards) > 1 else "all_equal")


def newest_groups_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """A buffer filter: the highest group_index first (slime's default takes the oldest)."""
    return sorted(buffer, key=lambda group: -group[0].group_index)[:num_samples]


def remove_odd_indices(args, groups: list[list[Sample]]) -> None:
    for group in groups:
        for sample in group:
            sample.remove_sample = sample.index % 2 == 1


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    with LOG.open("a") as out:
        out.write(
            json.dumps(
                {
                    "rollout_id": rollout_id,
                    "samples": len(samples),
                    "time": rollout_time,
                    "reward_mean": rollout_extra_metrics.get("rollout/reward_mean"),
                    "removed": sum(s.remove_sample for s in samples),
                }
            )
            + "\n"
        )
    return True  # the default rollout metrics are skipped


def eval_rollout(args, rollout_id, data_buffer, evaluation=False):
    """A slime rollout function for evaluation only (--eval-function-path): scores every task 0.5, and
    answers as slime's eval functions did before ``RolloutFnEvalOutput``: a dict of datasets."""
    groups = data_buffer.get_samples(len(data_buffer._groups))
    for group in groups:
        for sample in group:
            sample.tokens, sample.response_length = [1, 2], 1
            sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [1], [-0.1], ["0"]
            sample.reward, sample.status = (0.5 if evaluation else 0.0), Sample.Status.COMPLETED
    if not evaluation:
        return groups
    samples = [sample for group in groups for sample in group]  # slime's (legacy) evaluation answer
    return {"calc": {"rewards": [s.reward for s in samples], "truncated": [False] * len(samples), "samples": samples}}


def log_eval(rollout_id, args, data, extra_metrics) -> bool:
    with LOG.open("a") as out:
        out.write(json.dumps({"eval": rollout_id, "datasets": {k: len(v["samples"]) for k, v in data.items()}}) + "\n")
    return False


# -- the trainer's plug-ins --------------------------------------------------------------------------

DR_GRPO_DIVISOR = 16.0


def get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Dr. GRPO: each sample's token sum divided by one constant, not by its own length."""

    def reducer(x: torch.Tensor) -> torch.Tensor:
        return sum((part * mask).sum() for part, mask in zip(x.split(response_lengths), loss_masks)) / DR_GRPO_DIVISOR

    return reducer


def sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """slime's own reducer (``cp_utils.get_sum_of_sample_mean`` without context parallelism): each
    sample's mean over its tokens, summed; with ``calculate_per_token_loss``, the plain token sum."""

    def reducer(x: torch.Tensor) -> torch.Tensor:
        parts = zip(x.split(response_lengths), loss_masks)
        if calculate_per_token_loss:
            return sum((part * mask).sum() for part, mask in parts)
        return sum((part * mask).sum() / torch.clamp_min(mask.sum(), 1) for part, mask in parts)

    return reducer


def half_and_reject_first(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """An importance-weight function: every weight 0.5, and each sample's first token rejected."""
    masks = [mask.clone() for mask in loss_masks]
    for mask in masks:
        mask[0] = 0
    return pg_loss * 0.5, masks, {"tis": torch.full_like(pg_loss, 0.5)}


def nll_loss(args, batch, logits, sum_of_sample_mean):
    """A custom loss: the negative log-likelihood of the response tokens (SFT), slime's way."""
    _, out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    log_probs = out["log_probs"]
    loss = -sum_of_sample_mean(torch.cat(log_probs))
    return loss, {"nll": loss.detach()}


def rewards_as_given(args, samples):
    """Reward post-processing that keeps the raw rewards (no group normalisation)."""
    raw = [s.reward for s in samples]
    return raw, raw


async def generate_current(args, sample: Sample, sampling_params: dict) -> Sample:
    """``generate`` as slime's examples write it since August 2026 (search-r1, retool): the response grows
    through ``Sample.append_response_tokens``, the model's tokens with their logprobs and SGLang's
    ``meta_info`` (status, weight version), the tool's with ``trainable=False``."""
    tokenizer = load_function("slime.rollout.sglang_rollout.GenerateState")(args).tokenizer
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    messages = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    sample.tokens = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for turn in range(2):
        output = await post(
            url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        )
        meta = output["meta_info"]
        sample.append_response_tokens(
            args,
            tokens=output["output_ids"],
            text=output["text"],
            meta_info=meta,
            log_probs=[logprob for logprob, _, _ in meta["output_token_logprobs"]],
        )
        if turn == 0:
            expression = re.sub(r"[^0-9+\-*/() ]", "", messages[-1]["content"])
            result = f"\n<tool_response>\n{calculator(expression)}\n</tool_response>\n"
            sample.append_response_tokens(
                args, tokens=tokenizer(result, add_special_tokens=False)["input_ids"], trainable=False, text=result
            )
    # a dict of any values; the scores differ within odd groups only, so the filter has groups to drop
    score = float(sample.index % 2) if sample.group_index % 2 else 0.0
    sample.reward = {"score": score, "parsed": sample.response[:8]}
    return sample


def rollout_current(args, rollout_id, data_buffer, evaluation=False):
    """A rollout function as slime's own are written now: it plays each task with ``generate_current``
    and answers ``RolloutFnTrainOutput`` (``slime.rollout.base_types``), not a bare list."""
    groups = data_buffer.get_samples(args.rollout_batch_size)
    params = {"max_new_tokens": args.rollout_max_response_len, "temperature": 1.0}
    for group in groups:
        for i, sample in enumerate(group):
            group[i] = asyncio.run(generate_current(args, sample, params))
    return RolloutFnTrainOutput(samples=groups, metrics={"custom/played": len(groups)})


NOTED_ARGS = (
    "num_layers",
    "use_wandb",
    "wandb_project",
    "sglang_mem_fraction_static",
    "max_turns",
    "reward_key",
    "rollout_batch_size",
    "calculate_per_token_loss",
    "use_rollout_logprobs",
    "rm_type",
)


def note_args(args, where: str) -> None:
    """Write what this process's ``args`` holds (``args.args_log``, set by ``--custom-config-path``)."""
    Path(f"{args.args_log}.{where}").write_text(json.dumps({name: getattr(args, name) for name in NOTED_ARGS}))


def oldest_first_noting_args(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """A buffer filter (it runs in the buffer service) that notes its ``args`` and takes the oldest groups."""
    note_args(args, "buffer")
    return buffer[:num_samples]


def rollout_noting_args(args, rollout_id, data_buffer, evaluation=False):
    note_args(args, "rollout")
    return rollout_current(args, rollout_id, data_buffer, evaluation)


def broken_filter(args, samples, **kwargs) -> DynamicFilterOutput:
    """A dynamic-sampling filter with a bug (it runs in the buffer service)."""
    return DynamicFilterOutput(keep=samples[0].reward["no_such_key"] > 0)


def rollout_by_slimes_default_path(args, rollout_id, data_buffer, evaluation=False):
    """A rollout function that hands each group to slime's own ``generate_and_rm_group``."""
    from slime.rollout.sglang_rollout import generate_and_rm_group

    params = {
        "max_new_tokens": args.rollout_max_response_len,
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
    }

    async def play(groups):
        return await asyncio.gather(*(generate_and_rm_group(args, group, params, evaluation) for group in groups))

    return RolloutFnTrainOutput(samples=list(asyncio.run(play(data_buffer.get_samples(args.rollout_batch_size)))))


async def teacher_answer(args, sample: Sample, **kwargs) -> dict:
    """On-policy distillation's reward model, as slime's: the teacher server scores the whole sequence
    (no new token) and its answer, with every input token's log-prob, is the reward."""
    payload = {
        "input_ids": sample.tokens,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0, "skip_special_tokens": False},
    }
    return await post(args.rm_url, payload)


def teacher_log_probs(args, samples: list[Sample], **kwargs):
    """On-policy distillation's reward post-process, as slime's: the teacher's log-probs of each
    response token onto the Sample, and a task reward of 0 (the KL term is the whole signal)."""
    for sample in samples:
        answer = sample.get_reward_value(args)
        logprobs = torch.tensor([lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]])
        sample.teacher_log_probs = logprobs[-sample.response_length :]
    zeros = [0.0] * len(samples)
    return zeros, zeros


class _Worker:
    """A generation worker that outlives the rollout that started it, as slime's fully-async one: its
    own thread and event loop, fed from the ``data_buffer`` it was first handed."""

    def __init__(self, args, data_buffer) -> None:
        self.args, self.data_buffer, self.done = args, data_buffer, queue.Queue()
        self.calls = 0
        threading.Thread(target=asyncio.run, args=(self._loop(),), daemon=True).start()

    async def _loop(self) -> None:
        state = GenerateState(self.args)
        while True:
            groups = self.data_buffer.get_samples(1)
            if not groups:
                await asyncio.sleep(0.05)
                continue
            self.done.put(await generate_and_rm_group(self.args, groups[0], state.sampling_params.copy()))


_worker: _Worker | None = None


def rollout_with_a_lasting_worker(args, rollout_id, data_buffer, evaluation=False):
    global _worker
    if _worker is None:
        _worker = _Worker(args, data_buffer)
    _worker.calls += 1
    groups = [_worker.done.get(timeout=60) for _ in range(args.rollout_batch_size)]  # fails, not hangs, unfed
    with LOG.open("a") as log:
        log.write(json.dumps({"rollout_id": rollout_id, "same_buffer": data_buffer is _worker.data_buffer}) + "\n")
    return RolloutFnTrainOutput(samples=sorted(groups, key=lambda group: group[0].index))


def replay_dump(args, rollout_id, data_buffer, evaluation=False):
    """A rollout replayed from a dump (slime's forge_load): its template's file, else rollout 0's."""
    path = args.load_forge_rollout_data.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        path = args.load_forge_rollout_data.format(rollout_id=0)
    blob = torch.load(path, weights_only=False)
    return RolloutFnTrainOutput(samples=[Sample.from_dict(s) for s in blob["samples"]])


def sleep_forever(args, rollout_id, data_buffer, evaluation=False):
    """slime's sleep_rollout: never returns (the test is told it started)."""
    LOG.write_text("sleeping\n")
    while True:
        time.sleep(3600)


async def generate_its_own_way(args, sample: Sample, sampling_params: dict) -> Sample:
    """A generate function that calls its server its own way (its own HTTP client, no log-probs asked
    for), as slime allows: the Sample comes back with no rollout log-probs and no weight versions."""
    import httpx

    tokenizer = GenerateState(args).tokenizer
    messages = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    headers = {"Authorization": f"Bearer {args.router_api_key}"} if getattr(args, "router_api_key", None) else {}
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        response = await client.post(
            f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate",
            json={"input_ids": prompt, "sampling_params": sampling_params},
            headers=headers,
        )
    output = response.raise_for_status().json()
    sample.tokens, sample.response_length = prompt + output["output_ids"], len(output["output_ids"])
    sample.response = output["text"]
    sample.status = (
        Sample.Status.TRUNCATED if output["meta_info"]["finish_reason"]["type"] == "length" else Sample.Status.COMPLETED
    )
    sample.reward = float(len(sample.response) % 2)  # differs within groups, so there is something to learn
    return sample


async def generate_fanned_out(args, sample: Sample, sampling_params: dict) -> list[Sample]:
    """slime's fan-out contract (its ``_fanout_test_helpers.compact_generate``): one generate call, then
    1 + index % 3 Samples sharing the task's ``rollout_id``, each sampled on its own."""
    from slime.rollout.sglang_rollout import generate as slimes_generate

    fanned = []
    for _ in range(1 + sample.index % 3):
        one = await slimes_generate(args, copy.deepcopy(sample), sampling_params)
        one.rollout_id = sample.index
        fanned.append(one)
    return fanned


async def response_length_rm(args, sample: Sample) -> float:
    """Per Sample: the response's length over 16."""
    return sample.response_length / 16
