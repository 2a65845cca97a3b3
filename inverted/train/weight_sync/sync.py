"""One weight update, end to end: pause, open the session, stream the buckets, version, flush, continue.

``WeightSync.update(weights, version)`` runs on the trainer's sending rank. ``weights`` is a
lazy stream of full Hugging Face tensors (``convert.iter_hf_weights``: gathered over TP from the
live parameters, one at a time). The phases, each timed into the ``SyncReport``:

1. ``connect``: once per set of server processes (the distributed transport forms its group
   here); a changed set (``urls`` may be reassigned between updates), a restarted server
   included, tears the group down and forms a new one; the packing buckets are kept.
2. ``pause``: ``/pause_generation`` with ``--pause-mode`` on every server.
3. ``begin``: ``/begin_weight_update`` (tensor and distributed transports).
4. ``buckets``: packing bucket ``k+1`` (a worker thread: gather, cast, copy) overlaps sending
   bucket ``k``, except where the transport gains nothing from it on a CPU
   (``Transport.overlaps``: then one packing buffer serves every bucket, not two); the first
   bucket, with nothing to overlap, is packed inline;
   ``pack`` and ``send`` also report their own sums.
5. ``finish`` (disk: the servers load the shards), ``end``: ``/end_weight_update``.
6. ``version``: ``/update_weight_version`` to the trainer's step, without aborting anything.
7. ``flush``: ``/flush_cache`` unless the pause kept KV in place (in_place mode); a server may
   refuse while requests are queued, which is counted, not fatal (its update dropped its prefix
   cache anyway).
8. ``continue``: ``/continue_generation``.

A LoRA run replaces steps 3-5 with ``adapter``: its adapter, packed whole into one bucket, is
unloaded and loaded again under its name (``POLICY_ADAPTER`` in a job) on every server (``Transport.load_adapter``).

If anything fails after the pause, the session is ended and generation continued before the
error propagates, so a failed update never leaves servers frozen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from inverted.errors import ConfigError
from inverted.rollout.sglang_client import ServerKeys, SGLangClient
from inverted.train.weight_sync.buckets import Bucket, BucketPacker
from inverted.train.weight_sync.transports import Transport, all_servers
from inverted.types import PAUSE_MODES, POLICY_ADAPTER, PauseMode

logger = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What one update moved and how long each phase took (seconds)."""

    version: str
    transport: str
    servers: int
    buckets: int = 0
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    flushed: int = 0

    @property
    def gb_per_s(self) -> float:
        """Effective bandwidth of the bucket phase (gather + pack + send, overlapped), or of a LoRA
        run's ``adapter`` phase."""
        seconds = self.seconds.get("buckets") or self.seconds.get("adapter")
        return self.bytes / seconds / 1e9 if seconds else 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def metrics(self) -> dict[str, float]:
        """The job's ``sync/*`` metrics: what moved, and each phase's seconds as ``sync/<phase>_s``."""
        moved = {
            "servers": self.servers,
            "buckets": self.buckets,
            "bytes": self.bytes,
            "flushed": self.flushed,
            "gb_per_s": self.gb_per_s,
        }
        return {f"sync/{k}": float(v) for k, v in moved.items()} | {
            f"sync/{phase}_s": s for phase, s in self.seconds.items()
        }


def served_dtype(info: dict, checkpoint_dtype: str | None) -> torch.dtype:
    """The dtype a server holds its weights in: ``/server_info``'s ``dtype``, or for ``auto`` SGLang's rule
    (the checkpoint's half-precision dtype; a float32 checkpoint is served in bfloat16)."""
    stated = getattr(torch, str(info.get("dtype")), None)
    if isinstance(stated, torch.dtype):
        return stated
    checkpoint = getattr(torch, str(checkpoint_dtype), None)
    return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


class WeightSync:
    """Pushes the trainer's weights into every rollout server (the URLs of their SGLang endpoints)."""

    def __init__(
        self,
        transport: Transport,
        urls: list[str],
        *,
        buffer_size: int,
        pause_mode: PauseMode = "retract",
        keys: ServerKeys = ServerKeys(),
        checkpoint_dtype: str | None = None,
        adapter: dict | None = None,
        adapter_name: str = POLICY_ADAPTER,
    ):
        """``adapter``: a LoRA run's PEFT adapter_config; the weights streamed are then that adapter's,
        loaded whole as ``adapter_name`` (a job's one policy; each of a Tinker service's models its own)."""
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"--pause-mode must be one of {list(PAUSE_MODES)}, got {pause_mode!r}")
        self.transport, self.urls, self.keys = transport, list(urls), keys
        self.buffer_size, self.pause_mode, self.checkpoint_dtype = buffer_size, pause_mode, checkpoint_dtype
        self.packer: BucketPacker | None = None
        self.adapter, self.adapter_name = adapter, adapter_name
        self.connected: list[tuple[str, float | None]] = []

    def release(self) -> None:
        """Free the packing buffers (the next update allocates them again)."""
        self.packer = None
        self.transport.release()

    async def update(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncReport:
        started = time.perf_counter()
        async with AsyncExitStack() as stack:
            servers = [await stack.enter_async_context(SGLangClient.keyed(url, self.keys)) for url in self.urls]
            report = SyncReport(version=version, transport=self.transport.name, servers=len(servers))
            with report.timed("connect"):
                await self._connect(servers)
            with report.timed("pause"):
                await all_servers(s.pause_generation(self.pause_mode) for s in servers)
            began = done = False
            try:
                if self.adapter is not None:
                    with report.timed("adapter"):
                        await self._load_adapter(servers, weights, report)
                else:
                    if self.transport.needs_session:
                        with report.timed("begin"):
                            await all_servers(s.begin_weight_update() for s in servers)
                        began = True
                    with report.timed("buckets"):
                        await self._stream(servers, iter(weights), report)
                    with report.timed("finish"):
                        await self.transport.finish(servers, version)
                    if began:
                        with report.timed("end"):
                            await all_servers(s.end_weight_update() for s in servers)
                with report.timed("version"):
                    await all_servers(s.update_weight_version(version, abort_all_requests=False) for s in servers)
                if self.pause_mode != "in_place":
                    with report.timed("flush"):
                        report.flushed = sum(await asyncio.gather(*(s.flush_cache() for s in servers)))
                done = True
            finally:
                with report.timed("continue"):
                    if began and not done:  # a failed update must not leave the servers frozen
                        await asyncio.gather(*(s.end_weight_update() for s in servers), return_exceptions=True)
                    await asyncio.gather(*(s.continue_generation() for s in servers), return_exceptions=not done)
        report.seconds["total"] = time.perf_counter() - started
        logger.info(
            "weights %s -> %d servers over %s: %.1f MB in %d buckets, %.2f GB/s; %s",
            version,
            len(servers),
            report.transport,
            report.bytes / 1e6,
            report.buckets,
            report.gb_per_s,
            " ".join(f"{k}={v:.3f}s" for k, v in report.seconds.items()),
        )
        return report

    async def _connect(self, servers: list[SGLangClient]) -> None:
        """Connect to this server set, unless already connected to these very processes.

        A server is identified by URL *and* startup time, so a server restarted on the same
        port is noticed: the old group is torn down (best effort) and a new one formed.
        """
        infos = await asyncio.gather(*(s.server_info() for s in servers))
        identity = [(url, info.get("startup_time")) for url, info in zip(self.urls, infos)]
        if identity == self.connected:
            return
        if self.connected:
            async with AsyncExitStack() as stack:
                old = [await stack.enter_async_context(SGLangClient.keyed(u, self.keys)) for u, _ in self.connected]
                await self.transport.close(old)
            self.connected = []
        dtypes = {served_dtype(info, self.checkpoint_dtype) for info in infos}
        if len(dtypes) != 1:
            raise ValueError(
                f"the rollout servers hold different dtypes {sorted(map(str, dtypes))}: one update cannot fit all"
            )
        dtype = dtypes.pop()
        if self.packer is None or self.packer.dtype != dtype:
            self.packer = BucketPacker(
                self.buffer_size, self.transport.allocate, dtype, buffers=2 if self.transport.overlaps else 1
            )
        await self.transport.connect(servers, [int(info.get("tp_size", 1)) for info in infos])
        self.connected = identity

    async def _load_adapter(
        self, servers: list[SGLangClient], weights: Iterable[tuple[str, torch.Tensor]], report: SyncReport
    ) -> None:
        """The whole adapter in one bucket (SGLang loads an adapter in one request), replacing the servers' own."""
        assert self.packer is not None and self.adapter is not None
        named = list(weights)
        self.packer.capacity = sum(t.numel() for _, t in named) * self.packer.dtype.itemsize  # the buffer: this size
        with report.timed("pack"):
            (bucket,) = self.packer.pack(named)
        with report.timed("send"):
            await self.transport.load_adapter(servers, self.adapter_name, self.adapter, bucket)
        report.buckets, report.bytes = 1, bucket.nbytes

    async def _stream(self, servers: list[SGLangClient], weights: Iterator, report: SyncReport) -> None:
        """Pack bucket k+1 in a worker thread while bucket k is being sent (bucket 0 inline), or, where
        that does not pay (``Transport.overlaps``), pack and send in turn through one buffer."""
        assert self.packer is not None
        buckets = self.packer.pack(weights)

        def next_bucket() -> Bucket | None:
            started = time.perf_counter()
            bucket = next(buckets, None)
            report.add("pack", time.perf_counter() - started)
            return bucket

        async def send(bucket: Bucket) -> None:
            started = time.perf_counter()
            await self.transport.send(servers, bucket)
            report.add("send", time.perf_counter() - started)
            report.buckets += 1
            report.bytes += bucket.nbytes

        if not self.transport.overlaps:  # one buffer: each bucket is sent before the next is packed into it
            while (bucket := next_bucket()) is not None:
                await send(bucket)
            return
        sending: asyncio.Task | None = None
        try:
            # A worker thread pays only while a send runs beside it: the first bucket is packed inline.
            while (bucket := next_bucket() if sending is None else await asyncio.to_thread(next_bucket)) is not None:
                if sending is not None:
                    await sending  # its buffer is the one the next pack reuses
                sending = asyncio.create_task(send(bucket))
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()
