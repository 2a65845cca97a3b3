"""``Trainer``: the job's one door into the trainer group, the step it trains next, and the weights the
servers hold.

The trainer group (``train.actor.TrainGroup``: the Ray actors of every rank) is called through
typed methods (``train``, ``skip``, ``sync``, ``save``, ``save_for_restart``, ``finish``, and
``bring_in`` for a replacement server), each in a thread and one at a time behind one lock, so a
replacement server's weights never interleave with a training step or a sync, and a trainer
restart with neither.

``Trainer.step`` is the job's one step counter: the step the trainer trains next (a resumed
trainer starts at its checkpoint's). ``Trainer.version`` is the weight version the servers hold
(``weight_version`` as SGLang names it): the step of the latest ``sync``, 0 for the starting
weights. A server that dies during a sync fails it: the job heals (its replacement gets the
weights the others held) and the sync is made again. With ``--colocate``, a training step borrows
the servers' memory: they release it before the ranks train and take it back after.

If a rank dies during a call, every rank goes (their collectives cannot go on without it) and a
new group starts from the latest state saved: the trainer's own, kept every
``--restart-save-interval`` steps while episodes run, or a ``--save`` checkpoint, or else the
``--hf-checkpoint``. It trains again, in order, the batches the ledger
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
from typing import Any, Awaitable, Callable, TypeVar

from inverted.buffer.client import BatchRef, BufferAddress
from inverted.controller.config import JobConfig
from inverted.controller.ledger import Ledger
from inverted.placement import node_resource
from inverted.rollout.servers import RolloutServers
from inverted.rollout.sglang_client import ServerKeys, SGLangClient
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
    def __init__(
        self,
        cfg: JobConfig,
        process_setup: Callable[[str], None],
        ledger: Ledger,
        buffer: BufferAddress,
        servers: RolloutServers,
        keys: ServerKeys,
        heal: Callable[[], Awaitable[None]],
    ):
        """Starts the group from ``--load``, else ``--hf-checkpoint`` (blocking: call it in a thread).
        ``buffer``: where the ranks read each batch's Samples; ``servers`` (with their ``keys``): where
        its weights go; ``heal``: the job's supervisor, called when a server dies during a sync or the
        router does not answer before a step."""
        self.cfg, self.process_setup, self.ledger, self.buffer = cfg, process_setup, ledger, buffer
        self.servers, self.keys, self.heal = servers, keys, heal
        self.weight_version = "default"  # what the servers hold, as they name it (SGLang's before any update)
        self._pushed_to: list[str] = []  # the servers of the latest sync
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
        that this step trained it. A batch is trained only if the router served the job's own
        servers alone (``UnknownWorker`` else)."""
        await self.servers.verify_workers(heal=self.heal)
        colocated = self.cfg.loop.colocate
        if colocated:
            await self._all_servers(lambda client: client.release_memory_occupation())
        metrics = await self._locked_call(lambda group: group.train(batch, self.buffer))
        if colocated:
            await self._all_servers(lambda client: client.resume_memory_occupation())
        self.step = step + 1
        await self.ledger.trained(batch, step)
        return metrics

    async def skip(self, step: int) -> None:
        """Step ``step`` had nothing to train on: the trainer counts it all the same."""
        await self._locked_call(lambda group: group.skip(step))
        self.step = step + 1

    @property
    def version(self) -> int:
        """The weight version the servers hold: the step of the latest sync (0: the starting weights)."""
        return 0 if self.weight_version == "default" else int(self.weight_version)

    async def sync(self, version: int) -> dict[str, float]:
        """Push the weights into every live server as ``version``; the sync's metrics. A server that
        dies meanwhile fails the push: the job heals, and the push is made again to the servers then."""
        try:
            report = await self._push(version)
        except Exception as error:
            tried = self._pushed_to
            await self.heal()
            if self.servers.engine_urls == tried:  # no server was replaced: the failure is the update's own
                raise
            logger.warning("weight update %d failed while a server died (%s); updating again", version, error)
            report = await self._push(version)
        return report or {}

    async def _push(self, version: int) -> dict[str, float] | None:
        async with self.lock:
            # The servers are read under the lock: a replacement adopted while this update waited
            # for it (with the previous version's weights) must get this one too.
            self._pushed_to = urls = self.servers.engine_urls
            report = await self._call(lambda group: group.sync_weights(urls, version, self.keys))
            self.weight_version = str(version)
        return report

    async def bring_in(self, url: str, adopt: Callable[[], None]) -> None:
        """A replacement server at ``url`` gets the weights the others hold (a LoRA policy's adapter
        always: a fresh server has none), then ``adopt`` makes it one of the servers, with no sync
        passing between."""
        async with self.lock:
            if self.version or self.cfg.train.lora.enabled:
                await self._call(lambda group: group.sync_weights([url], self.version, self.keys))
            adopt()

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

    async def _all_servers(self, call: Callable[[SGLangClient], Awaitable[Any]]) -> None:
        async def one(url: str) -> None:
            async with SGLangClient.keyed(url, self.keys) as client:
                await call(client)

        await asyncio.gather(*(one(url) for url in self.servers.engine_urls))

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
