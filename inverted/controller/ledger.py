"""The ledger of served batches: which batch each training step was served, so that any step can be replayed.

The buffer serves step ``s`` its batch under one request id, ``batch:s`` (``Ledger.serve``), keeps
that answer, and records once that step ``s`` trained it (``Ledger.trained``; a second step is
refused). Two things replay a step from it (``Ledger.served``), and nothing else does:

- a job resumed from a checkpoint older than its last steps: its batch source takes the batches
  the killed run was served for those steps (``Ledger.replay``), without a rollout, until a step
  finds none;
- a trainer restarted after a rank died: it trains again, in order, the batches served since the
  state it starts from.

So a served group is trained in exactly one step, whatever died.

The ledger hands out batches by reference (``BatchRef``): the driver never holds a batch's Samples
unless a plug-in of its own must see them (``samples``); the trainer's ranks read them from the
buffer by the step's request id. A step's batch is replayed with the Samples the driver's sample
filter left out of its loss (``BatchRef.removed``), as that step trained it (in this process; a
resumed job's sources run the filter again).
"""

from __future__ import annotations

import dataclasses

from inverted.buffer.client import BatchRef, BufferClient
from inverted.types import Sample


def request_id(step: int) -> str:
    """The request id under which the buffer serves training step ``step`` its batch."""
    return f"batch:{step}"


class Ledger:
    def __init__(self, buffer: BufferClient):
        self.buffer = buffer
        self._removed: dict[int, frozenset[int]] = {}  # by step: what the sample filter left out of its loss
        self._replaying = True  # until the first step the buffer served no batch for

    async def replay(self, step: int) -> BatchRef | None:
        """The batch a killed run of this job was served for ``step``, whose training the checkpoint
        the job resumed from does not hold; None from the first step that was not served on."""
        if self._replaying:
            batch = await self.served(step)
            self._replaying = batch is not None
            return batch
        return None

    async def serve(
        self,
        step: int,
        *,
        num_groups: int,
        max_weight_staleness: int | None,
        allow_partial: bool = False,
        timeout_s: float = 0.0,
    ) -> BatchRef:
        """The next complete groups, within ``max_weight_staleness`` of the policy trained at ``step``, as
        step ``step``'s batch (its earlier answer if it was served one already); empty while too few wait."""
        return await self.buffer.next_batch(
            num_groups=num_groups,
            current_weight_version=step,
            max_weight_staleness=max_weight_staleness,
            allow_partial=allow_partial,
            timeout_s=timeout_s,
            request_id=request_id(step),
        )

    async def served(self, step: int) -> BatchRef | None:
        """The batch step ``step`` was served, if it was, as the step trained it; consumes nothing."""
        served = await self.buffer.served_batch(request_id(step))
        if served is None or step not in self._removed:
            return served
        return dataclasses.replace(served, removed=self._removed[step])

    async def samples(self, batch: BatchRef) -> list[Sample]:
        """The batch's Samples (for a plug-in of the driver's that reads them: filters, logs, dumps)."""
        return await self.buffer.samples(batch)

    async def trained(self, batch: BatchRef, step: int) -> None:
        """Record that step ``step`` trained ``batch`` (the buffer refuses it for any other step)."""
        if batch.batch_id is None:  # the buffer names every batch it serves with groups
            raise ValueError(f"step {step} trained a batch the buffer did not serve")
        await self.buffer.trained(batch.batch_id, step)
        if batch.removed:
            self._removed[step] = batch.removed
