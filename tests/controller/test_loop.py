"""The training loop and its batch sources, driven against a real buffer service over HTTP.

The job around the loop is a recording stand-in (no Ray, no servers): what is under test is the
recipe (what a step does, in which order, when syncs, saves and evaluations are due, which batch a
resumed step trains) and the sources (rounds, the staleness rule), not the parts the job starts;
the whole-job tests in ``tests/job`` run those.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from inverted.buffer.client import BatchRef, BufferClient
from inverted.config import add_flags, build_section
from inverted.controller.config import JobConfig
from inverted.controller.ledger import Ledger
from inverted.controller.loop import train
from inverted.controller.sources import Admission
from inverted.metrics import build_metrics_sink
from inverted.plugins import Plugins, RolloutContext
from inverted.types import Sample, Task

pytestmark = pytest.mark.anyio


def config(tmp_path: Path, *flags: str) -> JobConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"What is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(40))
    )
    (tmp_path / "run").mkdir(exist_ok=True)
    parser = argparse.ArgumentParser()
    add_flags(parser, JobConfig)
    return build_section(
        JobConfig,
        parser.parse_args(
            [
                "--hf-checkpoint",
                str(tmp_path),
                "--prompt-data",
                str(data),
                "--output-dir",
                str(tmp_path / "run"),
                "--rollout-batch-size",
                "2",
                "--n-samples-per-prompt",
                "2",
                *flags,
            ]
        ),
    )


class RecordingTrainer:
    """Records what the loop asks of the trainer, the servers' version kept as the real one keeps it;
    ``dies_at``: the step whose training raises."""

    def __init__(self, ledger: Ledger, step: int = 0, dies_at: int | None = None, train_s: float = 0.0):
        self.ledger, self.step, self.dies_at, self.train_s = ledger, step, dies_at, train_s
        self.calls: list[tuple] = []
        self.removed: list[frozenset[int]] = []  # each trained batch's filtered Samples, as the ranks get them
        self.weight_version = "default"

    @property
    def version(self) -> int:
        return 0 if self.weight_version == "default" else int(self.weight_version)

    async def sync(self, version: int) -> dict[str, float]:
        self.calls.append(("sync", version))
        self.weight_version = str(version)
        return {"sync/gb_per_s": 1.0}

    async def train(self, batch: BatchRef, step: int) -> dict[str, float]:
        if step == self.dies_at:
            raise RuntimeError("the trainer died")
        await asyncio.sleep(self.train_s)
        self.calls.append(("train", step, batch.batch_id))
        self.removed.append(batch.removed)
        self.step = step + 1
        await self.ledger.trained(batch, step)
        return {"train/loss": 0.5}

    async def skip(self, step: int) -> None:
        self.calls.append(("skip", step))
        self.step = step + 1

    async def save(self) -> str:
        self.calls.append(("save", self.step))
        return "ckpt"

    async def save_for_restart(self) -> None:
        self.calls.append(("save_for_restart", self.step))

    async def finish(self, hf_out: str) -> str:
        self.calls.append(("finish", self.step))
        return hf_out


class Servers:
    router_url, config = "", type("Keys", (), {"router_api_key": None, "admin_api_key": None})()


class RecordingJob:
    """What the loop reads of ``controller.job.Job``."""

    def __init__(self, buffer: BufferClient, trainer_step: int = 0, dies_at: int | None = None, train_s: float = 0.0):
        self.buffer, self.ledger = buffer, Ledger(buffer)
        self.trainer = RecordingTrainer(self.ledger, trainer_step, dies_at, train_s)
        self.servers, self.worker_id, self.proxy_url, self.proxy_key = Servers(), "controller-test", "", None
        self.lora = self.adapter = None
        self.supervisor = type("Supervisor", (), {"metrics": staticmethod(lambda: {"faults/engine_deaths": 0.0})})()

    @property
    def weight_version(self) -> str:
        return self.trainer.weight_version

    @property
    def version(self) -> int:
        return self.trainer.version


class Rollouts:
    """A rollout function that plays nothing: each Sample is filled at once, rewards differing in a group.
    ``started``: the version the servers held when each group began, by its group index."""

    def __init__(self, job: RecordingJob | None = None, hold_s: float = 0.0):
        self.job, self.hold_s = job, hold_s
        self.calls: list[tuple[int, bool, int]] = []  # (rollout_id, evaluation, tasks)
        self.started: dict[int, int] = {}

    async def __call__(self, ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
        self.calls.append((ctx.rollout_id, ctx.evaluation, len(tasks)))
        for task in tasks:
            self.started[task.group_index] = self.job.version if self.job else 0
        await asyncio.sleep(self.hold_s)
        samples = []
        for task in tasks:
            sample = task.new_sample()
            sample.tokens, sample.response_length = [5, 6, 7, 8], 2
            sample.loss_mask, sample.rollout_log_probs = [1, 1], [-0.1, -0.2]
            sample.weight_versions = [ctx.weight_version] * 2
            sample.reward, sample.status = float(task.index % 2), Sample.Status.COMPLETED
            samples.append(sample)
        return samples


async def run_loop(cfg: JobConfig, job: RecordingJob, rollouts: Rollouts, **plugins: Any) -> list[dict]:
    sink = build_metrics_sink(cfg.train.output_dir)
    try:
        await train(cfg, job, Plugins(rollout=rollouts, **plugins), sink, Path(cfg.train.output_dir))
    finally:
        sink.close()
    return [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]


def started_buffer(procs, cfg: JobConfig):
    return procs.buffer(
        Path(cfg.train.output_dir) / "buffer.db",
        "--prompt-data",
        cfg.buffer.prompt_data,
        "--n-samples-per-prompt",
        str(cfg.buffer.n_samples_per_prompt),
    )


async def test_each_step_trains_its_batch_and_syncs_saves_and_evaluates_when_due(procs, tmp_path):
    cfg = config(
        tmp_path,
        "--num-rollout",
        "4",
        "--update-weights-interval",
        "2",
        "--save-interval",
        "3",
        "--restart-save-interval",
        "2",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        str(tmp_path / "prompts.jsonl"),
    )
    async with BufferClient(started_buffer(procs, cfg).url) as buffer:
        job = RecordingJob(buffer)
        rollouts = Rollouts()
        rows = await run_loop(cfg, job, rollouts)
        served = [await job.ledger.served(step) for step in range(4)]

    calls = job.trainer.calls
    assert calls == [
        ("train", 0, served[0].batch_id),
        ("train", 1, served[1].batch_id),
        ("sync", 2),
        ("save_for_restart", 2),
        ("train", 2, served[2].batch_id),
        ("save", 3),
        ("train", 3, served[3].batch_id),
        ("sync", 4),
        ("save", 4),
        ("finish", 4),
    ]
    assert all(batch.sizes == (2, 2) for batch in served)  # --rollout-batch-size groups a step
    training = [r for r in rows if "rollout/reward_mean" in r]
    evaluations = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in training] == [0, 1, 2, 3] and [r["weight_version"] for r in training] == [0, 2, 2, 4]
    assert [r["step"] for r in evaluations] == [0, 2, 4]  # before the first step, every 2, after the last
    assert all(r["rollout/trained_samples"] == 4 and r["train/loss"] == 0.5 for r in training)
    assert sum(evaluation for _, evaluation, _ in rollouts.calls) == 3


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_resumed_loop_trains_the_batches_its_killed_run_was_served_before_it_rolls_out_again(
    procs, tmp_path, mode
):
    cfg = config(
        tmp_path,
        "--num-rollout",
        "4",
        "--restart-save-interval",
        "0",
        *(["--async-mode", "--rollout-concurrency", "4"] if mode == "async" else []),
    )
    async with BufferClient(started_buffer(procs, cfg).url) as buffer:
        killed = RecordingJob(buffer, dies_at=2)
        with pytest.raises(RuntimeError, match="the trainer died"):
            await run_loop(cfg, killed, Rollouts(killed))
        assert [c[:2] for c in killed.trainer.calls] == [("train", 0), ("sync", 1), ("train", 1), ("sync", 2)]
        # resumed from a checkpoint saved before step 1: step 1's training is lost with the killed run
        # (the buffer takes it again for the same step, and would refuse it for another), step 2 was
        # served but never trained
        resumed = RecordingJob(buffer, trainer_step=1)
        rollouts = Rollouts(resumed)
        rows = await run_loop(cfg, resumed, rollouts)
        served = [await resumed.ledger.served(step) for step in range(4)]

    trains = [c for c in resumed.trainer.calls if c[0] == "train"]
    assert trains[:2] == [("train", 1, served[1].batch_id), ("train", 2, served[2].batch_id)]
    assert [c[1] for c in trains] == [1, 2, 3]
    assert resumed.trainer.calls[0] == ("sync", 1)  # the servers first get the checkpoint's weights
    assert [r["step"] for r in rows[-3:]] == [1, 2, 3]
    if mode == "sync":  # steps 1 and 2 were replayed without a rollout; only step 3 rolled out
        assert [rollout_id for rollout_id, _, _ in rollouts.calls] == [3]
    else:  # a replayed step's row says how stale its batch was, as any async step's does
        assert all(r["async/staleness_max"] <= 1 for r in rows[-3:])


async def test_a_step_whose_every_group_was_filtered_is_skipped_and_the_weights_stay(procs, tmp_path):
    cfg = config(tmp_path, "--num-rollout", "2", "--max-sampling-rounds", "2", "--restart-save-interval", "0")
    buffer_process = procs.buffer(
        Path(cfg.train.output_dir) / "buffer.db",
        "--prompt-data",
        cfg.buffer.prompt_data,
        "--n-samples-per-prompt",
        "2",
        "--dynamic-sampling-filter-path",
        "inverted.buffer.filters:drop_all_equal_rewards",
    )
    async with BufferClient(buffer_process.url) as buffer:
        job = RecordingJob(buffer)

        async def same_reward(ctx, tasks):  # every group's rewards equal: the filter keeps none
            samples = await Rollouts()(ctx, tasks)
            for sample in samples:
                sample.reward = 1.0
            return samples

        rows = await run_loop(cfg, job, same_reward)  # type: ignore[arg-type]

    assert job.trainer.calls == [("skip", 0), ("skip", 1), ("save", 2), ("finish", 2)]
    assert [r["rollout/sampling_rounds"] for r in rows] == [2, 2]  # DAPO: refilled, then the partial (empty) batch
    assert [r["weight_version"] for r in rows] == [0, 0]


async def test_the_async_source_at_staleness_0_trains_each_step_only_on_groups_its_own_policy_started(procs, tmp_path):
    cfg = config(
        tmp_path,
        "--num-rollout",
        "3",
        "--async-mode",
        "--max-weight-staleness",
        "0",
        "--rollout-concurrency",
        "16",
        "--restart-save-interval",
        "0",
    )
    async with BufferClient(started_buffer(procs, cfg).url) as buffer:
        job = RecordingJob(buffer, train_s=1.0)  # while a step trains, the producer must start nothing more
        rollouts = Rollouts(job, hold_s=0.05)
        rows = await run_loop(cfg, job, rollouts)
        served = [await job.ledger.samples(await job.ledger.served(step)) for step in range(3)]

    for step, samples in enumerate(served):  # on-policy: every group began under the weights of its step
        assert {rollouts.started[s.group_index] for s in samples} == {step}
    assert [r["async/staleness_max"] for r in rows] == [0, 0, 0]
    # the staleness rule started no group that could not be trained in time: none was set aside
    assert [sum(v == version for v in rollouts.started.values()) for version in range(3)] == [2, 2, 2]
    assert rows[-1]["buffer/groups_dropped_stale"] == 0
    assert [c[:2] for c in job.trainer.calls if c[0] in ("train", "sync")] == [
        ("train", 0),
        ("sync", 1),
        ("train", 1),
        ("sync", 2),
        ("train", 2),
        ("sync", 3),
    ]


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_admission_starts_a_group_only_while_every_group_started_can_still_be_trained_in_time(staleness):
    rule = Admission(batch_groups=4, staleness=staleness, max_running=100)
    budget = (staleness + 1) * 4  # groups that can start before the first sync
    assert rule.allows(running=budget - 1, waiting=0, versions=0, steps=0)
    assert not rule.allows(running=budget - 1, waiting=1, versions=0, steps=0)  # complete-but-untrained ones count
    # a step trained without a sync gives no room back: its groups' successors would be one version staler
    assert not rule.allows(running=budget - 4, waiting=0, versions=0, steps=1)
    assert rule.allows(running=budget - 4, waiting=0, versions=1, steps=1)  # the sync after it does


def test_admission_never_runs_more_groups_than_the_concurrency_allows():
    rule = Admission(batch_groups=8, staleness=4, max_running=3)
    assert rule.allows(running=2, waiting=0, versions=0, steps=0)
    assert not rule.allows(running=3, waiting=0, versions=0, steps=0)


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_driver_reads_a_batch_s_samples_only_for_a_plug_in_that_reads_them(procs, tmp_path, mode):
    """A step's batch passes from the buffer to the trainer by reference: the driver reads its Samples
    only where a plug-in of its own must see them (here ``--rollout-sample-filter-path``), and the
    filter's marks reach the trainer with the reference (positions in the batch's order)."""
    flags = ["--num-rollout", "2", "--restart-save-interval", "0"] + (["--async-mode"] if mode == "async" else [])
    cfg = config(tmp_path, *flags)
    reads: list[str] = []

    def count_reads(job: RecordingJob) -> None:
        read = job.ledger.samples

        async def samples(batch: BatchRef) -> list[Sample]:
            reads.append(batch.request_id)
            return await read(batch)

        job.ledger.samples = samples

    def drop_the_first_of_each_group(groups: list[list[Sample]]) -> None:
        for group in groups:
            group[0].remove_sample = True

    async with BufferClient(started_buffer(procs, cfg).url) as buffer:
        plain = RecordingJob(buffer)
        count_reads(plain)
        await run_loop(cfg, plain, Rollouts(plain))
    assert reads == [] and plain.trainer.removed == [frozenset(), frozenset()]

    (tmp_path / "filtered").mkdir()
    cfg = config(tmp_path / "filtered", *flags)
    async with BufferClient(started_buffer(procs, cfg).url) as buffer:
        filtered = RecordingJob(buffer)
        count_reads(filtered)
        await run_loop(cfg, filtered, Rollouts(filtered), sample_filter=drop_the_first_of_each_group)
        assert reads == ["batch:0", "batch:1"]  # once a step
        trained = [await filtered.ledger.samples(await filtered.ledger.served(step)) for step in range(2)]
    assert filtered.trainer.removed == [frozenset({0, 2}), frozenset({0, 2})]
    # replayed (a restarted trainer) as each step trained it: the filter's marks with the batch
    assert all([(s.index % 2, s.remove_sample) for s in samples] == [(0, True), (1, False)] * 2 for samples in trained)
