"""Packing a stream of named tensors into flattened buckets, alternating two buffers.

A bucket is one 1-D ``uint8`` buffer holding its tensors' bytes back to back, in SGLang's
``FlattenedTensorBucket`` layout (``weight_wire``). Each tensor is cast to the servers' dtype
*while* it is copied in (one copy, no temporary), so a bucket holds one dtype and every offset
is aligned.

Two buffers take turns: while the transport sends bucket ``k`` from one, bucket ``k+1`` is
packed into the other. The caller (``sync.WeightSync``) waits for bucket ``k``'s send before it
asks for bucket ``k+2``, which reuses that buffer. A tensor larger than the buffer size grows
that buffer once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from inverted.weight_wire import FlattenedTensorMetadata


@dataclass(slots=True)
class Bucket:
    """Tensors packed back to back in ``buffer[:nbytes]``, described by SGLang's metadata."""

    buffer: torch.Tensor
    metadata: list[FlattenedTensorMetadata]
    index: int

    @property
    def nbytes(self) -> int:
        return self.metadata[-1].end_idx

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @property
    def dtype(self) -> torch.dtype:
        return self.metadata[0].dtype


class BucketPacker:
    """``pack(named)`` yields buckets of at most ``capacity`` bytes (more only for one larger tensor)."""

    def __init__(self, capacity: int, allocate: Callable[[int], torch.Tensor], dtype: torch.dtype):
        self.capacity, self.allocate, self.dtype = capacity, allocate, dtype
        self.buffers: list[torch.Tensor | None] = [None, None]

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        current = self.buffers[slot]
        if current is None or current.numel() < nbytes:
            self.buffers[slot] = current = self.allocate(max(nbytes, self.capacity))
        return current

    def pack(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Copy each tensor in as it arrives (nothing waits in a list); yield a bucket when the next one would overflow it."""
        metadata: list[FlattenedTensorMetadata] = []
        buffer, offset, index = None, 0, 0
        for name, tensor in named:
            nbytes = tensor.numel() * self.dtype.itemsize
            if metadata and offset + nbytes > self.capacity:
                yield Bucket(buffer, metadata, index)
                metadata, offset, index = [], 0, index + 1
            if not metadata:
                buffer = self._buffer(index % 2, nbytes)
            meta = FlattenedTensorMetadata(name, tensor.shape, self.dtype, offset, offset + nbytes, nbytes)
            with torch.no_grad():
                buffer[offset : offset + nbytes].view(self.dtype).view(tensor.shape).copy_(tensor)
            metadata.append(meta)
            offset += nbytes
        if metadata:
            yield Bucket(buffer, metadata, index)
