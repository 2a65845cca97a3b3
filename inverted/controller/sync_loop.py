"""The synchronous loop: each step rolls out one batch, trains on it, and syncs the weights.

One step (``SyncLoop.step``):

1. **lease** ``--rollout-batch-size`` prompts x ``--n-samples-per-prompt`` tasks from the buffer;
2. **rollout**: the rollout function turns them into Samples (by default, environment episodes
   through the token-recording proxy), and they are submitted to the buffer, which stores them;
3. **batch**: the buffer serves the complete groups (failed or filtered groups are never served).
   While it holds fewer than ``--rollout-batch-size`` that its filters keep, the step leases and
   rolls out another round, up to ``--max-sampling-rounds`` (DAPO's dynamic sampling: a group whose
   rewards are all equal teaches nothing, so the batch is refilled instead of shrinking); after
   the last round it serves what there is. Groups kept beyond the batch wait for the next step;
4. **train** on them, then, every ``--update-weights-interval`` steps, **sync** the new weights
   into every rollout server, stamped with the next weight version.

With ``--colocate`` the servers release their memory while the trainer trains. With
``--debug-rollout-only`` there is no trainer: the step ends after the batch (saved with
``--save-debug-rollout-data``).

Each step's batch is asked for by its step (``job.batch_name``). A job killed after the checkpoint
it resumes from loses the training of the steps it made since, but not their batches: the resumed
job's steps find the batches the dead one was served for them (``BufferClient.served_batch``) and
train those, without a rollout, until a step finds none. So a served group is trained exactly once.
"""

from __future__ import annotations

import logging
import time

from inverted.buffer.client import Batch
from inverted.config import JobConfig
from inverted.controller.job import Job, Plugins, batch_name
from inverted.controller.rollouts import context, run_rollout, step_row, sync_when_due, take_batch
from inverted.errors import ServiceUnavailable
from inverted.types import Sample

logger = logging.getLogger(__name__)


class SyncLoop:
    def __init__(self, cfg: JobConfig, job: Job, plugins: Plugins, start: int = 0):
        self.cfg, self.job, self.plugins = cfg, job, plugins
        self.replaying = start > 0  # a resumed run: its first steps may have been served before it died

    async def __aenter__(self) -> "SyncLoop":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def step(self, rollout_id: int) -> dict[str, float]:
        """One turn of the sync loop; its metrics row."""
        cfg, job = self.cfg, self.job
        clock = {"started": time.perf_counter()}
        if self.replaying:
            served = await job.buffer.served_batch(batch_name(rollout_id))
            self.replaying = served is not None
            if served is not None:
                logger.warning("rollout %d: training the batch the killed run was served for this step (%d groups), "
                               "whose training the checkpoint does not hold", rollout_id, len(served.groups))
                clock["batched"] = time.perf_counter()
                metrics = take_batch(cfg, self.plugins, rollout_id, served.samples, served.samples, 0.0)
                return await self._train(rollout_id, served, metrics, clock)
        samples, batch, rounds = await self._roll_out(rollout_id, clock)
        metrics = take_batch(cfg, self.plugins, rollout_id, samples, batch.samples, clock["rolled_out"] - clock["leased"])
        metrics["rollout/sampling_rounds"] = float(rounds)
        failed = [s for s in samples if s.status == Sample.Status.FAILED]
        if failed:
            logger.warning("rollout %d: %d of %d episodes failed (never trained on); the first: %s", rollout_id,
                           len(failed), len(samples), failed[0].metadata.get("error", "?"))
        if lost := sum(s.status == Sample.Status.ABORTED for s in samples):
            logger.warning("rollout %d: %d episodes lost their proxy session; their tasks are played again", rollout_id,
                           lost)
        return await self._train(rollout_id, batch, metrics, clock)

    async def _roll_out(self, rollout_id: int, clock: dict[str, float]) -> tuple[list[Sample], Batch, int]:
        """Lease, roll out and submit rounds of tasks until the buffer serves a full batch (or the last
        round's partial one); every Sample played, the batch, and the rounds it took."""
        cfg, job = self.cfg, self.job
        samples: list[Sample] = []
        rounds = cfg.rollout.max_sampling_rounds
        for round_ in range(1, rounds + 1):
            tasks = await job.buffer.lease(cfg.rollout.rollout_batch_size * cfg.buffer.n_samples_per_prompt,
                                           job.worker_id, cfg.buffer.lease_seconds)
            if not tasks and not samples:
                raise ServiceUnavailable("the buffer has no more tasks to lease (the dataset is exhausted: see "
                                         "--num-epoch)", url=job.buffer.base_url)
            clock.setdefault("leased", time.perf_counter())  # a later round's lease counts as rollout time
            if tasks:  # else the dataset ran out in a later round: serve what the earlier ones gave
                played = await run_rollout(context(cfg, job, self.plugins, rollout_id), self.plugins, tasks)
                await job.buffer.submit(list(zip(tasks, played)))
                samples += played
            clock["rolled_out"] = time.perf_counter()
            # Not partial before the last round: the buffer serves nothing until the batch is full.
            batch = await job.buffer.next_batch(
                num_groups=cfg.rollout.rollout_batch_size, current_weight_version=rollout_id,
                max_weight_staleness=cfg.loop.max_weight_staleness, allow_partial=round_ == rounds or not tasks,
                request_id=batch_name(rollout_id))
            clock["batched"] = time.perf_counter()
            if batch.groups or not tasks:
                break
        return samples, batch, round_

    async def _train(self, rollout_id: int, batch: Batch, metrics: dict[str, float],
                     clock: dict[str, float]) -> dict[str, float]:
        """Train on the batch and sync the weights when due; the step's row."""
        cfg, job = self.cfg, self.job
        if job.trainer is not None and batch.groups:
            if cfg.loop.colocate:
                await job.all_servers("release_memory_occupation")
            metrics |= await job.train(batch, rollout_id)
            if cfg.loop.colocate:
                await job.all_servers("resume_memory_occupation")
            clock["trained"] = time.perf_counter()
            metrics |= await sync_when_due(cfg.loop.update_weights_interval, job, rollout_id, clock)
        elif job.trainer is not None:  # every group failed or was filtered: nothing to learn, the weights stay
            logger.info("rollout %d: no group to train on; the policy stays at version %d", rollout_id, job.version)
            await job.skip(rollout_id)
        return await step_row(job, metrics, clock)
