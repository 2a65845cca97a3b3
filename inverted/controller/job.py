"""The running parts of one ``inverted train`` and their supervision (``Job``).

``async with Job(...)`` starts Ray (local, or ``--ray-address``), the buffer service on
``OUTPUT_DIR/buffer.db``, the rollout servers behind the real sgl-router (each started by a Ray
actor), the trainer (a Ray actor group) and the proxy, each service on a free loopback port with
an unguessable key; on exit it stops them all, whatever happened.

Supervision (``supervise``, a background task beside the loop) heals, every second, whatever died:
- the buffer, the proxy and the router are started again **at their address** (the same port and
  key), so no client is re-pointed. The buffer's state is its SQLite file, and the job's client
  waits out the restart (``RESTART_WAIT_S``). The router gets every live server back. The
  proxy's sessions die with it: their episodes come back aborted, and the buffer queues their tasks
  again (``rollout_functions.episodes``), so they are played again and nothing partial is trained;
- a rollout server is taken out of the router, replaced by a fresh server that first gets the
  current weights and version, then registered; the servers of a lost node are replaced side by
  side. A call that was on a dead server (or went through a dead router) is sampled again by the
  proxy on whichever server answers (``--proxy-server-loss-wait``), so its episode goes on.
- a trainer rank: every rank goes (its collectives cannot go on without it) and a new trainer group
  starts from the latest state saved: the trainer's own, kept every ``--restart-save-interval``
  steps while episodes run, or a ``--save`` checkpoint, or else the ``--hf-checkpoint``. It trains
  again, in order, the batches the buffer served to every step since (``batch_name``), so it
  stands where the dead one stood, and the call it died in is made again. The servers keep their
  weights meanwhile: the restarted trainer pushes nothing until it has reached the step the dead
  one reached, so weight versions stay totally ordered. The buffer records each batch's step once
  (``Job.train``), so a replayed batch is no Sample trained twice: its training is redone, from
  the checkpoint, in the step it belongs to. Replaying costs a training step per step since the
  state it started from.
Deaths and restarts are logged and counted (``faults/*`` metrics). A service that dies again
during its restart stops the job with its name, exit code and log tail.

A LoRA run (``--lora-rank``) starts every server with LoRA enabled; the adapter the trainer
trains is served as ``POLICY_ADAPTER``, which the proxy and the rollout context name in every
call (``Job.adapter``), and a replacement server gets it before it serves.

Every call into the trainer goes through one lock, so a replacement's weight sync never
interleaves with a training step or another sync, and a trainer restart with neither.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import secrets
import shutil
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import yaml

from inverted.buffer.client import Batch, BufferClient
from inverted.config import JobConfig, RolloutConfig, TrainConfig, flag_name, to_flags
from inverted.devices import cuda_available
from inverted.errors import ConfigError, PluginError
from inverted.placement import node_resource, ray_launch, start_ray
from inverted.plugins import (Keywords, RewardModel, RolloutFunction, load_hook, load_optional, load_rollout_function,
                              required_flags)
from inverted.processes import ManagedProcess, free_port
from inverted.rollout.servers import ROUTED_EXPERTS_ARGV, RolloutServers, ServerHandle, lora_argv
from inverted.rollout.sglang_client import SGLangClient, ServerKeys, without_sampling_masks
from inverted.train.actor import RankDied, TrainGroup
from inverted.types import POLICY_ADAPTER

logger = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 1.0
# How long the job's own clients of a restartable service go on retrying a refused connection: a
# restart (detection, a Python start, the imports) takes a few seconds on 2 cores.
RESTART_WAIT_S = 60.0
STOP_WAIT_S = 5.0  # for the buffer's answer when the job stops
T = TypeVar("T")


SINGLE_TURN = "rollout_functions.single_turn:generate_rollout"


def batch_name(step: int) -> str:
    """The request id under which the buffer serves training step ``step`` its batch: a resumed or
    restarted trainer finds the batches the steps it lost were served (``BufferClient.served_batch``)."""
    return f"batch:{step}"


def checkpoint_dir(train: TrainConfig) -> str:
    return train.ckpt.save or str(Path(train.output_dir) / "checkpoints")


def restart_dir(train: TrainConfig) -> str:
    """Where the trainer keeps its latest state for a restart (``--restart-save-interval``)."""
    return str(Path(train.output_dir) / "restart")


@dataclasses.dataclass(slots=True)
class Plugins:
    """The user code the job's controller runs, loaded (and checked) before any process starts, each
    as its hook (``inverted.plugins``; slime's forms come adapted)."""

    rollout: RolloutFunction
    env: Callable | None = None
    reward: RewardModel | None = None
    generate: Callable | None = None  # (ctx, sample, sampling_params) -> Samples, run inside single_turn
    evaluate: RolloutFunction | None = None  # --eval-function-path (else the rollout function)
    sample_filter: Callable | None = None  # (groups) -> None, setting Sample.remove_sample
    rollout_log: Callable | None = None  # (rollout_id, samples, metrics, seconds) -> bool
    eval_log: Callable | None = None  # (rollout_id, data, metrics) -> bool
    # the environment of each evaluation, by name: "" the main one (--eval-env-args), then --eval-variants
    eval_envs: dict[str, Callable | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, cfg: RolloutConfig, flags: dict[str, Any] | None = None) -> "Plugins":
        """``flags``: every flag of the job by name, for the adapters of other frameworks' plug-ins."""
        env = load_env(cfg.env_path, cfg.env_args, "--env-args")
        eval_envs = {"": env if cfg.eval_env_args is None else load_env(cfg.env_path, cfg.eval_env_args,
                                                                         "--eval-env-args")}
        for name, args in json.loads(cfg.eval_variants or "{}").items():
            eval_envs[name] = load_env(cfg.env_path, json.dumps(args), f"--eval-variants {name}")
        generate = load_hook(cfg.custom_generate_function_path, point="generate",
                             flag="--custom-generate-function-path", flags=flags)
        path = cfg.rollout_function_path
        if generate is not None:  # as in slime, a custom generate runs inside the default rollout
            default = RolloutConfig.__dataclass_fields__["rollout_function_path"].default
            if path not in (default, SINGLE_TURN):
                raise ConfigError(f"--custom-generate-function-path runs inside {SINGLE_TURN} (slime's default "
                                  f"rollout), not inside --rollout-function-path {path}")
            path = SINGLE_TURN
        rollout = load_rollout_function(path, flags=flags)
        for name in required_flags(rollout):
            if not getattr(cfg, name) and not (name == "custom_rm_path" and generate is not None):
                raise ConfigError(f"--rollout-function-path {path} needs {flag_name(name)}")
        return cls(
            rollout, env, generate=generate,
            reward=RewardModel.load(cfg.custom_rm_path, cfg.group_rm, flags) if cfg.custom_rm_path else None,
            evaluate=(load_rollout_function(cfg.eval_function_path, "--eval-function-path", flags)
                      if cfg.eval_function_path else None),
            sample_filter=load_hook(cfg.rollout_sample_filter_path, point="sample_filter",
                                    flag="--rollout-sample-filter-path", forms={"ours": ["groups"]}, flags=flags),
            rollout_log=load_hook(cfg.custom_rollout_log_function_path, point="rollout_log",
                                  flag="--custom-rollout-log-function-path",
                                  forms={"ours": ["rollout_id", "samples", "metrics", "seconds"]}, flags=flags),
            eval_log=load_hook(cfg.custom_eval_rollout_log_function_path, point="eval_log",
                               flag="--custom-eval-rollout-log-function-path",
                               forms={"ours": ["rollout_id", "data", "metrics"]}, flags=flags),
            eval_envs=eval_envs)


def load_env(path: str | None, args: str | None, flag: str) -> Callable | None:
    """``--env-path`` called with ``args`` (a JSON object of keyword arguments, ``flag`` naming where they came from)."""
    env = load_optional(path, flag="--env-path", params=["task", "client"], keywords=Keywords(json.loads(args or "{}"), flag),
                        guard=False)  # an environment's exception fails its episode only
    if env is not None and not inspect.iscoroutinefunction(env):
        raise PluginError(f"--env-path={path!r}: expected 'async def {getattr(env, '__name__', 'episode')}"
                          "(task, client) -> reward'")
    return env


def _worker_id(run_dir: Path) -> str:
    """The buffer worker id of the job's leases: unguessable (it is the credential that gives them
    back), and kept in the run directory, so a resumed run gives back what a killed one held."""
    path = run_dir / "services" / "worker_id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(f"controller-{secrets.token_urlsafe(18)}")
    return path.read_text().strip()


def spawn_service(command: str, section: Any, run_dir: Path, url: str) -> ManagedProcess:
    """``inverted COMMAND --config run_dir/services/COMMAND.yaml`` (owner-only: it holds the key);
    the caller waits until it is healthy."""
    config = run_dir / "services" / f"{command}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600)
    config.write_text(yaml.safe_dump(to_flags(section), sort_keys=False))
    return start_service(command, run_dir, url)


def start_service(command: str, run_dir: Path, url: str, *, again: bool = False) -> ManagedProcess:
    """The service as its config file says (``again``: a restart, appending to its predecessor's log)."""
    argv = [sys.executable, "-m", "inverted.cli", command, "--config", str(run_dir / "services" / f"{command}.yaml")]
    return ManagedProcess.spawn(command, argv, run_dir / "logs" / f"{command}.log", url, append=again)


class Job:
    """Every running part of one ``inverted train``; ``async with Job(...)`` starts and stops them."""

    def __init__(self, cfg: JobConfig, router_args: list[str], sglang_args: list[str], process_setup: Callable[[str], None]):
        self.cfg, self.router_args, self.sglang_args, self.process_setup = cfg, router_args, sglang_args, process_setup
        self.run_dir = Path(cfg.train.output_dir)
        self.processes: list[ManagedProcess] = []
        self.trainer: TrainGroup | None = None
        self.next_step = 0  # the trainer's next step: what a restarted trainer replays up to
        self.version = 0  # the weight version the servers hold (the trainer's step at its last sync)
        self.weight_version = "default"  # the same as the servers name it (SGLang's before any update)
        self.lora = _lora_config(cfg)  # a LoRA run's adapter: the servers serve it as the policy
        self.adapter = POLICY_ADAPTER if self.lora else None  # what every policy call names (SGLang's lora_path)
        self._pushed_to: list[str] = []  # the servers of the latest weight update
        self.engine_key = secrets.token_urlsafe(24)  # the rollout servers' admin key, and the router's
        self.router_key = secrets.token_urlsafe(24)  # /generate's, at the router and at the servers
        self.server_keys = ServerKeys(api=self.router_key, admin=self.engine_key)
        # reported from the first row on
        self.faults: Counter[str] = Counter(engine_deaths=0, engine_restarts=0, service_restarts=0,
                                            trainer_restarts=0)
        self._trainer_lock = asyncio.Lock()
        self._heal_lock = asyncio.Lock()
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> "Job":
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        """Start every part, booting side by side whatever does not need another part ready first."""
        cfg, timeout = self.cfg, self.cfg.servers.startup_timeout
        port, key = free_port(), secrets.token_urlsafe(24)
        buffer_cfg = dataclasses.replace(cfg.buffer, db=str(self.run_dir / "buffer.db"), port=port, api_key=key)
        buffer = spawn_service("buffer", buffer_cfg, self.run_dir, f"http://127.0.0.1:{port}")
        self.processes.append(buffer)
        start_ray(cfg.loop.ray_address)  # while the buffer boots
        await asyncio.to_thread(buffer.wait_healthy, timeout)
        self.buffer = await self._stack.enter_async_context(BufferClient(buffer.url, api_key=key,
                                                                         outage_s=RESTART_WAIT_S))
        self.worker_id = _worker_id(self.run_dir)
        if released := await self.buffer.release(self.worker_id):  # tasks an earlier, killed run of this job held
            logger.info("gave %d tasks leased by an earlier run back to the buffer", released)

        # The servers' weight and control routes take only this key: nobody else on the network
        # can change the weights they serve (SGLang shipped those routes open, and got a CVE for it).
        # The router's worker routes take the admin key too, and its /generate (and the servers') the
        # router key: no one else can add a worker of their own to the job, or generate through it.
        servers_cfg = dataclasses.replace(cfg.servers, log_dir=str(self.run_dir / "logs"), admin_api_key=self.engine_key,
                                          router_api_key=self.router_key)
        gpus = cfg.servers.rollout_num_gpus_per_engine * (0.5 if cfg.loop.colocate else 1.0)
        # Without a trainer no sync brings the adapter: the servers load it themselves.
        lora = lora_argv(self.lora.rank, list(self.lora.modules),
                         cfg.train.lora.lora_adapter_path if cfg.rollout.debug_rollout_only else None) if self.lora else []
        replay = cfg.train.moe.use_rollout_routing_replay  # the servers return each token's experts, the proxy keeps them
        self.servers = RolloutServers(servers_cfg, self.router_args, self.sglang_args,
                                      flags=lora + (ROUTED_EXPERTS_ARGV if replay else []),
                                      launch=ray_launch(gpus if cuda_available() else 0, cfg.loop.ray_address is None,
                                                        cfg.servers.rollout_node_resource, cfg.servers.startup_timeout))
        port, self.proxy_key = free_port(), secrets.token_urlsafe(24)
        proxy_cfg = dataclasses.replace(cfg.proxy, router_url=self.servers.router_url, tokenizer=cfg.train.hf_checkpoint,
                                        context_length=self.servers.config.context_length,
                                        proxy_port=port, proxy_api_key=self.proxy_key, lora_name=self.adapter,
                                        return_routed_experts=replay, router_api_key=self.router_key,
                                        router_admin_api_key=self.engine_key)  # to list the router's workers
        proxy = spawn_service("proxy", proxy_cfg, self.run_dir, f"http://127.0.0.1:{port}")  # needs no router to boot
        self.processes.append(proxy)
        self.proxy_url = proxy.url
        trainer = [] if cfg.rollout.debug_rollout_only else [asyncio.to_thread(self._start_trainer)]
        await asyncio.gather(self.servers.start(), asyncio.to_thread(proxy.wait_healthy, timeout), *trainer)
        await self._check_sampling_masks()

    def _start_trainer(self, load: str | None = None) -> None:
        """The trainer group, from ``load`` when given (else ``--load``, else ``--hf-checkpoint``)."""
        train = self.cfg.train
        if load is not None:
            train = dataclasses.replace(train, ckpt=dataclasses.replace(train.ckpt, load=load))
        else:  # a killed run's state for a restart is not this run's: it resumes from --load
            shutil.rmtree(restart_dir(train), ignore_errors=True)
        self.trainer = TrainGroup(train, self.process_setup, gpu_fraction=0.5 if self.cfg.loop.colocate else 1.0,
                                  node=node_resource(train.parallel.actor_node_resource))
        self.next_step = max(self.next_step, self.trainer.rollout_id)

    async def __aexit__(self, *exc: object) -> None:
        import ray

        if hasattr(self, "buffer"):
            try:  # episodes cut short by the end of the run: their tasks go back to the queue now
                # (briefly: a buffer that is gone, a Ctrl-C took it too, is not waited for; its leases expire)
                await asyncio.wait_for(self.buffer.release(self.worker_id), STOP_WAIT_S)
            except Exception as error:  # noqa: BLE001 - stopping goes on regardless
                logger.warning("could not give the job's leased tasks back to the buffer: %s", error)
        await self._stack.aclose()
        if self.trainer is not None:
            await asyncio.to_thread(self.trainer.shutdown)
        if hasattr(self, "servers"):
            self.servers.stop()
        for process in reversed(self.processes):
            process.terminate()
        if self.cfg.loop.ray_address is None:
            ray.shutdown()

    # -- the trainer -----------------------------------------------------------------------

    async def trainer_call(self, method: str, *args: Any) -> Any:
        """``trainer.method(*args)`` in a thread, one call at a time."""
        async with self._trainer_lock:
            return await self._call(method, *args)

    async def _call(self, method: str, *args: Any) -> Any:
        """(The trainer lock held.) The call; if a rank dies in it, the trainer is restarted and the
        call made again."""
        try:
            return await asyncio.to_thread(getattr(self.trainer, method), *args)
        except RankDied as error:
            logger.warning("%s", error)
        await self._restart_trainer()
        return await asyncio.to_thread(getattr(self.trainer, method), *args)

    async def train(self, batch: Batch, step: int) -> dict[str, float]:
        """Training step ``step`` on the batch, once the router is known to have served only the job's
        servers; then the buffer records that this step trained it (and refuses a second step)."""
        await self.servers.verify_workers()
        metrics = await self.trainer_call("train", batch.samples)
        self.next_step = step + 1
        await self.buffer.trained(batch.batch_id, step)
        return metrics

    async def skip(self, step: int) -> None:
        """Step ``step`` had nothing to train on: the trainer counts it all the same."""
        await self.trainer_call("skip", step)
        self.next_step = step + 1

    async def _restart_trainer(self) -> None:
        """(The trainer lock held.) A new trainer group in place of one with a dead rank, brought to the
        dead one's step from the latest checkpoint by training again the batches served since."""
        from inverted.train.checkpoint import latest_step  # with torch: the driver loads it only here

        started = time.perf_counter()
        await asyncio.to_thread(self.trainer.kill)
        train = self.cfg.train
        saved = [root for root in (restart_dir(train), checkpoint_dir(train), train.ckpt.load)
                 if 0 <= latest_step(root) <= self.next_step]  # (never a state past this run's own step)
        load = max(saved, key=latest_step, default=None)
        logger.warning("restarting the trainer from %s; it trains again the batches served since, up to step %d",
                       load or self.cfg.train.hf_checkpoint, self.next_step - 1)
        await asyncio.to_thread(self._start_trainer, load)
        start, replayed = self.trainer.rollout_id, 0
        for step in range(start, self.next_step):
            batch = await self.buffer.served_batch(batch_name(step))
            if batch is None or not batch.groups:  # a step with nothing to train on
                await asyncio.to_thread(self.trainer.skip, step)
            else:
                await asyncio.to_thread(self.trainer.train, batch.samples)
                replayed += 1
        self.faults["trainer_restarts"] += 1
        logger.warning("the trainer is back at step %d in %.1fs: from step %d, %d batches trained again",
                       self.next_step, time.perf_counter() - started, start, replayed)

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights into every live server as ``version``; its metrics.

        A server that dies during the update fails it: it is healed (its replacement gets the
        weights the others held) and the update is made again.
        """
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
        async with self._trainer_lock:
            # The servers are read under the lock: a replacement adopted while this update waited
            # for it (with the previous version's weights) must get this one too.
            self._pushed_to = self.servers.engine_urls
            report = await self._call("sync_weights", self._pushed_to, version, self.server_keys)
            self.version, self.weight_version = version, str(version)
        return report

    # -- supervision -----------------------------------------------------------------------

    async def run_supervised(self, main: Awaitable[T]) -> T:
        """Run ``main`` while ``supervise`` watches; a part that cannot be healed stops it with its error."""
        work, watch = asyncio.ensure_future(main), asyncio.create_task(self.supervise())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                watch.result()  # raises what stopped the supervisor
            return await work
        finally:
            for task in (watch, work):
                task.cancel()
            await asyncio.gather(watch, work, return_exceptions=True)

    async def supervise(self) -> None:
        """Forever: whatever died is healed (a failure to heal stops the job)."""
        while True:
            await self.heal()
            await asyncio.sleep(SUPERVISE_EVERY_S)

    async def heal(self) -> None:
        """Start a dead service again at its address, the router first; then replace every rollout
        server that died, all at once (a lost node takes several); then a trainer with a dead rank."""
        async with self._heal_lock:
            for i, process in enumerate(self.processes):
                if process.exited:
                    self.processes[i] = await self._restart(process)
            if self.servers.router_exited:
                router = self.servers.router
                logger.warning("the router died; starting it again at %s. Log tail:\n%s", router.url, router.tail(10))
                await self.servers.restart_router()
                self.faults["service_restarts"] += 1
                logger.warning("the router is back at %s, serving %d servers", router.url, len(self.servers.engines))
            dead = await asyncio.to_thread(self.servers.dead)
            results = await asyncio.gather(*(self._replace(engine) for engine in dead), return_exceptions=True)
            for error in results:
                if isinstance(error, BaseException):
                    raise error
            if self.trainer is not None and not self._trainer_lock.locked() and self.trainer.dead():
                # (Under way, a call finds the dead rank itself, and restarts the trainer.)
                async with self._trainer_lock:
                    if self.trainer.dead():
                        logger.warning("a trainer rank died between calls")
                        await self._restart_trainer()

    async def _restart(self, dead: ManagedProcess) -> ManagedProcess:
        logger.warning("the %s died (exit code %s); starting it again at %s. Log tail:\n%s", dead.name,
                       dead.popen.returncode, dead.url, dead.tail(10))
        process = start_service(dead.name, self.run_dir, dead.url, again=True)
        await asyncio.to_thread(process.wait_healthy, self.cfg.servers.startup_timeout)
        self.faults["service_restarts"] += 1
        logger.warning("the %s is back at %s", dead.name, dead.url)
        return process

    async def _replace(self, dead: ServerHandle) -> None:
        self.faults["engine_deaths"] += 1
        logger.warning("%s (%s) died; replacing it. Log tail:\n%s", dead.name, dead.url,
                       await asyncio.to_thread(dead.tail, 10))
        await self.servers.retire(dead)
        engine = await self.servers.start_engine()
        async with self._trainer_lock:  # no update may pass between its weights and its adoption
            if self.trainer is not None and (self.version or self.lora):  # a LoRA policy is never on a fresh server
                await self._call("sync_weights", [engine.url], self.version, self.server_keys)
            self.servers.adopt(engine)
        await self.servers.register(engine)
        self.faults["engine_restarts"] += 1
        logger.warning("%s replaces %s at %s with weight version %d", engine.name, dead.name, engine.url, self.version)

    def fault_metrics(self) -> dict[str, float]:
        return {f"faults/{name}": float(count) for name, count in self.faults.items()}

    async def _check_sampling_masks(self) -> None:
        """Under top-p or top-k, the servers must return each token's kept set, or the ratios are biased:
        one token of one server asked for one (an SGLang without ``return_sampling_mask`` answers none)."""
        rollout = self.cfg.rollout
        if not rollout.cut_sampling:
            return
        if rollout.biased_ratios:
            logger.warning("--sampling-mask-top-k 0: the rollouts sample with --rollout-top-p/--rollout-top-k and "
                           "their kept sets are not recorded, so every importance ratio is biased "
                           "(metrics: rollout/biased_ratios)")
            return
        url = self.servers.engine_urls[0]
        async with SGLangClient.keyed(url, self.server_keys) as client:
            why = await without_sampling_masks(client)
        if why is not None:
            raise ConfigError(f"the rollout server at {url} returns no sampling masks (return_sampling_mask, SGLang "
                              f">= 0.5.23: {why}); under --rollout-top-p/--rollout-top-k the trainer needs them for "
                              "exact ratios. Use a server that returns them, or pass --sampling-mask-top-k 0 to "
                              "train with biased ratios")

    async def all_servers(self, method: str) -> None:
        async def call(url: str) -> None:
            async with SGLangClient.keyed(url, self.server_keys) as client:
                await getattr(client, method)()
        await asyncio.gather(*(call(url) for url in self.servers.engine_urls))


def _lora_config(cfg: JobConfig):
    """The adapter a LoRA run trains (``peft_adapter.LoRAConfig``), None without LoRA."""
    a = cfg.train.lora
    if not a.enabled:
        return None
    from inverted.peft_adapter import lora_config  # torch: only a LoRA run pays for it here

    return lora_config(a.lora_rank, a.lora_alpha, a.lora_dropout, a.target_modules, a.lora_adapter_path)
