"""``Job``: the running parts of one ``inverted train``, and the weights the servers hold.

``async with Job(...)`` starts Ray (local, or ``--ray-address``), the buffer service on
``OUTPUT_DIR/buffer.db``, the rollout servers behind the real sgl-router (each started by a Ray
actor), the trainer (a Ray actor group, ``controller.trainer``) and the proxy, each service on a
free loopback port with an unguessable key; on exit it stops them all, whatever happened. Its
``supervisor`` (``controller.supervisor``) heals whatever dies while the loop runs.

The trainer (``controller.trainer``) pushes its weights into every server as a new version; that
version (``Job.version``; ``weight_version`` as SGLang names it) is what every rollout call is served
with, and what a replacement server gets before it serves.

A LoRA run (``--lora-rank``) starts every server with LoRA enabled; the adapter the trainer
trains is served as ``POLICY_ADAPTER``, which the proxy and the rollout context name in every
call (``Job.adapter``), and a replacement server gets it before it serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from inverted.buffer.client import BufferAddress
from inverted.controller.config import JobConfig
from inverted.controller.ledger import Ledger
from inverted.controller.supervisor import Supervisor, spawn_service
from inverted.controller.trainer import Trainer
from inverted.devices import cuda_available
from inverted.errors import ConfigError
from inverted.placement import ray_launch, start_ray
from inverted.processes import ManagedProcess, free_port, terminate_all
from inverted.rollout.servers import ROUTED_EXPERTS_ARGV, RolloutServers, lora_argv
from inverted.rollout.sglang_client import ServerKeys, SGLangClient, without_sampling_masks
from inverted.types import POLICY_ADAPTER

if TYPE_CHECKING:
    from inverted.peft_adapter import LoRAConfig  # torch: imported where a LoRA run needs it

logger = logging.getLogger(__name__)

# How long the job's own clients of a restartable service go on retrying a refused connection: a
# restart (detection, a Python start, the imports) takes a few seconds on 2 cores.
RESTART_WAIT_S = 60.0
STOP_WAIT_S = 5.0  # for the buffer's answer when the job stops


def _worker_id(run_dir: Path) -> str:
    """The buffer worker id of the job's leases: unguessable (it is the credential that gives them
    back), and kept in the run directory, so a resumed run gives back what a killed one held."""
    path = run_dir / "services" / "worker_id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(f"controller-{secrets.token_urlsafe(18)}")
    return path.read_text().strip()


class Job:
    """Every running part of one ``inverted train``; ``async with Job(...)`` starts and stops them."""

    def __init__(
        self, cfg: JobConfig, router_args: list[str], sglang_args: list[str], process_setup: Callable[[str], None]
    ):
        self.cfg, self.router_args, self.sglang_args, self.process_setup = cfg, router_args, sglang_args, process_setup
        self.run_dir = Path(cfg.train.output_dir)
        self.processes: list[ManagedProcess] = []
        self.trainer: Trainer | None = None  # none with --debug-rollout-only
        self.supervisor = Supervisor(self)
        self.lora = _lora_config(cfg)  # a LoRA run's adapter: the servers serve it as the policy
        self.adapter = POLICY_ADAPTER if self.lora else None  # what every policy call names (SGLang's lora_path)
        self.engine_key = secrets.token_urlsafe(24)  # the rollout servers' admin key, and the router's
        self.router_key = secrets.token_urlsafe(24)  # /generate's, at the router and at the servers
        self.server_keys = ServerKeys(api=self.router_key, admin=self.engine_key)
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
        self.buffer_address = BufferAddress(buffer.url, api_key=key, outage_s=RESTART_WAIT_S)
        self.buffer = await self._stack.enter_async_context(self.buffer_address.client())
        self.ledger = Ledger(self.buffer)
        self.worker_id = _worker_id(self.run_dir)
        if released := await self.buffer.release(self.worker_id):  # tasks an earlier, killed run of this job held
            logger.info("gave %d tasks leased by an earlier run back to the buffer", released)

        # The servers' weight and control routes take only this key: nobody else on the network
        # can change the weights they serve (SGLang shipped those routes open, and got a CVE for it).
        # The router's worker routes take the admin key too, and its /generate (and the servers') the
        # router key: no one else can add a worker of their own to the job, or generate through it.
        servers_cfg = dataclasses.replace(
            cfg.servers,
            log_dir=str(self.run_dir / "logs"),
            admin_api_key=self.engine_key,
            router_api_key=self.router_key,
        )
        gpus = cfg.servers.rollout_num_gpus_per_engine * (0.5 if cfg.loop.colocate else 1.0)
        # Without a trainer no sync brings the adapter: the servers load it themselves.
        lora = (
            lora_argv(
                self.lora.rank,
                list(self.lora.modules),
                cfg.train.lora.lora_adapter_path if cfg.rollout.debug_rollout_only else None,
            )
            if self.lora
            else []
        )
        replay = (
            cfg.train.moe.use_rollout_routing_replay
        )  # the servers return each token's experts, the proxy keeps them
        self.servers = RolloutServers(
            servers_cfg,
            self.router_args,
            self.sglang_args,
            flags=lora + (ROUTED_EXPERTS_ARGV if replay else []),
            launch=ray_launch(
                gpus if cuda_available() else 0,
                cfg.loop.ray_address is None,
                cfg.servers.rollout_node_resource,
                cfg.servers.startup_timeout,
            ),
        )
        port, self.proxy_key = free_port(), secrets.token_urlsafe(24)
        proxy_cfg = dataclasses.replace(
            cfg.proxy,
            router_url=self.servers.router_url,
            tokenizer=cfg.train.hf_checkpoint,
            context_length=self.servers.config.context_length,
            proxy_port=port,
            proxy_api_key=self.proxy_key,
            lora_name=self.adapter,
            return_routed_experts=replay,
            router_api_key=self.router_key,
            router_admin_api_key=self.engine_key,
        )  # to list the router's workers
        proxy = spawn_service("proxy", proxy_cfg, self.run_dir, f"http://127.0.0.1:{port}")  # needs no router to boot
        self.processes.append(proxy)
        self.proxy_url = proxy.url
        trainer = [] if cfg.rollout.debug_rollout_only else [asyncio.to_thread(self._start_trainer)]
        await asyncio.gather(self.servers.start(), asyncio.to_thread(proxy.wait_healthy, timeout), *trainer)
        await self._check_sampling_masks()

    def _start_trainer(self) -> None:
        self.trainer = Trainer(
            self.cfg,
            self.process_setup,
            self.ledger,
            self.buffer_address,
            self.servers,
            self.server_keys,
            self.supervisor.heal,
        )

    async def __aexit__(self, *exc: object) -> None:
        import ray

        if hasattr(self, "buffer"):
            try:  # episodes cut short by the end of the run: their tasks go back to the queue now
                # (briefly: a buffer that is gone, a Ctrl-C took it too, is not waited for; its leases expire)
                await asyncio.wait_for(self.buffer.release(self.worker_id), STOP_WAIT_S)
            except Exception as error:  # noqa: BLE001 - stopping goes on regardless
                logger.warning("could not give the job's leased tasks back to the buffer: %s", error)
        await self._stack.aclose()
        # The trainer, the servers and the services stop side by side: none needs another at its end,
        # and each waits for its own processes to exit (the trainer's ranks, to unlink their buckets).
        stopping = [asyncio.to_thread(terminate_all, self.processes)]
        if self.trainer is not None:
            stopping.append(self.trainer.shutdown())
        if hasattr(self, "servers"):
            stopping.append(asyncio.to_thread(self.servers.stop))
        failed = [r for r in await asyncio.gather(*stopping, return_exceptions=True) if isinstance(r, BaseException)]
        if self.cfg.loop.ray_address is None:
            ray.shutdown()
        if failed:
            raise failed[0]

    # -- the weights the servers hold ------------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The weight version every rollout call is served with, as SGLang names it: the trainer's
        latest sync (``controller.trainer``), or the starting weights' ``default``."""
        return self.trainer.weight_version if self.trainer is not None else "default"

    @property
    def version(self) -> int:
        """The same as a number: the trainer's step at its latest sync (0: the starting weights)."""
        return self.trainer.version if self.trainer is not None else 0

    async def _check_sampling_masks(self) -> None:
        """Under top-p or top-k, the servers must return each token's kept set, or the ratios are biased:
        one token of one server asked for one (an SGLang without ``return_sampling_mask`` answers none)."""
        rollout = self.cfg.rollout
        if not rollout.cut_sampling:
            return
        if rollout.biased_ratios:
            logger.warning(
                "--sampling-mask-top-k 0: the rollouts sample with --rollout-top-p/--rollout-top-k and "
                "their kept sets are not recorded, so every importance ratio is biased "
                "(metrics: rollout/biased_ratios)"
            )
            return
        url = self.servers.engine_urls[0]
        async with SGLangClient.keyed(url, self.server_keys) as client:
            why = await without_sampling_masks(client)
        if why is not None:
            raise ConfigError(
                f"the rollout server at {url} returns no sampling masks (return_sampling_mask, SGLang "
                f">= 0.5.23: {why}); under --rollout-top-p/--rollout-top-k the trainer needs them for "
                "exact ratios. Use a server that returns them, or pass --sampling-mask-top-k 0 to "
                "train with biased ratios"
            )


def _lora_config(cfg: JobConfig) -> LoRAConfig | None:
    """The adapter a LoRA run trains (``peft_adapter.LoRAConfig``), None without LoRA."""
    a = cfg.train.lora
    if not a.enabled:
        return None
    from inverted.peft_adapter import lora_config  # torch: only a LoRA run pays for it here

    return lora_config(a.lora_rank, a.lora_alpha, a.lora_dropout, a.target_modules, a.lora_adapter_path)
