"""``Trainer``: the job's one door into the trainer group, and the step it trains next.

The trainer group (``train.actor.TrainGroup``: the Ray actors of every rank) is called through
typed methods (``train``, ``skip``, ``push``, ``save``, ``save_for_restart``, ``finish``), each in a
thread and one at a time behind one lock (``Trainer.lock``, which a weight push's caller holds), so
a replacement server's weight sync never interleaves with a training step or another sync, and a
trainer restart with neither.

``Trainer.step`` is the job's one step counter: the step the trainer trains next (a resumed
trainer starts at its checkpoint's). If a rank dies during a call, every rank goes (their
collectives cannot go on without it) and a new group starts from the latest state saved: the
trainer's own, kept every ``--restart-save-interval`` steps while episodes run, or a ``--save``
checkpoint, or else the ``--hf-checkpoint``. It trains again, in order, the batches the ledger
says were served to every step since, so it stands where the dead one stood, and the call it died
in is made again. The servers keep their weights meanwhile: the restarted trainer pushes nothing
until it has reached the step the dead one reached, so weight versions stay totally ordered.
Replaying costs a training step per step since the state it started from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Callable, TypeVar

from inverted.buffer.client import BatchRef, BufferAddress
from inverted.controller.config import JobConfig
from inverted.controller.ledger import Ledger
from inverted.placement import node_resource
from inverted.rollout.sglang_client import ServerKeys
from inverted.train.actor import RankDied, TrainGroup
from inverted.train.config import TrainConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


def checkpoint_dir(train: TrainConfig) -> str:
    return train.ckpt.save or str(Path(train.output_dir) / "checkpoints")


def restart_dir(train: TrainConfig) -> str:
    """Where the trainer keeps its latest state for a restart (``--restart-save-interval``)."""
    return str(Path(train.output_dir) / "restart")


class Trainer:
    def __init__(self, cfg: JobConfig, process_setup: Callable[[str], None], ledger: Ledger, buffer: BufferAddress):
        """Starts the group from ``--load``, else ``--hf-checkpoint`` (blocking: call it in a thread).
        ``buffer``: where the ranks read each batch's Samples."""
        self.cfg, self.process_setup, self.ledger, self.buffer = cfg, process_setup, ledger, buffer
        self.restarts = 0
        self.lock = asyncio.Lock()
        shutil.rmtree(restart_dir(cfg.train), ignore_errors=True)  # a killed run's restart state is not this run's
        self.group = self._start(cfg.train)
        self.step = self.group.step

    def _start(self, train: TrainConfig) -> TrainGroup:
        return TrainGroup(
            train,
            self.process_setup,
            gpu_fraction=0.5 if self.cfg.loop.colocate else 1.0,
            node=node_resource(train.parallel.actor_node_resource),
        )

    # -- what a step asks of it ------------------------------------------------------------

    async def train(self, batch: BatchRef, step: int) -> dict[str, float]:
        """Training step ``step`` on the batch (the ranks read its Samples); the ledger then records
        that this step trained it."""
        metrics = await self._locked_call(lambda group: group.train(batch, self.buffer))
        self.step = step + 1
        await self.ledger.trained(batch, step)
        return metrics

    async def skip(self, step: int) -> None:
        """Step ``step`` had nothing to train on: the trainer counts it all the same."""
        await self._locked_call(lambda group: group.skip(step))
        self.step = step + 1

    async def push(self, urls: list[str], version: int, keys: ServerKeys) -> dict[str, float] | None:
        """(``lock`` held: the caller decides what may not pass between the push and what it does next.)
        The weights into the servers at ``urls`` as ``version``; the sync's metrics."""
        return await self._call(lambda group: group.sync_weights(urls, version, keys))

    async def save(self) -> str:
        return await self._locked_call(lambda group: group.save(checkpoint_dir(self.cfg.train)))

    async def save_for_restart(self) -> None:
        """Returns at once; the ranks write while the next rollout runs."""
        await self._locked_call(lambda group: group.save_for_restart(restart_dir(self.cfg.train)))

    async def finish(self, hf_out: str) -> str:
        """The final checkpoint as a Hugging Face model in ``hf_out``; the restart state goes (the
        checkpoint holds more)."""
        out = await self._locked_call(lambda group: group.finish(checkpoint_dir(self.cfg.train), hf_out))
        shutil.rmtree(restart_dir(self.cfg.train), ignore_errors=True)
        return out

    # -- death and restart -----------------------------------------------------------------

    async def restart_if_dead(self) -> None:
        """A rank that died between calls (under way, the call itself finds it and restarts)."""
        if self.lock.locked() or not self.group.dead():
            return
        async with self.lock:
            if self.group.dead():
                logger.warning("a trainer rank died between calls")
                await self._restart()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.group.shutdown)

    async def _locked_call(self, call: Callable[[TrainGroup], T]) -> T:
        async with self.lock:
            return await self._call(call)

    async def _call(self, call: Callable[[TrainGroup], T]) -> T:
        """(The lock held.) ``call(group)`` in a thread; if a rank dies in it, the trainer is restarted
        and the call made again."""
        try:
            return await asyncio.to_thread(call, self.group)
        except RankDied as error:
            logger.warning("%s", error)
        await self._restart()
        return await asyncio.to_thread(call, self.group)

    async def _restart(self) -> None:
        """(The lock held.) A new group in place of one with a dead rank, brought to the dead one's step
        from the latest state saved by training again the batches served since."""
        from inverted.train.checkpoint import latest_step  # with torch: the driver loads it only here

        started = time.perf_counter()
        await asyncio.to_thread(self.group.kill)
        train = self.cfg.train
        saved = [
            root
            for root in (restart_dir(train), checkpoint_dir(train), train.ckpt.load)
            if 0 <= latest_step(root) <= self.step
        ]  # (never a state past this run's own step)
        load = max(saved, key=latest_step, default=None)
        logger.warning(
            "restarting the trainer from %s; it trains again the batches served since, up to step %d",
            load or train.hf_checkpoint,
            self.step - 1,
        )
        if load is not None:
            train = dataclasses.replace(train, ckpt=dataclasses.replace(train.ckpt, load=load))
        self.group = await asyncio.to_thread(self._start, train)
        start, replayed = self.group.step, 0
        for step in range(start, self.step):
            batch = await self.ledger.served(step)
            if batch is None or not batch.sizes:  # a step with nothing to train on
                await asyncio.to_thread(self.group.skip, step)
            else:
                await asyncio.to_thread(self.group.train, batch, self.buffer)
                replayed += 1
        self.restarts += 1
        logger.warning(
            "the trainer is back at step %d in %.1fs: from step %d, %d batches trained again",
            self.step,
            time.perf_counter() - started,
            start,
            replayed,
        )
