"""Contract tests against SGLang's own code: its payloads into our engine, our payloads into its decoder.

Skipped (with the reason) when the sglang wheel is not installed; ``make test`` installs it.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from inverted.hf_checkpoint import checkpoint_tensors
from inverted.processes import free_port
from inverted.train.weight_sync import BucketPacker, TensorTransport
from inverted.weight_wire import bucket_layout, bucket_payload, join_update_group
from tests.contract.sglang_code import load, sglang_root

pytestmark = pytest.mark.skipif(
    sglang_root() is None, reason="sglang wheel not installed (make test installs it --no-deps)"
)

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def sgl():
    torch.multiprocessing.set_sharing_strategy("file_system")  # an unrelated process can open the shm files
    return load()


def test_a_payload_built_by_sglang_is_accepted_by_the_engine(sgl, procs, tiny_model):
    engine = procs.engine(tiny_model("qwen2")).url
    new = checkpoint_tensors(tiny_model("qwen2", seed=3))
    named = [(n, t) for n, t in sorted(new.items()) if n.startswith("model.layers.1.")]
    bucket = sgl.FlattenedTensorBucket(named_tensors=named)
    payload = sgl.MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True
    )
    assert httpx.post(engine + "/begin_weight_update", json={"selector": "all"}).json()["success"]
    response = httpx.post(
        engine + "/update_weights_from_tensor",
        timeout=60,
        json={
            "serialized_named_tensors": [payload],
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": "sglang-built",
        },
    )
    assert response.status_code == 200, response.text
    assert httpx.post(engine + "/end_weight_update", json={}).json()["success"]
    got = httpx.post(engine + "/get_weights_by_name", json={"name": NAME, "truncate_size": 3}).json()
    assert torch.equal(torch.tensor(got), new[NAME][:3])
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "sglang-built"

    # SGLang's non-bucket form (load_format null): a list of (name, tensor) pairs.
    plain = sgl.MultiprocessingSerializer.serialize([(NAME, torch.zeros_like(new[NAME]))], output_str=True)
    httpx.post(engine + "/begin_weight_update", json={})
    assert (
        httpx.post(
            engine + "/update_weights_from_tensor",
            timeout=60,
            json={"serialized_named_tensors": [plain], "flush_cache": False},
        ).status_code
        == 200
    )
    httpx.post(engine + "/end_weight_update", json={})
    assert httpx.post(engine + "/get_weights_by_name", json={"name": NAME, "truncate_size": 1}).json() == [
        [0.0] * new[NAME].shape[1]
    ]


def test_our_payload_decodes_with_sglangs_safe_unpickler(sgl):
    tensors = [("a.weight", torch.randn(4, 3)), ("a.bias", torch.randn(4))]
    (bucket,) = BucketPacker(1 << 20, TensorTransport(torch.device("cpu")).allocate, torch.float32).pack(tensors)
    decoded = sgl.MultiprocessingSerializer.deserialize(
        bucket_payload(bucket.flat, bucket.metadata)
    )  # the trainer's payload
    assert all(isinstance(m, sgl.FlattenedTensorMetadata) for m in decoded["metadata"])  # SGLang's class, not ours
    rebuilt = sgl.FlattenedTensorBucket(flattened_tensor=decoded["flattened_tensor"], metadata=decoded["metadata"])
    for (name, got), (want_name, want) in zip(rebuilt.reconstruct_tensors(), tensors):
        assert name == want_name and torch.equal(got, want)


def _sglang_receiver(payloads, values) -> None:
    """Decodes each payload with SGLang's deserializer, reads it, and lets it go, as an SGLang server does."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    sgl = load()
    while (payload := payloads.get()) is not None:
        try:
            values.put(
                sgl.MultiprocessingSerializer.deserialize(payload)["flattened_tensor"].view(torch.float32)[0].item()
            )
        except Exception as exc:  # noqa: BLE001 - the parent asserts on what went wrong
            values.put(repr(exc))


def test_a_repeated_payload_stays_decodable_by_a_receiver_that_lets_each_go(sgl):
    """Our trainer sends bucket k as the same string at every update. Each decode takes over one
    reference to the shared-memory file, and torch unlinks the file at zero: every payload handed out
    must carry its own, or the third update finds the trainer's buffer gone."""
    context = torch.multiprocessing.get_context("spawn")
    payloads, values = context.Queue(), context.Queue()
    receiver = context.Process(target=_sglang_receiver, args=(payloads, values))
    receiver.start()
    transport = TensorTransport(torch.device("cpu"))
    packer = BucketPacker(1 << 20, transport.allocate, torch.float32)

    def update(value: float) -> float | str:
        (bucket,) = packer.pack([("w", torch.full((1000,), value))])
        payloads.put(transport.payload(bucket))
        return values.get(timeout=60)

    try:
        assert [update(float(v)) for v in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        payloads.put(None)
        receiver.join(60)
        packer.buffers, packer.placed = [None, None], []  # the buffers go before their files are unlinked
        transport.release()


def test_sglangs_layout_equals_ours(sgl):
    named = [
        ("x", torch.randn(3, 5)),
        ("y", torch.randn(7).to(torch.bfloat16)),
        ("z", torch.randn(2).to(torch.bfloat16)),
    ]
    theirs = sgl.FlattenedTensorBucket(named_tensors=named)
    ours = bucket_layout([(n, t.dtype, tuple(t.shape)) for n, t in named])
    assert [(m.name, m.start_idx, m.end_idx, m.numel, m.dtype, tuple(m.shape)) for m in theirs.get_metadata()] == [
        (m.name, m.start_idx, m.end_idx, m.numel, m.dtype, tuple(m.shape)) for m in ours
    ]
    empty = sgl.FlattenedTensorBucket.empty(["x", "y"], ["float32", "bfloat16"], [[3, 5], [7]], "cpu")
    assert [(m.start_idx, m.end_idx) for m in empty.get_metadata()] == [(m.start_idx, m.end_idx) for m in ours[:2]]


def test_sglangs_update_group_and_ours_meet_and_broadcast(sgl):
    """The trainer's side (ours, rank 0) and a server's side (SGLang's init_custom_process_group, rank 1)."""
    port, received = free_port(), {}

    def server() -> None:
        group = sgl.init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=1,
            group_name="weight_update_group",
        )
        tensor = torch.zeros(6, dtype=torch.uint8)
        torch.distributed.broadcast(tensor, src=0, group=group)
        received["tensor"] = tensor

    thread = threading.Thread(target=server)
    thread.start()
    group = join_update_group("127.0.0.1", port, 2, 0, timeout=60)
    group.broadcast(torch.arange(6, dtype=torch.uint8))
    thread.join(60)
    group.close()
    assert torch.equal(received["tensor"], torch.arange(6, dtype=torch.uint8))
