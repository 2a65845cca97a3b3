"""The training loop, once for both modes: take a batch, train on it or skip, sync, evaluate, save, log.

Each step asks its ``BatchSource`` for a batch (``sources``: the sync source rolls it out, the
async one takes what its never-stopping producer finished; in a resumed job either first takes
the batches the killed run was served). Then:

- **train** on the batch (with ``--colocate`` the servers release their memory meanwhile), or,
  when every group failed or was filtered, **skip**: the trainer counts the step, the weights stay;
- **sync**: every ``--update-weights-interval`` steps, push the weights into every server as the
  next version (the step's number);
- **log** the step's row (``metrics.jsonl``, TensorBoard, a console line);
- **evaluate** before the first step, every ``--eval-interval`` and after the last;
- **save** a checkpoint every ``--save-interval`` and at the end (or, every
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
from inverted.controller.evaluation import evaluate_and_log
from inverted.controller.job import Job
from inverted.controller.sources import AsyncSource, BatchSource, Clock, SyncSource
from inverted.controller.step_metrics import step_row, summary
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
        await job.sync_weights(start)
    source: BatchSource = (
        AsyncSource(cfg, job, plugins, start) if cfg.loop.async_mode else SyncSource(cfg, job, plugins)
    )
    if cfg.rollout.eval_interval and start == 0:  # the starting policy, so that every later figure has its baseline
        await evaluate_and_log(cfg, job, plugins, sink, 0)
    async with source:
        for step in tqdm(range(start, last), desc="rollout", initial=start, total=last, dynamic_ncols=True):
            clock: Clock = {"started": time.perf_counter()}
            batch, metrics = await source.next_batch(step, clock)
            if trainer is not None:
                metrics |= await train_step(cfg, job, batch, step, clock)
            source.trained(step)
            row = await step_row(job, metrics, clock)
            sink.log(row, step)
            logger.info("rollout %d: %s", step, summary(row))
            done = step + 1
            if cfg.rollout.eval_interval and (done == last or due(done, cfg.rollout.eval_interval)):
                await evaluate_and_log(cfg, job, plugins, sink, done)
            if trainer is not None and (done == last or due(done, cfg.train.ckpt.save_interval)):
                await trainer.save()
            elif trainer is not None and due(done, cfg.train.ckpt.restart_save_interval):
                await trainer.save_for_restart()
    if trainer is not None and start < last:
        logger.info("final policy exported to %s", await trainer.finish(str(run_dir / "hf")))


async def train_step(cfg: JobConfig, job: Job, batch: BatchRef, step: int, clock: Clock) -> dict[str, float]:
    """Train on the batch (or skip a step with nothing to learn), then sync the weights when due."""
    trainer = job.trainer
    assert trainer is not None
    if not batch.sizes:  # every group failed or was filtered: nothing to learn, the weights stay
        logger.info("rollout %d: no group to train on; the policy stays at version %d", step, job.version)
        await trainer.skip(step)
        return {}
    await job.servers.verify_workers()  # the router served only the job's own servers
    if cfg.loop.colocate:
        await job.release_memory()
    metrics = await trainer.train(batch, step)
    if cfg.loop.colocate:
        await job.resume_memory()
    clock["trained"] = time.perf_counter()
    if due(step + 1, cfg.loop.update_weights_interval):
        metrics |= await job.sync_weights(step + 1)
        clock["synced"] = time.perf_counter()
    return metrics
