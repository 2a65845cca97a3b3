"""The trainer as a Ray actor group: one ``TrainActor`` per training rank, placed together.

``TrainGroup`` reserves one placement-group bundle per rank (a GPU each on GPU machines; a
sliver of CPU otherwise, so a small machine can hold several ranks), starts the actors, lets rank
0 pick the rendezvous address, and initialises every rank's process group and ``Trainer`` at the
same time (the rendezvous needs them all). Its methods call every rank and return rank 0's
answer: all ranks take part in training, in the tensor-parallel gathers of a weight sync and in
saving; rank 0 alone sends the weights and reports.

A call fails the moment any rank dies (``RankDied``), rather than waiting on the ranks blocked in
a collective with it; ``dead`` tells from the ranks' pids, without a call, whether one on this node
has died. The job then ``kill``s the group and starts another (``Job``'s supervision).

A killed rank leaves its shared-memory weight buckets behind (RAM, a whole bucket each): the group
reaps them when it shuts down, and each rank at start reaps those of the ranks an earlier run of
the same output directory left on its node (``trainer.pids`` there names them). The folder of the
ranks' ``torch_shm_manager``, killed with them, goes at the group's end too.

A step's batch reaches the ranks by reference (``buffer.client.BatchRef``): each rank reads its
Samples from the buffer itself (``read_samples``), so the job's driver never decodes, re-encodes
and relays them. Every rank reads the whole batch: the advantages need every group's rewards and
the data-parallel deal needs every Sample's length (``train.trainer``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from inverted.buffer.client import BatchRef, BufferAddress
from inverted.devices import cuda_available
from inverted.errors import ServiceUnavailable
from inverted.processes import alive, freeze_startup_heap
from inverted.rollout.sglang_client import ServerKeys
from inverted.train.config import TrainConfig
from inverted.train.shared_memory import reap_buckets, reap_manager_dirs, shm_managers
from inverted.types import Sample

if TYPE_CHECKING:
    from inverted.train.trainer import Trainer
    from inverted.train.weight_sync import WeightSync

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0  # for the cluster to offer every rank its bundle (nodes may still be joining)
RANK_EXIT_WAIT_S = 10.0  # for ranks just killed to exit before their buckets are reaped
PIDS_FILE = "trainer.pids"  # in the output directory: "<node ip> <pid>" per rank of the latest run


class RankDied(RuntimeError):
    """A training rank's process died: the group cannot go on (its collectives need every rank)."""


def settled(method: Callable) -> Callable:
    """A rank's method that first waits for its background save (``save_for_restart``) to end: the
    save reads the weights and optimizer state that every other call may change."""

    @functools.wraps(method)
    def wrapper(self: "TrainActor", *args: Any) -> Any:
        if self.saving is not None:
            saving, self.saving = self.saving, None
            saving.result()  # raises what the save raised
        return method(self, *args)

    return wrapper


class TrainActor:
    """One training rank: its process group, its ``Trainer`` and its weight sync."""

    trainer: Trainer | None = None  # made by setup; let go of by finish
    sync: WeightSync | None = None  # the weight sync, made on the first push (its servers known then)
    saving: Future | None = None  # the background save under way
    store: Any = None  # rank 0: the process group's rendezvous store (a TCPStore), hosted while the group lives

    @property
    def ready(self) -> Trainer:
        """The rank's trainer, which ``setup`` made."""
        if self.trainer is None:
            raise RuntimeError("this training rank is not set up, or has finished")
        return self.trainer

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 hosts the process group's store (``host_store``) and answers its address."""
        from inverted.train.parallel import host_store

        host = ray.util.get_node_ip_address()
        self.store = host_store(host)
        return host, self.store.port

    def where(self) -> tuple[str, int]:
        """This rank's node and process id."""
        return ray.util.get_node_ip_address(), os.getpid()

    def setup(self, cfg: TrainConfig, rank: int, address: tuple[str, int], process_setup: Callable[[str], None]) -> int:
        import torch

        from inverted.train.checkpoint import resume
        from inverted.train.parallel import AGENT_STORE, init_parallel
        from inverted.train.trainer import Trainer

        process_setup(f"train r{rank}")
        reap_ranks(Path(cfg.output_dir) / PIDS_FILE)
        local = ray.get_gpu_ids()
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(cfg.parallel.world_size),
            MASTER_ADDR=address[0],
            MASTER_PORT=str(address[1]),
            LOCAL_RANK="0" if local else str(rank),
            **AGENT_STORE,
        )
        if not torch.cuda.is_available():  # rollout and training alternate: a rank may use its share of the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.parallel.world_size))
        init_parallel(cfg.parallel, cfg.seed)
        self.cfg, self.rank = cfg, rank
        self.trainer = trainer = Trainer(cfg)
        if cfg.ckpt.load:
            resume(trainer, cfg.ckpt.load)
        freeze_startup_heap()
        return trainer.step

    @settled
    def train(self, batch: BatchRef, buffer: BufferAddress) -> dict[str, float]:
        return self.ready.train(read_samples(batch, buffer))

    @settled
    def skip(self, step: int) -> None:
        """A rollout with nothing to train on still counts, so checkpoints and resumes stay in step."""
        self.ready.step = step + 1

    @settled
    def sync_weights(self, urls: list[str], version: str, keys: ServerKeys | None = None) -> dict[str, float] | None:
        """``keys``: the servers' keys (their weight routes need the admin key, their info routes the other)."""
        from inverted.train.weight_sync import make_weight_sync

        if self.sync is None:
            self.sync = make_weight_sync(
                self.cfg.sync,
                self.cfg.hf_checkpoint,
                self.cfg.output_dir,
                urls,
                keys=keys or ServerKeys(),
                adapter=self.ready.adapter_config(),
            )
        # A changed server set (a replaced server, or one new server getting the current weights)
        # reuses this sync and its buckets: the servers may still map the buckets' shared memory.
        self.sync.urls = list(urls)
        report = self.ready.sync_weights(self.sync, version)
        return report.metrics() if report is not None else None

    @settled
    def save(self, root: str) -> str:
        from inverted.train.checkpoint import save_checkpoint

        return str(save_checkpoint(self.ready, root))

    @settled
    def save_for_restart(self, root: str) -> None:
        """Start saving the trainer's state into ``root`` in the background, keeping only that
        iteration there: the job calls it once a step is trained and synced, so it overlaps the next
        rollout, the rank's idle time."""
        from inverted.train.checkpoint import save_checkpoint

        def save() -> None:
            kept = save_checkpoint(self.ready, root)
            if self.rank == 0:  # every rank's file of the new iteration is written (the save's barrier)
                for old in Path(root).glob("iter_*"):
                    if old != kept:
                        shutil.rmtree(old, ignore_errors=True)

        pool = ThreadPoolExecutor(1, thread_name_prefix="restart-save")
        self.saving = pool.submit(save)
        pool.shutdown(wait=False)  # its thread ends with the save

    @settled
    def finish(self, root: str, out: str) -> str | None:
        """The rank's last call before ``shutdown``: let go of the trainer (weights, gradients, Adam's
        moments, the weight-sync buckets), then rank 0 writes the latest checkpoint under ``root`` as a
        Hugging Face model in ``out``. The export reads the saved checkpoint, not the live model, so its
        working set (the model assembled in Hugging Face's layout, safetensors' bytes of it) need not
        sit beside the training state: that was the job's peak memory."""
        import torch

        from inverted.train.export import export_hf

        self._release()
        torch.distributed.barrier()  # every rank's state is gone before rank 0 allocates the export's
        return str(export_hf(root, out)) if self.rank == 0 else None

    @settled
    def shutdown(self) -> None:
        from inverted.train.parallel import shutdown_parallel

        self._release()
        shutdown_parallel()

    def _release(self) -> None:
        if self.sync is not None:
            self.sync.release()
            self.sync = None
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
            # Megatron's gradient hooks hold the model in reference cycles, which ``setup`` froze out
            # of the collector with the rest of the start-up heap: one full collection, at the end.
            gc.unfreeze()
            gc.collect()


class TrainGroup:
    """``cfg.parallel.world_size`` ``TrainActor``s in one placement group; call like a single trainer."""

    def __init__(
        self,
        cfg: TrainConfig,
        process_setup: Callable[[str], None],
        gpu_fraction: float = 1.0,
        node: dict[str, float] | None = None,
    ) -> None:
        """``node``: custom resources each rank's node must offer (``placement.node_resource``)."""
        gpus = cuda_available()
        bundle: dict[str, float] = ({"GPU": 1.0, "CPU": 1.0} if gpus else {"CPU": 0.01}) | (node or {})
        self.group = placement_group([bundle] * cfg.parallel.world_size, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise ServiceUnavailable(
                f"no Ray node took the {cfg.parallel.world_size} training ranks within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s: each needs {bundle}; the cluster has "
                f"{ray.available_resources()} free"
            ) from None
        remote = ray.remote(TrainActor)
        self.actors: list[Any] = [  # Ray's handles: each method is called by its .remote
            remote.options(
                num_cpus=0.01 if not gpus else 1,
                num_gpus=gpu_fraction if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(cfg.parallel.world_size)
        ]
        address = ray.get(self.actors[0].rendezvous.remote())
        self.step: int = ray.get(
            [actor.setup.remote(cfg, rank, address, process_setup) for rank, actor in enumerate(self.actors)]
        )[0]
        # Named before any bucket exists (the first sync makes them), with the ranks of a killed run
        # whose processes were still exiting when the ranks reaped.
        self.pids_file = Path(cfg.output_dir) / PIDS_FILE
        self.ranks: list[tuple[str, int]] = ray.get([a.where.remote() for a in self.actors])
        write_ranks(self.pids_file, reap_ranks(self.pids_file) + self.ranks)

    def _all(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every rank at once; rank 0's answer. A rank that dies raises ``RankDied``
        at once: the others may be blocked in a collective with it, and would never answer."""
        refs = pending = [getattr(actor, method).remote(*args) for actor in self.actors]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
        except ray.exceptions.RayActorError as error:
            raise RankDied(f"a training rank died during {method}: {error}") from error
        return ray.get(refs[0])

    def dead(self) -> bool:
        """Has a rank on this node died? (Those on other nodes show when a call fails.)"""
        node = ray.util.get_node_ip_address()
        return any(ip == node and not alive(pid) for ip, pid in self.ranks)

    def train(self, batch: BatchRef, buffer: BufferAddress) -> dict[str, float]:
        """Every rank reads the batch's Samples from ``buffer`` itself: only the reference passes here."""
        return self._all("train", batch, buffer)

    def skip(self, step: int) -> None:
        self._all("skip", step)

    def sync_weights(self, urls: list[str], version: int, keys: ServerKeys | None = None) -> dict[str, float] | None:
        return self._all("sync_weights", urls, str(version), keys)

    def save(self, root: str) -> str:
        return self._all("save", root)

    def save_for_restart(self, root: str) -> None:
        """``TrainActor.save_for_restart`` on every rank: returns at once, the save goes on."""
        self._all("save_for_restart", root)

    def finish(self, root: str, out: str) -> str:
        """End training: every rank lets go of its state, then rank 0 writes the latest checkpoint under
        ``root`` as a Hugging Face model in ``out``. Only ``shutdown`` may follow."""
        return self._all("finish", root, out)

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop every rank now (a group with a dead rank), and free what the dead ones left."""
        node = ray.util.get_node_ip_address()  # Ray kills the ranks' torch_shm_managers with them
        managers = shm_managers([pid for ip, pid in self.ranks if ip == node])
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)
        write_ranks(self.pids_file, reap_ranks(self.pids_file, wait_s=RANK_EXIT_WAIT_S))
        reap_manager_dirs(managers, wait_s=RANK_EXIT_WAIT_S)


def read_samples(batch: BatchRef, buffer: BufferAddress) -> list[Sample]:
    """The batch's Samples, read from the buffer by this rank (``BufferClient.samples``)."""

    async def read() -> list[Sample]:
        async with buffer.client() as client:
            return await client.samples(batch)

    # Not asyncio.run: on Python 3.11, restoring the SIGINT handler it set formats the main task,
    # result and all (a whole batch's repr: 0.3 s for a long-context batch)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(read())
    finally:
        loop.close()


def reap_ranks(pids_file: Path, wait_s: float = 0.0) -> list[tuple[str, int]]:
    """Unlink the weight buckets that the dead ranks ``pids_file`` names left on this node; the ranks
    it names that could not be reaped here (alive after ``wait_s``, or on another node)."""

    if not pids_file.exists():
        return []
    node = ray.util.get_node_ip_address()
    ranks = [(ip, int(pid)) for ip, pid in (line.split() for line in pids_file.read_text().splitlines())]
    if reaped := reap_buckets([pid for ip, pid in ranks if ip == node], wait_s):
        logger.info("unlinked %d shared-memory weight buckets that killed trainer ranks left", reaped)
    return [(ip, pid) for ip, pid in ranks if ip != node or alive(pid)]


def write_ranks(pids_file: Path, ranks: list[tuple[str, int]]) -> None:
    pids_file.parent.mkdir(parents=True, exist_ok=True)
    pids_file.write_text("".join(f"{node} {pid}\n" for node, pid in ranks))
