"""The training loop, once for both modes: take a batch, train on it or skip, sync, log, evaluate, save.

Each step asks its ``BatchSource`` for a batch (``sources``: the sync source rolls it out, the
async one takes what its never-stopping producer finished; in a resumed job either first takes
the batches the killed run was served). Then it asks the ``Trainer`` (``trainer``: the one door
into the trainer group) to

- **train** on the batch (with ``--colocate`` the servers release their memory meanwhile), or,
  when every group failed or was filtered, **skip**: the trainer counts the step, the weights stay;
- **sync**: every ``--update-weights-interval`` steps, push the weights into every server as the
  next version (the step's number);

and **logs** the step's row (``metrics.jsonl``, TensorBoard, a console line): what the batch held,
how long each phase took, what the buffer set aside, the faults healed, the servers' version. Then,
when due, it **evaluates** (before the first step, every ``--eval-interval`` and after the last) and
**saves** a checkpoint (every ``--save-interval`` and at the end; or, every
``--restart-save-interval``, the trainer's own state for a restart, written during the next rollout).

After the last step the trainer exports the policy as a Hugging Face model (``OUTPUT_DIR/hf``).
With ``--debug-rollout-only`` there is no trainer: a step ends after its batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from inverted.buffer.client import BatchRef
from inverted.controller.config import JobConfig
from inverted.controller.evaluation import evaluate
from inverted.controller.job import Job
from inverted.controller.sources import AsyncSource, BatchSource, Clock, SyncSource
from inverted.controller.trainer import Trainer
from inverted.metrics import MetricsSink
from inverted.plugins import Plugins

logger = logging.getLogger(__name__)


def due(done: int, every: int) -> bool:
    """Is something done every ``every`` steps (0: never) due after ``done`` steps?"""
    return bool(every) and done % every == 0


async def train(cfg: JobConfig, job: Job, plugins: Plugins, sink: MetricsSink, run_dir: Path) -> None:
    """Step after step until ``--num-rollout``; then the final export."""
    from tqdm import tqdm

    trainer, last = job.trainer, cfg.train.num_rollout
    start = trainer.step if trainer is not None else 0
    if trainer is not None and (start or job.lora):  # resumed: the servers get its weights; LoRA: its adapter
        await trainer.sync(start)
    source: BatchSource = (
        AsyncSource(cfg, job, plugins, start) if cfg.loop.async_mode else SyncSource(cfg, job, plugins)
    )
    if cfg.rollout.eval_interval and start == 0:  # the starting policy, so that every later figure has its baseline
        await evaluation_row(cfg, job, plugins, sink, 0)
    async with source:
        for step in tqdm(range(start, last), desc="rollout", initial=start, total=last, dynamic_ncols=True):
            clock: Clock = {"started": time.perf_counter()}
            batch, metrics = await source.next_batch(step, clock)
            if trainer is not None:
                metrics |= await train_step(cfg, trainer, batch, step, clock)
            source.trained(step)
            row = metrics | phase_times(clock) | await job_metrics(job)
            sink.log(row, step)
            logger.info("rollout %d: %s", step, summary(row))
            done = step + 1
            if cfg.rollout.eval_interval and (done == last or due(done, cfg.rollout.eval_interval)):
                await evaluation_row(cfg, job, plugins, sink, done)
            if trainer is not None and (done == last or due(done, cfg.train.ckpt.save_interval)):
                await trainer.save()
            elif trainer is not None and due(done, cfg.train.ckpt.restart_save_interval):
                await trainer.save_for_restart()
    if trainer is not None and start < last:
        logger.info("final policy exported to %s", await trainer.finish(str(run_dir / "hf")))


async def train_step(cfg: JobConfig, trainer: Trainer, batch: BatchRef, step: int, clock: Clock) -> dict[str, float]:
    """Train on the batch (or skip a step with nothing to learn), then sync the weights when due."""
    if not batch.sizes:  # every group failed or was filtered: nothing to learn, the weights stay
        logger.info("rollout %d: no group to train on; the policy stays at version %d", step, trainer.version)
        await trainer.skip(step)
        return {}
    metrics = await trainer.train(batch, step)
    clock["trained"] = time.perf_counter()
    if due(step + 1, cfg.loop.update_weights_interval):
        metrics |= await trainer.sync(step + 1)
        clock["synced"] = time.perf_counter()
    return metrics


async def evaluation_row(cfg: JobConfig, job: Job, plugins: Plugins, sink: MetricsSink, updates: int) -> None:
    """Evaluate the policy after ``updates`` training steps; its row's step is that count, so step 0
    is the starting policy and an evaluation's step is the rollout its policy would serve next."""
    metrics = await evaluate(cfg, job, plugins, updates)
    sink.log(metrics | {"weight_version": float(job.version)}, updates)
    logger.info("evaluation after %d updates: %s", updates, summary(metrics))


# -- the step's row --------------------------------------------------------------------------


def phase_times(clock: Clock) -> dict[str, float]:
    """Seconds per phase of one step (a phase that did not happen is absent)."""
    marks = list(clock.items())
    names = {
        "leased": "lease",
        "rolled_out": "rollout",
        "batched": "buffer",
        "waited": "wait",
        "trained": "train",
        "synced": "sync",
    }
    times = {f"time/{names[name]}_s": at - before for (_, before), (name, at) in zip(marks, marks[1:])}
    times["time/step_s"] = marks[-1][1] - marks[0][1]
    return times


async def job_metrics(job: Job) -> dict[str, float]:
    """The job's running totals at the end of a step: what the buffer set aside and why (nothing leaves it
    uncounted), the faults healed, and the version the servers hold."""
    stats = await job.buffer.stats()
    counters = stats["counters"]
    names = (
        "groups_filtered",
        "groups_failed",
        "groups_dropped_stale",
        "groups_retried_stale",
        "samples_requeued_partial",
        "samples_requeued_aborted",
        "leases_expired",
        "leases_released",
    )
    return (
        {f"buffer/{name}": float(counters.get(name, 0)) for name in names}
        | {"buffer/groups_waiting": float(stats["groups"]["complete"])}
        | job.supervisor.metrics()
        | {"weight_version": float(job.version)}
    )


def summary(metrics: dict[str, float]) -> str:
    """A row's console line: the figures a user watches, and each evaluation variant's."""
    shown = {
        "reward": "rollout/reward_mean",
        "loss": "train/loss",
        "eval": "eval/reward_mean",
        "pass": "eval/pass_rate",
        "tool_calls": "eval/tool_call_rate",
        "version": "weight_version",
        "staleness": "async/staleness_mean",
        "step_s": "time/step_s",
        "rollout_s": "time/rollout_s",
        "wait_s": "time/wait_s",
        "train_s": "time/train_s",
        "sync_s": "time/sync_s",
    }
    variants = {
        f"{key.split('/')[1]} {what}": key
        for key in metrics
        if key.count("/") == 2
        for what, end in (("pass", "/pass_rate"), ("tool_calls", "/tool_call_rate"))
        if key.endswith(end)
    }
    return ", ".join(f"{name} {metrics[key]:.4g}" for name, key in (shown | variants).items() if key in metrics)
