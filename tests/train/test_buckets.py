"""Bucket packing and the update dtype: pure functions of the trainer's weight sync."""

from __future__ import annotations

import torch

from inverted.train.weight_sync import BucketPacker
from inverted.train.weight_sync.sync import served_dtype
from inverted.weight_wire import unflatten


def test_buckets_split_at_capacity_cast_while_packing_and_alternate_two_buffers():
    named = [(f"t{i}", torch.randn(10, 10)) for i in range(5)] + [("big", torch.randn(1000))]
    allocations = []

    def allocate(n: int) -> torch.Tensor:
        allocations.append(n)
        return torch.empty(n, dtype=torch.uint8)

    packer = BucketPacker(capacity=450, allocate=allocate, dtype=torch.bfloat16)  # two 200-byte tensors per bucket
    buckets = []
    for bucket in packer.pack(iter(named)):
        buckets.append((bucket.names, bucket.buffer.data_ptr(), [t.clone() for _, t in unflatten(bucket.flat, bucket.metadata)]))
    assert [names for names, _, _ in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["big"]]
    assert buckets[0][1] == buckets[2][1] != buckets[1][1]  # buffer k+2 reuses buffer k
    assert allocations == [450, 450, 2000]  # a tensor larger than a bucket grows its buffer once
    packed = {n: t for names, _, tensors in buckets for n, t in zip(names, tensors)}
    for name, tensor in named:
        assert packed[name].dtype == torch.bfloat16 and torch.equal(packed[name], tensor.to(torch.bfloat16))


def test_the_update_dtype_follows_the_server():
    assert served_dtype({"dtype": "float32"}, "bfloat16") is torch.float32  # the engine states what it holds
    assert served_dtype({"dtype": "auto"}, "float16") is torch.float16  # SGLang's auto: the checkpoint's half dtype
    assert served_dtype({"dtype": "auto"}, "float32") is torch.bfloat16  # ... and bf16 for an fp32 checkpoint
