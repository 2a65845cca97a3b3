"""A job's output directory, written by the real writers: the buffer's store, the trainer's details
writer, a metrics.jsonl, and a config.yaml that names a real tokenizer.

Its Samples are made to be told apart: rewards, lengths and statuses vary, some groups have equal
rewards, one episode is multi-turn (a tool result inside the response, mask 0) and branched (a
second branch forked after its first turn, stored as the first one's sibling), and one came with
no rollout log-probs. ``EXPECTED`` keeps
what was written, for the tests to recompute every answer from.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from inverted.buffer.datasets import PromptRecord
from inverted.buffer.store import SQLiteStore
from inverted.train.details import Detail, DetailsWriter
from inverted.types import Sample

N = 4  # samples per prompt
UNRECORDED = (11, 2)  # the Sample whose sampler recorded no log-probs (never trained here)


@dataclass
class Written:
    samples: list[Sample] = field(default_factory=list)  # every branch, siblings included
    steps: dict[tuple[int, int, int], int] = field(default_factory=dict)  # trained ones
    details: dict[tuple[int, int, int], Detail] = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)


def episode(task: dict, rng: random.Random, version: int, tokenizer) -> Sample:
    prompt = tokenizer.encode(f"question {task['group_index']} {task['index']}")
    n = rng.randint(1, 12)
    reward = float(rng.choice([0.0, 0.25, 1.0])) if task["group_index"] % 3 else 0.5  # every third group: all equal
    status = rng.choice([Sample.Status.COMPLETED] * 3 + [Sample.Status.TRUNCATED])
    return Sample(
        group_index=task["group_index"],
        index=task["index"],
        prompt=task["prompt"],
        tokens=prompt + [rng.randrange(10, 200) for _ in range(n)],
        response_length=n,
        loss_mask=[1] * n,
        rollout_log_probs=[-round(rng.random() * 6, 3) for _ in range(n)],
        weight_versions=[str(version)] * n,
        reward=reward,
        status=status,
        label=task["label"],
        session_id=f"sess_{task['group_index']}_{task['index']}",
    )


def multi_turn(base: Sample, tokenizer) -> Sample:
    """``base`` as a two-turn tool episode with a second branch that forks after the first turn."""
    prompt = base.tokens[: base.prompt_length]
    call = tokenizer.encode('<tool_call>{"name": "calculator"}</tool_call>')
    result = tokenizer.encode("<tool_response>42</tool_response>")
    answer = tokenizer.encode("the answer is 42")
    other = tokenizer.encode("no tool needed")

    def branch(index: int, tail: list[int], tail_mask: list[int], turns: list[dict]) -> Sample:
        response = call + tail
        return Sample(
            group_index=base.group_index,
            index=base.index,
            prompt=base.prompt,
            tokens=prompt + response,
            response_length=len(response),
            loss_mask=[1] * len(call) + tail_mask,
            rollout_log_probs=[-0.5 if m else 0.0 for m in [1] * len(call) + tail_mask],
            weight_versions=base.weight_versions[:1] * len(response),
            reward=1.0 if index == 0 else 0.0,
            status=Sample.Status.COMPLETED,
            label=base.label,
            session_id=base.session_id,
            metadata={"branch": index, "branches": 2, "turns": turns, "grader": {"parsed": "42", "right": index == 0}},
        )

    start = len(prompt)
    first = {
        "start": start,
        "end": start + len(call),
        "finish_reason": "tool_calls",
        "latency_s": 0.1,
        "model": "gpt-5.2",
        "accepted": {"reasoning_effort": "the chat template has no thinking mode"},
    }
    main = branch(
        0,
        result + answer,
        [0] * len(result) + [1] * len(answer),
        [
            first,
            {
                "start": start + len(call) + len(result),
                "end": start + len(call) + len(result) + len(answer),
                "finish_reason": "stop",
                "latency_s": 0.2,
            },
        ],
    )
    fork = branch(
        1,
        other,
        [1] * len(other),
        [
            first,
            {
                "start": start + len(call),
                "end": start + len(call) + len(other),
                "finish_reason": "stop",
                "latency_s": 0.2,
            },
        ],
    )
    main.metadata["siblings"] = [fork.to_json()]
    return main


def write_run(run: Path, tokenizer_dir: Path, *, groups: int = 12, trained_steps: int = 2, seed: int = 0) -> Written:
    """Write ``groups`` groups of ``N`` into ``run``; serve and train the first ``trained_steps``
    batches of 2 groups."""
    from inverted.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {"train": {"hf_checkpoint": str(tokenizer_dir), "reward_key": None}, "buffer": {"api_key": None}}
        )
    )
    prompts = [PromptRecord(prompt=f"question {i}", label=str(i)) for i in range(groups)]
    store = SQLiteStore(str(run / "buffer.db"), n_samples_per_prompt=N, prompts=prompts)
    written = Written()
    tasks = store.lease(groups * N, "worker", 600)
    submitted = []
    for task in tasks:
        sample = episode(task, rng, version=0, tokenizer=tokenizer)
        if (task["group_index"], task["index"]) == (1, 1):
            sample = multi_turn(sample, tokenizer)
        if (task["group_index"], task["index"]) == UNRECORDED:
            sample.rollout_log_probs = None  # a sampler that recorded none (a plug-in calling its server its own way)
        submitted.append((task["lease_id"], sample))
        written.samples.append(sample)
        for sibling in sample.metadata.get("siblings", []):
            written.samples.append(Sample.from_json(sibling))
    store.submit(submitted)
    details = DetailsWriter(run)
    for step in range(trained_steps):
        batch = json.loads(store.next_batch(2, step, None))
        rows = []
        for group in batch["groups"]:
            for data in group:
                for sample in [Sample.from_json({k: v for k, v in data.items()})] + [
                    Sample.from_json(s) for s in data["metadata"].get("siblings", [])
                ]:
                    key = (sample.group_index, sample.index, int(sample.metadata.get("branch", 0)))
                    rollout = np.asarray(sample.rollout_log_probs, dtype=np.float32)
                    logp = rollout + np.asarray([rng.uniform(-0.3, 0.3) for _ in rollout], dtype=np.float32)
                    adv = np.full(len(rollout), rng.uniform(-1, 1), dtype=np.float32)
                    mask = np.asarray(sample.loss_mask)
                    on = mask.astype(bool)
                    detail = Detail(
                        *key, step, float(np.abs(logp[on] - rollout[on]).mean()), float(adv[on].mean()), logp, adv
                    )
                    rows.append(detail)
                    written.details[key] = detail
                    written.steps[key] = step
        details.write(rows)
    details.close()
    store.close()
    with (run / "metrics.jsonl").open("w") as file:
        for step in range(trained_steps):
            row = {
                "step": step,
                "rollout/reward_mean": 0.1 * step + 0.2,
                "time/rollout_s": 2.0 + step,
                "time/train_s": 1.0,
                "time/sync_s": 0.1,
                "time/step_s": 3.2 + step,
                "rollout/response_tokens": 100.0,
                "perf/train_tokens_per_s": 50.0,
                "train/train_rollout_logprob_abs_diff": 0.01 * (step + 1),
                "weight_version": float(step + 1),
            }
            written.metrics.append(row)
            file.write(json.dumps(row) + "\n")
    return written
