"""Where each step's batch comes from: the two loop modes are two batch sources behind one interface.

``SyncSource`` (the default): each step rolls out its own batch, then the loop trains on it.

1. **lease** ``--rollout-batch-size`` prompts x ``--n-samples-per-prompt`` tasks from the buffer;
2. **rollout**: the rollout function turns them into Samples (by default, environment episodes
   through the token-recording proxy), and they are submitted to the buffer, which stores them;
3. **batch**: the buffer serves the complete groups (failed or filtered groups are never served).
   While it holds fewer than ``--rollout-batch-size`` that its filters keep, the step leases and
   rolls out another round, up to ``--max-sampling-rounds`` (DAPO's dynamic sampling: a group whose
   rewards are all equal teaches nothing, so the batch is refilled instead of shrinking); after
   the last round it serves what there is. Groups kept beyond the batch wait for the next step.

``AsyncSource`` (``--async-mode``): rollout never stops, training never waits for a straggler. A
producer keeps episodes going: whenever ``Admission`` allows it, it leases one group's tasks
(``--n-samples-per-prompt``), runs the rollout function on them in its own task, and submits the
Samples the moment the group is done, so a slow episode holds up only its own group; at most
``--rollout-concurrency`` episodes run at once. Each step takes the next ``--rollout-batch-size``
complete groups the buffer can serve within ``--max-weight-staleness`` of the policy being trained
(long-polling until there are enough). Weight syncs happen *while episodes run*: the servers pause
(``--pause-mode``), swap weights, and go on, so a turn in flight continues under the new weights
and its tokens carry both versions (with ``--partial-rollout`` an aborted call resumes from its
tokens too).

Staleness is bounded twice: ``Admission`` starts a group only while it could still be trained in
time, and groups that finish late anyway are set aside by the buffer at batch time (``--stale-policy
drop``, or ``retry``: recycled, counted either way). So ``--max-weight-staleness 0`` is on-policy
training with overlapped rollout, and ``1`` is one-step-off-policy training; both are this code.

Either source asks the ledger for step ``s``'s batch under the step's name, so a batch the buffer
served is found again by a resumed job or a restarted trainer (``controller.ledger``): a resumed
job's first steps take the batches its killed run was served for them, without a rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

from inverted.buffer.client import BatchRef
from inverted.controller.batches import prepare_batch
from inverted.controller.config import JobConfig
from inverted.controller.job import Job
from inverted.controller.rollouts import by_task, context, run_rollout
from inverted.errors import ServiceUnavailable
from inverted.plugins import Plugins
from inverted.types import Sample, Task

logger = logging.getLogger(__name__)

POLL_S = 2.0  # the async source's longest wait for a batch before looking at its producer again
Clock = dict[str, float]  # the moments a step reached each phase, in order (``loop.phase_times``)


class BatchSource(Protocol):
    """``async with`` it around the steps; each step asks it for its batch and the batch's metrics
    (the step's phases marked on ``clock``), and tells it when the step has trained (and synced)."""

    async def __aenter__(self) -> BatchSource: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def next_batch(self, step: int, clock: Clock) -> tuple[BatchRef, dict[str, float]]: ...

    def trained(self, step: int) -> None: ...


class SyncSource:
    def __init__(self, cfg: JobConfig, job: Job, plugins: Plugins):
        self.cfg, self.job, self.plugins = cfg, job, plugins

    async def __aenter__(self) -> SyncSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def next_batch(self, step: int, clock: Clock) -> tuple[BatchRef, dict[str, float]]:
        """Lease, roll out and submit rounds of tasks until the buffer serves a full batch (or the last
        round's partial one)."""
        cfg, job = self.cfg, self.job
        if (replay := await job.ledger.replay(step)) is not None:
            return await replayed(cfg, job, self.plugins, step, replay, clock)
        samples: list[Sample] = []
        rounds = cfg.rollout.max_sampling_rounds
        for round_ in range(1, rounds + 1):
            tasks = await job.buffer.lease(
                cfg.rollout.rollout_batch_size * cfg.buffer.n_samples_per_prompt,
                job.worker_id,
                cfg.buffer.lease_seconds,
            )
            if not tasks and not samples:
                raise ServiceUnavailable(
                    "the buffer has no more tasks to lease (the dataset is exhausted: see --num-epoch)",
                    url=job.buffer.base_url,
                )
            clock.setdefault("leased", time.perf_counter())  # a later round's lease counts as rollout time
            if tasks:  # else the dataset ran out in a later round: serve what the earlier ones gave
                played = await run_rollout(context(cfg, job, self.plugins, step), self.plugins, tasks)
                await job.buffer.submit(by_task(tasks, played))
                samples += played
            clock["rolled_out"] = time.perf_counter()
            # Not partial before the last round: the buffer serves nothing until the batch is full.
            batch = await job.ledger.serve(
                step,
                num_groups=cfg.rollout.rollout_batch_size,
                max_weight_staleness=cfg.loop.max_weight_staleness,
                allow_partial=round_ == rounds or not tasks,
            )
            clock["batched"] = time.perf_counter()
            if batch.sizes or not tasks:
                break
        self._warn(step, samples)
        batch, metrics = await prepare_batch(
            cfg, job, self.plugins, step, samples, batch, clock["rolled_out"] - clock["leased"]
        )
        return batch, metrics | {"rollout/sampling_rounds": float(round_)}

    def trained(self, step: int) -> None:
        pass

    @staticmethod
    def _warn(step: int, samples: list[Sample]) -> None:
        failed = [s for s in samples if s.status == Sample.Status.FAILED]
        if failed:
            logger.warning(
                "rollout %d: %d of %d episodes failed (never trained on); the first: %s",
                step,
                len(failed),
                len(samples),
                failed[0].metadata.get("error", "?"),
            )
        if lost := sum(s.status == Sample.Status.ABORTED for s in samples):
            logger.warning("rollout %d: %d episodes lost their proxy session; their tasks are played again", step, lost)


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """AReaL's staleness rule: may one more group start, if groups finish in the order they start?

    Every group started must still be trainable within ``staleness`` versions of the policy that
    started it: groups started but not yet trained stay below ``(versions synced + staleness + 1) x
    batch_groups - groups taken for training``, and at most ``max_running`` run at once.
    """

    batch_groups: int
    staleness: int
    max_running: int

    def allows(self, *, running: int, waiting: int, versions: int, steps: int) -> bool:
        """``running``: groups under way; ``waiting``: complete in the buffer, not yet trained;
        ``versions``: weight syncs since the source started; ``steps``: batches taken since."""
        return (
            running < self.max_running
            and running + waiting + 1 <= (versions + self.staleness + 1 - steps) * self.batch_groups
        )


async def replayed(
    cfg: JobConfig, job: Job, plugins: Plugins, step: int, batch: BatchRef, clock: Clock
) -> tuple[BatchRef, dict[str, float]]:
    """A batch a killed run was served for ``step``, prepared as a step's batch: measured as the Samples
    played for it (none were played now), so the driver reads them."""
    logger.warning(
        "rollout %d: training the batch the killed run was served for this step (%d groups), "
        "whose training the checkpoint does not hold",
        step,
        len(batch.sizes),
    )
    clock["batched"] = time.perf_counter()
    played = await job.ledger.samples(batch)
    return await prepare_batch(cfg, job, plugins, step, played, batch, 0.0)


class AsyncSource:
    def __init__(self, cfg: JobConfig, job: Job, plugins: Plugins, start: int):
        self.cfg, self.job, self.plugins = cfg, job, plugins
        self.group_size = cfg.buffer.n_samples_per_prompt
        staleness = cfg.loop.max_weight_staleness
        assert staleness is not None  # LoopConfig gives --async-mode a bound
        self.admission = Admission(
            cfg.rollout.rollout_batch_size,
            staleness,
            max_running=max(1, cfg.rollout.rollout_concurrency // self.group_size),
        )
        self.first_version = job.version
        self.step = start  # the step whose rollout context new groups get
        self.replays = 0  # batches a killed run was served, taken again since the source started
        self.consumed_at_start = 0  # the buffer's consumed groups when the source started
        self.running: set[asyncio.Task[None]] = set()
        self.finished: list[Sample] = []  # Samples submitted since the last step took its batch
        self.exhausted = False  # the buffer has no task left to lease
        self.error: BaseException | None = None
        self.wake = asyncio.Event()

    async def __aenter__(self) -> AsyncSource:
        self.consumed_at_start = (await self.job.buffer.stats())["groups"]["consumed"]
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
            while not self.exhausted and await self._room():
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
        if len(self.running) >= self.admission.max_running:  # the rule's cheap half: no buffer call
            return False
        # Groups waiting and batches taken, from one snapshot of the buffer: a batch is taken when the
        # buffer consumes its groups, before its answer reaches this process (full batches only here).
        groups = (await self.job.buffer.stats())["groups"]
        taken = self.replays + (groups["consumed"] - self.consumed_at_start) // self.admission.batch_groups
        return self.admission.allows(
            running=len(self.running),
            waiting=groups["complete"],
            versions=self.job.version - self.first_version,
            steps=taken,
        )

    async def _run_group(self, tasks: list[Task]) -> None:
        samples = await run_rollout(context(self.cfg, self.job, self.plugins, self.step), self.plugins, tasks)
        await self.job.buffer.submit(by_task(tasks, samples))
        self.finished += samples

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self._note_failure(task)
        self.wake.set()

    def _note_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()

    # -- a step's batch ------------------------------------------------------------------------

    def trained(self, step: int) -> None:
        self.wake.set()  # a step trained (and maybe a new version): room for more groups

    async def next_batch(self, step: int, clock: Clock) -> tuple[BatchRef, dict[str, float]]:
        """The next batch within the staleness bound, long-polling while too few groups are complete."""
        self.step = step
        if (replay := await self.job.ledger.replay(step)) is not None:
            self.replays += 1
            replay, metrics = await replayed(self.cfg, self.job, self.plugins, step, replay, clock)
            return replay, metrics | self._staleness(replay)
        while True:
            if self.error is not None:
                raise self.error
            batch = await self.job.ledger.serve(
                step,
                num_groups=self.admission.batch_groups,
                max_weight_staleness=self.admission.staleness,
                timeout_s=POLL_S,
            )
            if batch.sizes:
                break
            if self.exhausted and not self.running:
                raise ServiceUnavailable(
                    "the buffer has no more tasks to lease and too few complete groups for a "
                    "batch (the dataset is exhausted: see --num-epoch)",
                    url=self.job.buffer.base_url,
                )
        clock["waited"] = time.perf_counter()
        finished, self.finished = self.finished, []
        batch, metrics = await prepare_batch(
            self.cfg, self.job, self.plugins, step, finished, batch, clock["waited"] - clock["started"]
        )
        return batch, metrics | self._staleness(batch)

    def _staleness(self, batch: BatchRef) -> dict[str, float]:
        return {
            "async/staleness_mean": sum(batch.staleness) / len(batch.staleness),
            "async/staleness_max": float(max(batch.staleness)),
            "async/groups_running": float(len(self.running)),
        }
