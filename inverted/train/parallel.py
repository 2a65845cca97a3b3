"""Process groups: one training process per GPU (or CPU worker), Megatron's parallel state on top.

``init_parallel`` reads the torchrun-style environment (``RANK``, ``WORLD_SIZE``, and for more
than one rank ``MASTER_ADDR``, ``MASTER_PORT``), opens the default group (NCCL on GPU, gloo on CPU), applies
the CPU compatibility layer when there is no CUDA, creates Megatron's TP/PP/CP/EP/DP groups, and
seeds every generator (Megatron's tracker gives TP ranks distinct model-parallel streams).
``spawn`` starts ``n`` such processes on this machine; a failure in any of them is raised here.
``host_store`` is the ranks' rendezvous, hosted on a port the kernel picks as it binds it.
``sequence_share`` is a tensor-parallel rank's share of a packed row under sequence parallelism;
``all_gathered`` every rank's tensor of a group (shards of one parameter, or of one adapter).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from inverted.train.config import ParallelConfig


def init_parallel(cfg: ParallelConfig, seed: int) -> None:
    cuda = torch.cuda.is_available()
    # Megatron warns at import that Apex and Transformer Engine are missing: expected off CUDA.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    from inverted.train import megatron_patches

    if cuda:
        megatron_patches.apply_without_te()
    else:
        megatron_patches.apply()
    if not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        torch.distributed.init_process_group(
            "nccl" if cuda else "gloo",
            rank=int(os.environ.get("RANK", "0")),
            world_size=world_size,
            store=torch.distributed.HashStore() if world_size == 1 else None,  # one rank: no port to bind
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            context_parallel_size=cfg.context_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def host_store(host: str = "127.0.0.1") -> torch.distributed.TCPStore:
    """The process group's rendezvous store, hosted by this process on a port the kernel picks as it
    binds it; the ranks reach it as clients (``AGENT_STORE``, as under torchrun, whose agent hosts it).

    Not a port drawn free for rank 0 to bind later: the ranks import Megatron first, and in those
    seconds another process took it once (EADDRINUSE). Keep the store as long as the group."""
    return torch.distributed.TCPStore(host, 0, None, True, wait_for_workers=False)


AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}  # torch's switch: every rank a client of a hosted store


def sequence_share(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's share of a packed row (split evenly along ``dim``), as Megatron's
    sequence parallelism hands each rank its part of the sequence outside attention."""
    from megatron.core import parallel_state

    shares = tensor.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=dim)
    return shares[parallel_state.get_tensor_model_parallel_rank()]


def all_gathered(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on each), in rank order; ``[tensor]`` itself in a group of one."""
    if group.size() == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def shutdown_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _keep_fds_from_children() -> None:
    """Mark this process's inherited descriptors close-on-exec.

    ``spawn`` hands a worker the write end of the pipe by which its parent learns that it ended,
    as an inheritable descriptor. torch starts a ``torch_shm_manager`` daemon on a process's first
    shared-memory tensor (weight sync's tensor transport) and that daemon outlives the worker: had
    it inherited the pipe, the parent would wait for the finished worker forever.
    """
    fd_dir = "/proc/self/fd"
    for name in os.listdir(fd_dir) if os.path.isdir(fd_dir) else []:
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the directory listing's own descriptor, already closed
                pass


def _worker(rank: int, world_size: int, port: int | None, level: int, fn: Callable[..., Any], args: tuple) -> None:
    _keep_fds_from_children()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **AGENT_STORE)
    if world_size > 1:  # a spawned process starts with no logging configuration
        logging.basicConfig(
            level=level,
            format=f"%(asctime)s [train r{rank}] %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
            force=True,
        )
        logging.getLogger("megatron").setLevel(logging.WARNING)
    fn(*args)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` local processes with the distributed environment set.

    One process runs ``fn`` right here (no extra process). ``fn`` must be importable (module level).
    """
    if world_size == 1:
        _worker(0, 1, None, logging.root.level, fn, args)
        return
    store = host_store()
    torch.multiprocessing.start_processes(
        _worker,
        args=(world_size, store.port, logging.root.level, fn, args),
        nprocs=world_size,
        start_method="spawn",
        join=True,
    )
