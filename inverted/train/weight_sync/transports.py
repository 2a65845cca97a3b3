"""Three ways a bucket reaches the rollout servers, behind one interface (``Transport``).

- ``TensorTransport`` (same node): ``/update_weights_from_tensor`` with
  ``load_format="flattened_bucket"``. The bucket buffer itself is shared: a CUDA-IPC handle on GPU,
  a shared-memory file on CPU (torch's ``file_system`` strategy, which an unrelated server process
  can open; the default ``file_descriptor`` strategy needs the sender's authkey). So the bytes are
  copied twice in all: packed into the buffer here, copied into the parameters there.
- ``DistributedTransport`` (separate GPUs or nodes): one update group with every server TP rank
  (``/init_weights_update_group``; NCCL on GPU, gloo on CPU), then per bucket one broadcast of the
  flat buffer, issued together with each server's ``/update_weights_from_distributed``.
- ``DiskTransport``: each bucket is written as one safetensors shard (a bucket *is* a safetensors
  data section: bytes back to back with byte offsets, so the buffer is written as is), then every
  server loads the directory with ``/update_weights_from_disk``.

A LoRA run sends only its adapter, whole, in one bucket (``load_adapter``): by tensor as
``/load_lora_adapter_from_tensors``, or on disk as a PEFT directory for ``/load_lora_adapter``.

Every method that talks to servers takes the ``SGLangClient`` s of this update; all servers are
addressed concurrently.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import socket
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from urllib.parse import urlparse

import torch

from inverted.errors import ConfigError
from inverted.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from inverted.processes import free_port
from inverted.rollout.sglang_client import SGLangClient
from inverted.train.shared_memory import SHARED_MEMORY
from inverted.train.weight_sync.buckets import Bucket
from inverted.weight_wire import UpdateGroup, bucket_payload, join_update_group, route_address


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Transport(ABC):
    """How buckets travel. ``connect`` once per server set; ``send`` per bucket; ``finish`` per update."""

    name: str
    needs_session = True  # tensor and distributed updates run inside begin/end_weight_update
    # Whether packing the next bucket on a worker thread, while this one is sent, pays on a CPU. The
    # worker's copies open a second OpenMP pool, which stops both pools spinning (see the engine's
    # ``server.launch``); that pays only where sending runs outside OpenMP (a gloo broadcast, a file write).
    overlaps_on_cpu = True

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def overlaps(self) -> bool:
        """Whether bucket ``k+1`` is packed while bucket ``k`` is sent (so two packing buffers are needed)."""
        return self.device.type != "cpu" or self.overlaps_on_cpu

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A packing buffer the transport can send from."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    async def connect(self, servers: list[SGLangClient], tp_sizes: list[int]) -> None:
        """Prepare for this set of servers (``tp_sizes``: each server's TP ranks)."""

    @abstractmethod
    async def send(self, servers: list[SGLangClient], bucket: Bucket) -> None: ...

    async def finish(self, servers: list[SGLangClient], version: str) -> None:
        """After the last bucket."""

    async def load_adapter(self, servers: list[SGLangClient], name: str, config: dict, bucket: Bucket) -> None:
        """Replace LoRA adapter ``name`` on every server with the one in ``bucket`` (the whole adapter):
        unload, then load, while generation is paused (``config``: PEFT's adapter_config)."""
        raise ConfigError(f"the {self.name} transport cannot send a LoRA adapter: use tensor or disk")

    async def close(self, servers: list[SGLangClient]) -> None:
        """Release what ``connect`` set up (servers may be gone)."""

    def release(self) -> None:
        """Give back what ``allocate`` took beyond this process's memory (when the trainer shuts down)."""


async def all_servers(calls) -> None:
    """Await calls to every server together; raise the first failure after all have ended."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


class TensorTransport(Transport):
    name = "tensor"
    # The server's copy out of the bucket needs the same cores and memory bandwidth (measured, 2 cores:
    # the small model's pack took 11.4 ms on a worker thread and 7.4 ms inline; the ~0.5B model's
    # bucket phase was 0.52 s either way).
    overlaps_on_cpu = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.tp_sizes: list[int] = []
        self.shared_files: list[str] = []
        self.sent: dict[int, tuple[torch.Tensor, list, str]] = {}  # CPU: bucket index -> (buffer, metadata, payload)
        if device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = super().allocate(nbytes)
        if self.device.type != "cpu":
            return buffer
        buffer.share_memory_()
        self.shared_files.append(buffer.untyped_storage()._share_filename_cpu_()[1].decode())
        return buffer

    def release(self) -> None:
        """Unlink the shared-memory bucket files. torch's shm manager does not remove them when the
        trainer is killed rather than left to exit (Ray kills its actors), and each one is a whole
        bucket (measured: 512 MiB left in /dev/shm per run); a killed trainer's are reaped by
        ``shared_memory.reap_buckets``. Mapped copies stay valid; Linux only."""
        self.sent.clear()  # first: a buffer freed after its file was unlinked makes torch abort
        for name in self.shared_files:
            (SHARED_MEMORY / name.lstrip("/")).unlink(missing_ok=True)
        self.shared_files.clear()

    async def connect(self, servers: list[SGLangClient], tp_sizes: list[int]) -> None:
        self.tp_sizes = tp_sizes

    def payload(self, bucket: Bucket) -> str:
        """The bucket's payload for one receiver.

        On a CPU, bucket k of every update comes from the same buffer with the same layout, so it is
        sent as the same string again: it names the same shared-memory file and offsets, and the
        engine has it decoded already (measured: 0.3 ms of the `small` model's update). Each string
        handed out still carries one reference to the file, as a fresh pickle would: a receiver that
        decodes it takes that reference over, and torch unlinks the file when none is left. The
        references nobody takes over are moot: ``release`` unlinks the files. A CUDA-IPC payload is
        built anew: torch gives each one its own event and reference count.
        """
        if self.device.type != "cpu":
            return bucket_payload(bucket.flat, bucket.metadata)
        buffer, metadata, payload = self.sent.get(bucket.index, (None, None, ""))
        if (
            buffer is bucket.buffer and metadata == bucket.metadata
        ):  # the packer reuses entries: compared by identity first
            bucket.buffer.untyped_storage()._shared_incref()
            return payload
        payload = bucket_payload(bucket.flat, bucket.metadata)  # pickling takes its own reference
        self.sent[bucket.index] = (bucket.buffer, bucket.metadata, payload)
        return payload

    async def send(self, servers: list[SGLangClient], bucket: Bucket) -> None:
        await all_servers(
            server.update_weights_from_tensor([self.payload(bucket) for _ in range(tp)], load_format="flattened_bucket")
            for server, tp in zip(servers, self.tp_sizes)
        )

    async def load_adapter(self, servers: list[SGLangClient], name: str, config: dict, bucket: Bucket) -> None:
        async def replace(server: SGLangClient, tp: int) -> None:
            await server.unload_lora_adapter(name, missing_ok=True)
            await server.load_lora_adapter_from_tensors(name, config, [self.payload(bucket) for _ in range(tp)])

        await all_servers(replace(server, tp) for server, tp in zip(servers, self.tp_sizes))


def address_towards(url: str) -> str:
    """This host's address on the route to ``url``'s host (loopback for a local server)."""
    return route_address(urlparse(url).hostname or "127.0.0.1")


def on_this_host(url: str) -> bool:
    """Whether ``url``'s server runs on this host: at a loopback address, or at one of this host's own
    (a server on a cluster binds its node's address, and the route to an address of ours starts from it)."""
    host = socket.gethostbyname(urlparse(url).hostname or "127.0.0.1")
    if ipaddress.ip_address(host).is_loopback:
        return True
    try:
        return route_address(host) == host
    except OSError:  # no route to it: not an address of ours
        return False


class DistributedTransport(Transport):
    name = "distributed"

    def __init__(self, device: torch.device, timeout: float = 300.0):
        super().__init__(device)
        self.timeout = timeout
        self.group: UpdateGroup | None = None
        self.group_name = ""

    async def connect(self, servers: list[SGLangClient], tp_sizes: list[int]) -> None:
        address = address_towards(servers[0].base_url)
        port = free_port(address)
        self.group_name = f"weight_update_group_{uuid.uuid4().hex[:8]}"  # fresh per server set: no stale keys
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world_size = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(servers))]
        ours = asyncio.to_thread(
            join_update_group,
            address,
            port,
            world_size,
            0,
            group_name=self.group_name,
            backend=backend,
            timeout=self.timeout,
        )
        theirs = [
            server.init_weights_update_group(
                address, port, offset, world_size, group_name=self.group_name, backend=backend
            )
            for server, offset in zip(servers, offsets)
        ]
        results = await asyncio.gather(ours, *theirs, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if isinstance(results[0], UpdateGroup):
            self.group = results[0]
        if failures:
            await self.close(servers)
            raise failures[0]

    async def send(self, servers: list[SGLangClient], bucket: Bucket) -> None:
        assert self.group is not None, "connect first"
        shapes = [list(m.shape) for m in bucket.metadata]
        dtypes = [dtype_name(m.dtype) for m in bucket.metadata]
        await all_servers(
            [asyncio.to_thread(self.group.broadcast, bucket.flat)]
            + [
                server.update_weights_from_distributed(bucket.names, dtypes, shapes, group_name=self.group_name)
                for server in servers
            ]
        )

    async def close(self, servers: list[SGLangClient]) -> None:
        # Best effort: a server that died has no group left to destroy.
        await asyncio.gather(
            *(s.destroy_weights_update_group(self.group_name) for s in servers), return_exceptions=True
        )
        if self.group is not None:
            self.group.close()
            self.group = None


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def write_safetensors_shard(path: Path, bucket: Bucket) -> None:
    """Write a bucket as a safetensors file: a JSON header, then the bucket's bytes unchanged."""
    header = {
        m.name: {"dtype": SAFETENSORS_DTYPES[m.dtype], "shape": list(m.shape), "data_offsets": [m.start_idx, m.end_idx]}
        for m in bucket.metadata
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format lets the header be space-padded; 8 keeps the data aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.write(bucket.flat.cpu().numpy().data)


class DiskTransport(Transport):
    name = "disk"
    needs_session = False  # SGLang loads from disk outside a session

    def __init__(self, device: torch.device, directory: str, config_dir: str):
        super().__init__(device)
        self.root, self.config_dir = Path(directory), Path(config_dir)
        self.current: Path | None = None
        self.previous: Path | None = None

    async def send(self, servers: list[SGLangClient], bucket: Bucket) -> None:
        if bucket.index == 0:
            self.current = self.root / f"update-{uuid.uuid4().hex[:8]}"
            self.current.mkdir(parents=True)
        assert self.current is not None, "a sync's buckets come in order"
        await asyncio.to_thread(write_safetensors_shard, self.current / f"model-{bucket.index:05d}.safetensors", bucket)

    async def finish(self, servers: list[SGLangClient], version: str) -> None:
        assert self.current is not None, "no bucket was sent"
        shutil.copy(self.config_dir / "config.json", self.current / "config.json")
        await all_servers(server.update_weights_from_disk(str(self.current), flush_cache=False) for server in servers)
        self._rotate()

    def _rotate(self) -> None:
        if self.previous is not None:  # the servers no longer need it
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous, self.current = self.current, None

    async def load_adapter(self, servers: list[SGLangClient], name: str, config: dict, bucket: Bucket) -> None:
        """The adapter as a PEFT directory (its weights file is the bucket), loaded by every server."""
        self.current = self.root / f"adapter-{uuid.uuid4().hex[:8]}"
        self.current.mkdir(parents=True)
        await asyncio.to_thread(write_safetensors_shard, self.current / WEIGHTS_FILE, bucket)
        (self.current / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

        async def replace(server: SGLangClient) -> None:
            await server.unload_lora_adapter(name, missing_ok=True)
            await server.load_lora_adapter(name, str(self.current))

        await all_servers(replace(server) for server in servers)
        self._rotate()
