"""Our transcription of Tinker's protobuf schema (``tinker/wire.py``) against the SDK's own descriptors and codecs."""

from __future__ import annotations

import numpy as np
import pytest

from inverted.tinker import wire

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as theirs  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402


def shape(f) -> tuple:
    return (
        f.name,
        f.type,
        f.is_repeated,
        f.message_type.full_name if f.message_type else None,
        f.enum_type.full_name if f.enum_type else None,
        f.containing_oneof.name if f.containing_oneof else None,
    )


def test_every_declared_field_is_the_sdk_s():
    ours = wire._POOL.FindFileByName("inverted_tinker_public.proto")
    for name, message in ours.message_types_by_name.items():
        sdk = theirs.DESCRIPTOR.message_types_by_name[name]
        for field in message.fields:
            assert shape(field) == shape(sdk.fields_by_number[field.number]), (name, field.name)
    for name, enum in ours.enum_types_by_name.items():
        assert [(v.name, v.number) for v in enum.values] == [
            (v.name, v.number) for v in theirs.DESCRIPTOR.enum_types_by_name[name].values
        ]


def test_a_request_the_sdk_encodes_reads_back_exactly():
    dense = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": np.array([6, 7, 8], np.int64),
            "weights": np.array([0.0, 0.5, 1.0], np.float32),
        },
    )
    sparse = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]
        ),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4], np.int64),
            "advantages": types.TensorData(
                data=[0.5, -1.0], dtype="float32", shape=[1, 3], sparse_crow_indices=[0, 2], sparse_col_indices=[0, 2]
            ),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[dense, sparse], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    read = wire.read_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (read.model_id, read.seq_id, read.loss_fn, read.config) == (
        "s:train:0",
        3,
        "ppo",
        {"clip_low_threshold": 0.7},
    )
    np.testing.assert_array_equal(read.data[0].tokens, [5, 6, 7])
    np.testing.assert_array_equal(read.data[0].inputs["weights"], [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(read.data[1].tokens, [1, 2, 3])
    np.testing.assert_array_equal(read.data[1].inputs["advantages"], [[0.5, 0.0, -1.0]])


def test_results_read_back_by_the_sdk():
    out = wire.forward_backward_output(
        [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.array([-3.0], np.float32)}],
        {"loss:sum": 6.0},
    )
    decoded = deserialize_forward_backward_output(out)
    assert decoded.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    top = (np.array([[4, 5]], np.int32), np.array([[-0.5, -1.5]], np.float32))
    sampled = wire.sample_response(
        [wire.Sequence([4], [-0.5], True, top), wire.Sequence([9, 2], [-1.0, -2.0], False)], [None, -0.25], None, 1
    )
    decoded = deserialize_sample_response(sampled)
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert [list(s.tokens) for s in decoded.sequences] == [[4], [9, 2]]
    assert decoded.prompt_logprobs == [None, -0.25] and decoded.prompt_cache_hit_tokens == 1
    assert decoded.sequences[0].topk_logprobs is not None


def test_malformed_bodies_are_wire_errors():
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.read_forward_backward(b"\xff\xff\xff")
    request = wire.Message["ForwardBackwardRequest"](model_id="m", seq_id=1, loss_fn="cross_entropy")
    request.data.add().model_input.add().encoded_text.tokens = b"\x01\x02\x03"  # not whole int32s
    with pytest.raises(wire.WireError, match="whole int32"):
        wire.read_forward_backward(request.SerializeToString())
