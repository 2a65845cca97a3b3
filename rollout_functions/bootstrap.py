"""Bootstrapping: a run's successful episodes played again through another agent, as SFT data.

The cold start of tool use. An agent that leaves the call to the model (``tool_choice`` auto)
never calls a tool a small model has not learnt to call, so RL on it has nothing to reinforce.
The same task with the call forced (``tool_choice="required"``, served by the proxy writing the
call's opening) succeeds often enough to learn from. This rollout turns those successes into the
first agent's data, the way ReTool and slime's retool example cold-start, but from the job's own
rollouts (rejection-sampling fine-tuning):

- each task's recorded successes (``--bootstrap-from``: a run's buffer, read as an archive) are
  the episodes of the same prompt whose reward reached a pass;
- one of them is played again through ``--env-path`` (with ``--env-args``: the agent as its users
  run it) in a scripted proxy session (``Session.script``), whose calls answer with the recorded
  replies instead of sampling: the forced opening and what the model sampled after it, now one
  reply;
- the proxy records that conversation as it records any: the agent's own instructions and tools,
  the replies as the model's tokens (mask 1), the tool results and the template's glue as prompt
  (mask 0). So the Sample is the chat template's render of the conversation the agent held.

Train on them with ``--loss-type sft_loss``. A reply is the recorded turn's text encoded again,
with the special tokens that ended it: the template's tokens of it, wherever the forcing cut.
The replay must end as the recording did: an agent that makes more calls than were recorded
(``script_exhausted``), or whose reward on the replay is below a pass, gives a failed Sample, and
a task whose prompt has no recorded success gives one too; nothing of a failed Sample is trained.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from inverted.buffer.archive import BufferArchive
from inverted.plugins import RolloutContext
from inverted.types import Sample, Task, reward_number
from rollout_functions.agent import play_envs
from rollout_functions.episodes import failed_sample

PASS = 1.0  # a reward that reaches it is a success, as evaluation's pass_rate counts one
Script = list[list[int]]  # one recorded episode's replies, token ids each


def prompt_key(prompt: str | list[dict[str, Any]]) -> bytes:
    return orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS)


def succeeded(sample: Sample, reward_key: str | None) -> bool:
    """An episode of the agent's own model that ended and reached a pass."""
    reward = reward_number(sample.reward, reward_key)
    return (
        sample.status == Sample.Status.COMPLETED
        and bool(sample.metadata.get("turns"))
        and not sample.metadata.get("side_call")
        and reward is not None
        and reward >= PASS
    )


def replies(sample: Sample, tokenizer: Any, special: frozenset[int]) -> Script:
    """Each turn's reply as the template writes it: the forced opening the proxy wrote (``forced`` on
    the turn) and the sampled text, encoded as one, then the special tokens that ended the turn."""
    script = []
    for turn in sample.metadata["turns"]:
        ids = sample.tokens[turn["start"] : turn["end"]]
        body = len(ids)
        while body and ids[body - 1] in special:
            body -= 1
        text = turn.get("forced", "") + tokenizer.decode(ids[:body])
        script.append(tokenizer.encode(text, add_special_tokens=False) + ids[body:])
    return script


@dataclass(slots=True)
class Recorded:
    """The successful episodes of one run, by prompt, as scripts."""

    by_prompt: dict[bytes, list[Script]]
    episodes: int  # every stored episode read, successful or not

    def pick(self, task: Task) -> Script | None:
        """A success of the task's prompt: a group's tasks take different ones while there are enough."""
        found = self.by_prompt.get(prompt_key(task.prompt))
        return found[task.index % len(found)] if found else None


def database(path: str) -> Path:
    where = Path(path)
    return where / "buffer.db" if where.is_dir() else where


@functools.cache
def read_recorded(path: str, checkpoint: str, chat_template: str | None, reward_key: str | None) -> Recorded:
    """The run's successes, read once per job (its buffer is finished: it does not change)."""
    from inverted.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint, chat_template)
    special = frozenset(tokenizer.all_special_ids)
    archive = BufferArchive(database(path))
    try:
        rows = archive.episodes()
    finally:
        archive.close()
    by_prompt: dict[bytes, list[Script]] = {}
    for record, blob in rows:
        sample = Sample.from_json(orjson.loads(blob))
        if succeeded(sample, reward_key):
            key = prompt_key(orjson.loads(record)["prompt"])
            by_prompt.setdefault(key, []).append(replies(sample, tokenizer, special))
    return Recorded(by_prompt, len(rows))


async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
    reward_key = ctx.flags.get("reward_key")
    recorded = await asyncio.to_thread(
        read_recorded, ctx.config.bootstrap_from, ctx.hf_checkpoint, ctx.chat_template, reward_key
    )
    scripts = [recorded.pick(task) for task in tasks]
    playable = [i for i, script in enumerate(scripts) if script is not None]
    played = await play_envs(ctx, [tasks[i] for i in playable], [scripts[i] for i in playable])
    samples = [
        failed_sample(task, f"--bootstrap-from {ctx.config.bootstrap_from} holds no successful episode of this prompt")
        for task in tasks
    ]
    for i, sample in zip(playable, played):
        reward = reward_number(sample.reward, reward_key)
        if sample.status != Sample.Status.FAILED and (reward is None or reward < PASS):
            sample.status = Sample.Status.FAILED
            sample.metadata["error"] = (
                f"the replayed episode scored {reward}, below a pass: the agent did not end as the recorded one did"
            )
        samples[i] = sample
    return samples


generate_rollout.requires = ("env_path", "bootstrap_from")  # checked by the job before anything starts
