"""The supervisor: beside the loop, every second, whatever part of the job died is healed.

- The buffer, the proxy and the router are started again **at their address** (the same port and
  key), so no client is re-pointed. The buffer's state is its SQLite file, and the job's client
  waits out the restart (``job.RESTART_WAIT_S``). The router gets every live server back. The
  proxy's sessions die with it: their episodes come back aborted, and the buffer queues their tasks
  again (``rollout_functions.episodes``), so they are played again and nothing partial is trained.
- A rollout server is taken out of the router, replaced by a fresh server that first gets the
  current weights and version, then registered; the servers of a lost node are replaced side by
  side. A call that was on a dead server (or went through a dead router) is sampled again by the
  proxy on whichever server answers (``--proxy-server-loss-wait``), so its episode goes on.
- A trainer with a dead rank is restarted (``controller.trainer``).

The trainer calls ``heal`` too: when a server dies during a sync, and when the router does not
answer the step's check of the servers it served (killed since the last round).

Deaths and restarts are logged and counted (``faults/*`` metrics). A service that dies again
during its restart stops the job with its name, exit code and log tail.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Protocol, TypeVar

import yaml

from inverted.config import to_flags
from inverted.controller.config import JobConfig
from inverted.controller.trainer import Trainer
from inverted.processes import ManagedProcess
from inverted.rollout.servers import RolloutServers, ServerHandle

logger = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 1.0
T = TypeVar("T")


def spawn_service(command: str, section: Any, run_dir: Path, url: str) -> ManagedProcess:
    """``inverted COMMAND --config run_dir/services/COMMAND.yaml`` (owner-only: it holds the key), the
    config the supervisor starts it again from; the caller waits until it is healthy."""
    config = run_dir / "services" / f"{command}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600)
    config.write_text(yaml.safe_dump(to_flags(section), sort_keys=False))
    return start_service(command, run_dir, url)


def start_service(command: str, run_dir: Path, url: str, *, again: bool = False) -> ManagedProcess:
    """The service as its config file says (``again``: a restart, appending to its predecessor's log)."""
    argv = [sys.executable, "-m", "inverted.cli", command, "--config", str(run_dir / "services" / f"{command}.yaml")]
    return ManagedProcess.spawn(command, argv, run_dir / "logs" / f"{command}.log", url, append=again)


class Supervised(Protocol):
    """What the supervisor watches and heals (``controller.job.Job``)."""

    cfg: JobConfig
    run_dir: Path
    processes: list[ManagedProcess]  # the job's services, each started from its config file (``spawn_service``)
    servers: RolloutServers
    trainer: Trainer | None

    @property
    def version(self) -> int: ...


class Supervisor:
    def __init__(self, job: Supervised):
        self.job = job
        self.faults: Counter[str] = Counter(engine_deaths=0, engine_restarts=0, service_restarts=0)
        self._lock = asyncio.Lock()

    async def run(self, main: Awaitable[T]) -> T:
        """Run ``main`` while the supervisor watches; a part that cannot be healed stops it with its error."""
        work, watch = asyncio.ensure_future(main), asyncio.create_task(self._watch())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                watch.result()  # raises what stopped the supervisor
            return await work
        finally:
            for task in (watch, work):
                task.cancel()
            await asyncio.gather(watch, work, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await self.heal()
            await asyncio.sleep(SUPERVISE_EVERY_S)

    async def heal(self) -> None:
        """Start a dead service again at its address, the router first; then replace every rollout
        server that died, all at once (a lost node takes several); then a trainer with a dead rank."""
        job = self.job
        async with self._lock:
            for i, process in enumerate(job.processes):
                if process.exited:
                    job.processes[i] = await self._restart(process)
            if job.servers.router_exited and (router := job.servers.router) is not None:
                logger.warning("the router died; starting it again at %s. Log tail:\n%s", router.url, router.tail(10))
                await job.servers.restart_router()
                self.faults["service_restarts"] += 1
                logger.warning("the router is back at %s, serving %d servers", router.url, len(job.servers.engines))
            dead = await asyncio.to_thread(job.servers.dead)
            results = await asyncio.gather(*(self._replace(engine) for engine in dead), return_exceptions=True)
            for error in results:
                if isinstance(error, BaseException):
                    raise error
            if job.trainer is not None:
                await job.trainer.restart_if_dead()

    def metrics(self) -> dict[str, float]:
        restarts = self.job.trainer.restarts if self.job.trainer is not None else 0
        return {f"faults/{name}": float(count) for name, count in self.faults.items()} | {
            "faults/trainer_restarts": float(restarts)
        }

    async def _restart(self, dead: ManagedProcess) -> ManagedProcess:
        logger.warning(
            "the %s died (exit code %s); starting it again at %s. Log tail:\n%s",
            dead.name,
            dead.popen.returncode,
            dead.url,
            dead.tail(10),
        )
        process = start_service(dead.name, self.job.run_dir, dead.url, again=True)
        await asyncio.to_thread(process.wait_healthy, self.job.cfg.servers.startup_timeout)
        self.faults["service_restarts"] += 1
        logger.warning("the %s is back at %s", dead.name, dead.url)
        return process

    async def _replace(self, dead: ServerHandle) -> None:
        job = self.job
        self.faults["engine_deaths"] += 1
        logger.warning(
            "%s (%s) died; replacing it. Log tail:\n%s", dead.name, dead.url, await asyncio.to_thread(dead.tail, 10)
        )
        await job.servers.retire(dead)
        engine = await job.servers.start_engine()
        if job.trainer is None:
            job.servers.adopt(engine)
        else:
            await job.trainer.bring_in(engine.url, lambda: job.servers.adopt(engine))
        await job.servers.register(engine)
        self.faults["engine_restarts"] += 1
        logger.warning("%s replaces %s at %s with weight version %d", engine.name, dead.name, engine.url, job.version)
