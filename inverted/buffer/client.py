"""``BufferClient``: the async client of the Data Buffer service (the only code that knows its URLs).

Retries come from the shared ``HTTPService`` base, and none of them can duplicate work: every
lease and batch call carries a fresh ``request_id`` that the service records with its answer, so
a retry after a lost response replays the same tasks or the same batch; submissions are
idempotent by (group_index, index) on the service side.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from inverted.errors import PluginFailed, ProtocolError, SampleError
from inverted.http_client import HTTPService, Reply
from inverted.types import Sample, Task, fold_siblings, unfold_siblings


@dataclass(frozen=True, slots=True)
class BatchRef:
    """A served batch by reference, as the job's driver holds it: the ``request_id`` it was served
    under (by which the trainer's ranks read its Samples, ``BufferClient.batch``), its id, and each
    group's size and staleness. ``removed``: the Samples (positions in the batch's order) that the
    driver's ``--rollout-sample-filter-path`` left out of the loss."""

    request_id: str
    batch_id: str | None
    sizes: tuple[int, ...]
    staleness: tuple[int, ...]
    removed: frozenset[int] = frozenset()

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)


@dataclass(slots=True)
class Batch:
    """A served batch with its Samples (a task's fan-out as Samples of their own)."""

    batch_id: str | None
    groups: list[list[Sample]]
    staleness: list[int]

    @property
    def samples(self) -> list[Sample]:
        return [s for group in self.groups for s in group]


def read_batch(content: bytes) -> Batch:
    """A batch as the service answers one with its Samples (``GET /batches/{request_id}``)."""
    data = orjson.loads(content)
    groups = [unfold_siblings([Sample.from_json(s) for s in g]) for g in data["groups"]]
    return Batch(data["batch_id"], groups, data["staleness"])


def read_ref(content: bytes, request_id: str) -> BatchRef:
    """A batch as the service answers one by reference (``samples: false``)."""
    data = orjson.loads(content)
    return BatchRef(request_id, data["batch_id"], tuple(data["sizes"]), tuple(data["staleness"]))


@dataclass(frozen=True, slots=True)
class BufferAddress:
    """Where another process reaches the buffer (a trainer rank reads its batches there)."""

    url: str
    api_key: str | None = None
    outage_s: float = 0.0  # how long its calls wait out a buffer restarted at its address

    def client(self) -> BufferClient:
        return BufferClient(self.url, api_key=self.api_key, outage_s=self.outage_s)


class BufferClient(HTTPService):
    async def request(self, *args: Any, **kwargs: Any) -> Reply:
        """``HTTPService.request``; a plug-in's failure inside the service is raised here as the
        ``PluginFailed`` it was there (its flag, path and traceback), not as a bare status 500."""
        try:
            return await super().request(*args, **kwargs)
        except ProtocolError as exc:
            try:
                error = orjson.loads(exc.body)["error"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise exc from None
            if error.get("type") == "plugin_error":
                raise PluginFailed(f"in the Data Buffer service: {error['message']}") from None
            raise

    async def health(self) -> bool:
        return await self.probe("/health", self.timeouts.health)

    async def lease(self, count: int, worker_id: str, lease_seconds: float | None = None) -> list[Task]:
        body = {"count": count, "worker_id": worker_id, "lease_seconds": lease_seconds, "request_id": uuid.uuid4().hex}
        response = await self.request(
            "POST", "/tasks/lease", json_body=body, timeout=self.timeouts.data, idempotent=True
        )
        return [Task.from_json(t) for t in orjson.loads(response.content)["tasks"]]

    async def release(self, worker_id: str) -> int:
        """Give back every task ``worker_id`` holds (they are leased again, to anyone)."""
        response = await self.request(
            "POST", "/tasks/release", json_body={"worker_id": worker_id}, timeout=self.timeouts.data, idempotent=True
        )
        return self.json_of(response)["released"]

    async def submit(self, items: list[tuple[Task | str, Sample]]) -> dict[str, Any]:
        """Submit finished (or aborted) samples, each with the lease of its task; all or nothing. Several
        Samples of one task (a fan-out, its own first) are stored together (``types.fold_siblings``)."""
        tasks: dict[tuple[str, int | None, int | None], list[Sample]] = {}
        for task, sample in items:
            lease_id = task if isinstance(task, str) else task.lease_id
            tasks.setdefault((lease_id, sample.group_index, sample.index), []).append(sample)
        body = {
            "samples": [
                {"lease_id": lease_id, "sample": fold_siblings(samples).to_json()}
                for (lease_id, *_), samples in tasks.items()
            ]
        }
        response = await self.request(
            "POST", "/samples", content=orjson.dumps(body), timeout=self.timeouts.data, idempotent=True
        )
        return self.json_of(response)

    async def next_batch(
        self,
        *,
        num_groups: int | None = None,
        num_samples: int | None = None,
        current_weight_version: int | None = None,
        max_weight_staleness: int | None = None,
        timeout_s: float = 0.0,
        allow_partial: bool = False,
        request_id: str | None = None,
    ) -> BatchRef:
        """Complete groups, oldest first, by reference (``batch`` reads their Samples); waits up to
        ``timeout_s`` for enough of them (empty on time-out).

        A ``request_id`` that was answered with a batch before is answered with that batch again
        (fresh by default; the job names each step's batch, so a resumed job gets it back).
        """
        request_id = request_id or uuid.uuid4().hex
        body = {
            "num_groups": num_groups,
            "num_samples": num_samples,
            "current_weight_version": current_weight_version,
            "max_weight_staleness": max_weight_staleness,
            "timeout_s": timeout_s,
            "allow_partial": allow_partial,
            "request_id": request_id,
            "samples": False,
        }
        response = await self.request(
            "POST", "/batches/next", json_body=body, timeout=timeout_s + self.timeouts.data, idempotent=True
        )
        return read_ref(response.content, request_id)

    async def served_batch(self, request_id: str) -> BatchRef | None:
        """The batch served under ``request_id`` before (a step of a job that died), by reference, or
        None; consumes nothing."""
        content = await self._served(request_id, samples=False)
        return None if content is None else read_ref(content, request_id)

    async def batch(self, request_id: str) -> Batch | None:
        """The batch served under ``request_id`` with its Samples, or None if none was; consumes nothing."""
        content = await self._served(request_id, samples=True)
        return None if content is None else read_batch(content)

    async def samples(self, batch: BatchRef) -> list[Sample]:
        """The Samples of a batch served by reference, those its ``removed`` names marked out of the loss
        (``remove_sample``); none for an empty batch."""
        if not batch.sizes:
            return []
        served = await self.batch(batch.request_id)
        if served is None:  # the buffer keeps every batch it served under its request id
            raise SampleError(f"the buffer at {self.base_url} holds no batch served under {batch.request_id!r}")
        samples = served.samples
        for position in batch.removed:
            samples[position].remove_sample = True
        return samples

    async def _served(self, request_id: str, *, samples: bool) -> bytes | None:
        try:
            response = await self.request(
                "GET",
                f"/batches/{request_id}",
                params={"samples": "true" if samples else "false"},
                timeout=self.timeouts.data,
                idempotent=True,
            )
        except ProtocolError as error:
            if error.status == 404:
                return None
            raise
        return response.content

    async def trained(self, batch_id: str, step: int) -> int:
        """Record that training step ``step`` trained the batch; how many groups it held."""
        response = await self.request(
            "POST",
            f"/batches/{batch_id}/trained",
            json_body={"step": step},
            timeout=self.timeouts.data,
            idempotent=True,
        )
        return self.json_of(response)["groups"]

    async def stats(self) -> dict[str, Any]:
        return self.json_of(await self.request("GET", "/stats", timeout=self.timeouts.control, idempotent=True))
