"""SGLang's weight formats as ``weight_wire`` writes and reads them: layouts, payloads, the allowlist."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from inverted import weight_wire
from inverted.errors import InvalidRequest
from inverted.weight_wire import (
    FlattenedTensorMetadata,
    LocalSerializedTensor,
    bucket_layout,
    bucket_payload,
    deserialize,
    parse_dtype,
    serialize,
    unflatten,
)


def test_layout_is_bytes_back_to_back_and_refuses_unaligned_offsets():
    layout = bucket_layout([("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (5,)), ("c", torch.bfloat16, (1,))])
    assert [(m.start_idx, m.end_idx, m.numel) for m in layout] == [(0, 24, 24), (24, 34, 10), (34, 36, 2)]
    with pytest.raises(InvalidRequest, match="Unaligned received tensor b"):
        bucket_layout([("a", torch.bfloat16, (3,)), ("b", torch.float32, (1,))])
    with pytest.raises(InvalidRequest, match="Negative dimension"):
        bucket_layout([("a", torch.float32, (2, -1))])
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(InvalidRequest, match="torch attribute name"):
        parse_dtype("torch.bfloat16")  # SGLang's getattr(torch, ...) refuses it too


def test_a_bucket_round_trips_through_shared_memory_under_sglang_names():
    torch.multiprocessing.set_sharing_strategy("file_system")
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    layout = bucket_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    flat = torch.empty(layout[-1].end_idx, dtype=torch.uint8).share_memory_()
    for name, view in unflatten(flat, layout):
        view.copy_(tensors[name])
    payload = bucket_payload(flat, layout)
    raw = base64.b64decode(payload)
    assert b"sglang.srt.weight_sync.tensor_bucket" in raw and b"FlattenedTensorMetadata" in raw
    assert b"inverted" not in raw  # real SGLang could not resolve our module
    assert b"rebuild_storage_filename" in raw  # a shared-memory file, not the bytes
    assert len(payload) < 2000
    decoded = deserialize(payload)
    assert all(isinstance(m, FlattenedTensorMetadata) for m in decoded["metadata"])
    for name, view in unflatten(decoded["flattened_tensor"], decoded["metadata"]):
        assert torch.equal(view, tensors[name])


def test_the_cuda_ipc_rebuild_travels_under_sglangs_name():
    """A CUDA tensor pickles as (rebuild function, IPC handle); the function must carry SGLang's name,
    which real SGLang and our allowlist resolve. (Functions bypass ``save_global`` overrides in the
    pure-Python pickler: this failed on a GPU before it was caught.)"""
    raw = base64.b64decode(serialize([weight_wire._rebuild_cuda_tensor_by_uuid]))
    assert b"sglang.srt.utils.patch_torch" in raw and b"_rebuild_cuda_tensor_modified" in raw
    assert b"inverted" not in raw
    assert deserialize(base64.b64encode(raw).decode()) == [weight_wire._rebuild_cuda_tensor_by_uuid]


def test_a_bucket_payload_reuses_the_pickle_of_an_unchanged_layout_only():
    torch.multiprocessing.set_sharing_strategy("file_system")
    first = bucket_layout([("w", torch.float32, (2, 4)), ("b", torch.float32, (4,)), ("v", torch.float32, (2, 4))])
    flat = torch.arange(first[-1].end_idx, dtype=torch.uint8).share_memory_()
    reused = weight_wire._pickled_metadata.cache_info().hits
    decoded = [deserialize(bucket_payload(flat, first)) for _ in range(2)]
    assert weight_wire._pickled_metadata.cache_info().hits == reused + 1
    for got in decoded:  # the spliced parts decode together: the tensor's memo slots do not leak into the metadata's
        assert got["metadata"] == first and torch.equal(got["flattened_tensor"], flat)
    second = bucket_layout([("w", torch.float32, (4, 2)), ("b", torch.float32, (2,)), ("v", torch.float32, (2, 5))])
    assert deserialize(bucket_payload(flat, second))["metadata"] == second  # a changed layout is pickled anew


def test_by_value_pickles_and_per_rank_tensors_are_accepted():
    plain = base64.b64encode(pickle.dumps([("x", torch.arange(4.0))])).decode()  # what real SGLang also accepts
    [(name, value)] = deserialize(plain)
    assert name == "x" and torch.equal(value, torch.arange(4.0))
    raw = pickle.dumps([("y", torch.ones(2))])
    assert torch.equal(deserialize(raw)[0][1], torch.ones(2))  # raw pickle bytes, SGLang's bytes normalisation
    per_rank = deserialize(serialize([("z", LocalSerializedTensor(values=[serialize(torch.full((2,), 7.0))]))]))
    assert torch.equal(per_rank[0][1].get(0), torch.full((2,), 7.0))


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize(
    "payload, message",
    [
        (base64.b64encode(pickle.dumps(Evil())).decode(), "builtins.print is not allowed"),
        (base64.b64encode(pickle.dumps(io.BytesIO)).decode(), "_io.BytesIO is not allowed"),
        ("not base64!", "not valid base64"),
        (base64.b64encode(pickle.dumps([("x", torch.ones(3))])[:-9]).decode(), "cannot decode the payload"),
    ],
)
def test_anything_but_tensors_and_containers_is_refused(payload, message, capsys):
    with pytest.raises(InvalidRequest, match=message):
        deserialize(payload)
    assert "pwned" not in capsys.readouterr().out


def reduce_call(module: str, name: str, argument: int) -> bytes:
    """A pickle of ``module.name(argument)``: a global, one int, one call (what the audit sent, in ~40 bytes)."""
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.GLOBAL
        + f"{module}\n{name}\n".encode()
        + pickle.BININT
        + argument.to_bytes(4, "little")
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


@pytest.mark.parametrize(
    "module, name",
    [
        ("builtins", "bytearray"),
        ("builtins", "bytes"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "FloatStorage"),
    ],
)
def test_a_payload_cannot_allocate_by_size_before_any_check(module, name):
    """40 bytes asking for a 1 GiB buffer are refused before anything is allocated: the process's peak
    resident memory does not move."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidRequest, match="may not make a .* of a given size"):
        deserialize(reduce_call(module, name, 2**30))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: far under 1 GiB


def test_file_descriptor_sharing_is_refused_with_a_fix():
    from multiprocessing.reduction import ForkingPickler

    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(torch.ones(8))
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    with pytest.raises(InvalidRequest, match="set_sharing_strategy\\('file_system'\\)"):
        deserialize(buf.getvalue())


def test_malformed_bucket_metadata_is_refused():
    flat = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(InvalidRequest, match="does not hold"):
        unflatten(flat, [FlattenedTensorMetadata("a", torch.Size([8]), torch.float32, 0, 32, 32)])
    with pytest.raises(InvalidRequest, match="1-D uint8"):
        unflatten(torch.zeros(4), [])
