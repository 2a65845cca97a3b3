"""The asynchronous loop (``--async-mode``): rollout never stops, training never waits for a straggler.

Two things run at once:

- **The producer** keeps episodes going. Whenever there is room it leases one group's tasks
  (``--n-samples-per-prompt``), runs the rollout function on them in its own task, and submits
  the Samples to the buffer the moment the group is done, so a slow episode holds up only its own
  group. At most ``--rollout-concurrency`` episodes run at once.
- **Each step** takes the next ``--rollout-batch-size`` complete groups the buffer can serve
  within ``--max-weight-staleness`` of the policy being trained (long-polling until there are
  enough), trains on them, and every ``--update-weights-interval`` steps pushes the new weights
  into the servers *while episodes run*: the servers pause (``--pause-mode``), swap weights, and
  go on, so a turn in flight continues under the new weights and its tokens carry both versions
  (with ``--partial-rollout`` an aborted call resumes from its tokens too).

Staleness is bounded twice. The producer starts a group only while every group it has started
could still be trained within the bound if groups finish in order (AReaL's rule): groups started
but not yet trained stay below ``(versions synced + staleness + 1) x batch size - groups trained``.
Groups that finish late anyway, because their episodes are long, are set aside by the buffer at
batch time (``--stale-policy drop``, or ``retry``: recycled, counted either way). So
``--max-weight-staleness 0`` is on-policy training with overlapped rollout, and ``1`` is
one-step-off-policy training; both are this same code.
"""

from __future__ import annotations

import asyncio
import logging
import time

from inverted.config import JobConfig
from inverted.controller.job import Job, Plugins, batch_name
from inverted.controller.rollouts import context, run_rollout, step_row, sync_when_due, take_batch
from inverted.errors import ServiceUnavailable
from inverted.types import Sample, Task

logger = logging.getLogger(__name__)

POLL_S = 2.0  # longest wait for a batch before looking at the producer again


class AsyncLoop:
    def __init__(self, cfg: JobConfig, job: Job, plugins: Plugins, start: int):
        self.cfg, self.job, self.plugins = cfg, job, plugins
        rollout = cfg.rollout
        self.group_size = cfg.buffer.n_samples_per_prompt
        self.batch_groups = rollout.rollout_batch_size
        self.staleness = cfg.loop.max_weight_staleness
        self.max_groups_running = max(1, rollout.rollout_concurrency // self.group_size)
        self.first_version = job.version
        self.step_id = start
        self.steps = 0  # batches taken by this loop
        self.running: set[asyncio.Task] = set()
        self.finished: list[Sample] = []  # Samples submitted since the last step took its batch
        self.exhausted = False  # the buffer has no task left to lease
        self.error: BaseException | None = None
        self.wake = asyncio.Event()

    async def __aenter__(self) -> "AsyncLoop":
        self.producer = asyncio.create_task(self._produce())
        self.producer.add_done_callback(self._note_failure)
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Episodes still running are cut short; the job gives their tasks back to the buffer.
        tasks = [self.producer, *self.running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the producer --------------------------------------------------------------------------

    async def _produce(self) -> None:
        while True:
            self.wake.clear()
            while len(self.running) < self.max_groups_running and not self.exhausted and await self._room():
                tasks = await self.job.buffer.lease(self.group_size, self.job.worker_id, self.cfg.buffer.lease_seconds)
                if not tasks:
                    self.exhausted = True
                    break
                group = asyncio.create_task(self._run_group(tasks))
                self.running.add(group)
                group.add_done_callback(self._group_done)
            try:
                # Not wait_for: on Python 3.11 it can swallow a cancellation that arrives as the event
                # is set (a group ending as the loop stops), and the producer would then run forever.
                async with asyncio.timeout(0.5):
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def _room(self) -> bool:
        """May one more group start without being bound to exceed the staleness bound?"""
        versions = self.job.version - self.first_version
        waiting = (await self.job.buffer.stats())["groups"]["complete"]
        started_untrained = len(self.running) + waiting
        return started_untrained + 1 <= (versions + self.staleness + 1 - self.steps) * self.batch_groups

    async def _run_group(self, tasks: list[Task]) -> None:
        ctx = context(self.cfg, self.job, self.plugins, self.step_id)
        samples = await run_rollout(ctx, self.plugins, tasks)
        await self.job.buffer.submit(list(zip(tasks, samples)))
        self.finished += samples

    def _group_done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        self._note_failure(task)
        self.wake.set()

    def _note_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()

    # -- one training step ---------------------------------------------------------------------

    async def _next_batch(self, rollout_id: int):
        while True:
            if self.error is not None:
                raise self.error
            # Named by its step: a job killed after the buffer served this batch, and resumed from an
            # earlier checkpoint, trains this step on the same groups instead of losing them.
            batch = await self.job.buffer.next_batch(num_groups=self.batch_groups, current_weight_version=rollout_id,
                                                     max_weight_staleness=self.staleness, timeout_s=POLL_S,
                                                     request_id=batch_name(rollout_id))
            if batch.groups:
                return batch
            if self.exhausted and not self.running:
                raise ServiceUnavailable("the buffer has no more tasks to lease and too few complete groups for a "
                                         "batch (the dataset is exhausted: see --num-epoch)", url=self.job.buffer.base_url)

    async def step(self, rollout_id: int) -> dict[str, float]:
        cfg, job = self.cfg, self.job
        self.step_id = rollout_id
        clock = {"started": time.perf_counter()}
        batch = await self._next_batch(rollout_id)
        clock["waited"] = time.perf_counter()
        self.steps += 1
        finished, self.finished = self.finished, []
        metrics = take_batch(cfg, self.plugins, rollout_id, finished, batch.samples, clock["waited"] - clock["started"]) | {
            "async/staleness_mean": sum(batch.staleness) / len(batch.staleness),
            "async/staleness_max": float(max(batch.staleness)), "async/groups_running": float(len(self.running))}
        metrics |= await job.train(batch, rollout_id)
        clock["trained"] = time.perf_counter()
        metrics |= await sync_when_due(cfg.loop.update_weights_interval, job, rollout_id, clock)
        self.wake.set()  # a step taken and (maybe) a new version: room for more groups
        return await step_row(job, metrics, clock)
