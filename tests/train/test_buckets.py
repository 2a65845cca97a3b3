"""Bucket packing and the update dtype: pure functions of the trainer's weight sync."""

from __future__ import annotations

import pytest
import torch

from inverted.errors import ModelError
from inverted.train.weight_sync import BucketPacker, TensorTransport
from inverted.train.weight_sync.sync import served_dtype
from inverted.weight_wire import non_finite, unflatten


def test_buckets_split_at_capacity_cast_while_packing_and_alternate_two_buffers():
    named = [(f"t{i}", torch.randn(10, 10)) for i in range(5)] + [("big", torch.randn(1000))]
    allocations = []

    def allocate(n: int) -> torch.Tensor:
        allocations.append(n)
        return torch.empty(n, dtype=torch.uint8)

    packer = BucketPacker(capacity=450, allocate=allocate, dtype=torch.bfloat16)  # two 200-byte tensors per bucket
    buckets = []
    for bucket in packer.pack(iter(named)):
        buckets.append(
            (bucket.names, bucket.buffer.data_ptr(), [t.clone() for _, t in unflatten(bucket.flat, bucket.metadata)])
        )
    assert [names for names, _, _ in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["big"]]
    assert buckets[0][1] == buckets[2][1] != buckets[1][1]  # buffer k+2 reuses buffer k
    assert allocations == [450, 450, 2000]  # a tensor larger than a bucket grows its buffer once
    packed = {n: t for names, _, tensors in buckets for n, t in zip(names, tensors)}
    for name, tensor in named:
        assert packed[name].dtype == torch.bfloat16 and torch.equal(packed[name], tensor.to(torch.bfloat16))


def test_a_repeated_stream_lands_where_it_did_and_a_changed_one_is_laid_out_afresh():
    """Each update streams the same names and shapes: the packer reuses its layout, the tensor transport
    its payload; the bytes packed are always the new values, and a changed stream gets a new layout."""
    transport = TensorTransport(torch.device("cpu"))
    packer = BucketPacker(
        capacity=450, allocate=transport.allocate, dtype=torch.float32
    )  # two 200-byte tensors per bucket

    def update(shapes: list[tuple[int, ...]]) -> list[tuple[list, str, dict[str, torch.Tensor]]]:
        named = [(f"t{i}", torch.randn(shape)) for i, shape in enumerate(shapes)]
        buckets = []
        for bucket in packer.pack(iter(named)):
            packed = {n: t.clone() for n, t in unflatten(bucket.flat, bucket.metadata)}
            buckets.append((list(bucket.metadata), transport.payload(bucket), packed))
        for name, tensor in named:
            assert torch.equal(next(p[name] for _, _, p in buckets if name in p), tensor)
        return buckets

    try:
        first, again = update([(10, 5)] * 5), update([(10, 5)] * 5)
        for (meta, payload, _), (meta2, payload2, _) in zip(first, again, strict=True):
            assert all(a is b for a, b in zip(meta, meta2, strict=True)) and payload2 is payload
        changed = update([(10, 5), (5, 10), (10, 5), (20, 5), (10, 5)])  # same sizes from t1 on, other shapes
        assert [[m.name for m in meta] for meta, _, _ in changed] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
        assert changed[0][0][0] is first[0][0][0] and changed[0][0][1] is not first[0][0][1]
        assert list(changed[0][0][1].shape) == [5, 10] and changed[0][1] != first[0][1]
    finally:
        packer.buffers, packer.placed = [None, None], []  # the buffers go before their files are unlinked
        transport.release()


def test_the_update_dtype_follows_the_server():
    assert served_dtype({"dtype": "float32"}, "bfloat16") is torch.float32  # the engine states what it holds
    assert served_dtype({"dtype": "auto"}, "float16") is torch.float16  # SGLang's auto: the checkpoint's half dtype
    assert served_dtype({"dtype": "auto"}, "float32") is torch.bfloat16  # ... and bf16 for an fp32 checkpoint


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_trainer_whose_weights_hold_nan_or_inf_sends_none_of_them(value):
    """The audit sent NaN weights and the engine took them (greedy output collapsed to one token)."""
    named = [("fine", torch.randn(4, 4)), ("poisoned", torch.randn(4, 4)), ("after", torch.randn(4))]
    named[1][1][2, 3] = value
    packer = BucketPacker(capacity=1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8), dtype=torch.bfloat16)
    with pytest.raises(ModelError, match=r"NaN or inf values, which no server is sent: \['poisoned'\]"):
        list(packer.pack(named))
    named[1][1][2, 3] = 1e38  # large but finite: sent
    assert [b.names for b in packer.pack(named)] == [["fine", "poisoned", "after"]]


def test_finite_half_precision_weights_whose_sum_exceeds_fp16s_range_are_finite():
    assert non_finite([("embed", torch.ones(100_000, dtype=torch.float16))]) == []
    assert non_finite({"x": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), "ids": torch.arange(3)}) == ["x"]
