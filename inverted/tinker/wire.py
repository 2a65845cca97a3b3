"""Tinker's protobuf messages, written here from the SDK's schema, and what they mean to us.

The SDK (``tinker`` 0.38.0) sends ``forward_backward`` as a protobuf ``ForwardBackwardRequest`` and
asks for two results as protobuf: ``ForwardBackwardOutput`` and ``SampleResponse``. Their schema is
``tinker_public.proto`` (package ``tinker_public``); this module declares the part of it we speak,
field for field, as a descriptor built in Python (no ``protoc``, no generated code), and
``tests/tinker/test_wire.py`` holds every declared field equal to the SDK's own descriptor.

- ``read_forward_backward(body) -> FwdBwdRequest``: datums as numpy (tokens from int32 bytes, loss
  inputs dense or sparse CSR), or ``WireError`` naming what is malformed.
- ``forward_backward_output(...)`` and ``sample_response(...)``: the result bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from inverted.errors import InvertedError

PACKAGE = "tinker_public"

# field types and labels (descriptor.proto's numbers)
DOUBLE, FLOAT, INT64, UINT64, INT32, BOOL, STRING, MESSAGE, BYTES, UINT32, ENUM = 1, 2, 3, 4, 5, 8, 9, 11, 12, 13, 14
ONE, MANY = 1, 3

# name: [(number, name, type, label, message or enum type, oneof)]; a oneof named "_x" is proto3's
# ``optional`` (presence), any other a real oneof. Maps are a nested ``<Name>Entry`` of key and value.
SCHEMA: dict[str, list[tuple]] = {
    "SampleResponse": [
        (1, "sequences", MESSAGE, MANY, "SampledSequence", None),
        (2, "prompt_logprobs", BYTES, ONE, None, "_prompt_logprobs"),
        (3, "topk_prompt_logprobs", MESSAGE, ONE, "TopkLogprobs", "_topk_prompt_logprobs"),
        (4, "prompt_cache_hit_tokens", INT32, ONE, None, None),
    ],
    "SampledSequence": [
        (1, "stop_reason", ENUM, ONE, "StopReason", None),
        (2, "tokens", BYTES, ONE, None, None),
        (3, "logprobs", BYTES, ONE, None, "_logprobs"),
        (4, "topk_sampled_logprobs", MESSAGE, ONE, "TopkLogprobs", "_topk_sampled_logprobs"),
    ],
    "TopkLogprobs": [
        (1, "token_ids", BYTES, ONE, None, None),
        (2, "logprobs", BYTES, ONE, None, None),
        (3, "k", UINT32, ONE, None, None),
        (4, "length", UINT32, ONE, None, None),
    ],
    "SparseCsr": [
        (1, "values", BYTES, ONE, None, None),
        (2, "crow_indices", BYTES, ONE, None, None),
        (3, "col_indices", BYTES, ONE, None, None),
    ],
    "Tensor": [
        (1, "dense", BYTES, ONE, None, "encoding"),
        (2, "sparse_csr", MESSAGE, ONE, "SparseCsr", "encoding"),
        (3, "dtype", ENUM, ONE, "DType", None),
        (4, "shape", INT64, MANY, None, None),
    ],
    "BatchedTensor": [
        (1, "data", BYTES, ONE, None, None),
        (2, "offsets", BYTES, ONE, None, None),
        (3, "dtype", ENUM, ONE, "DType", None),
        (4, "trailing_shape", INT64, MANY, None, None),
    ],
    "ArrayRecord": [
        (1, "type_tag", STRING, ONE, None, None),
        (2, "fields", MESSAGE, MANY, {"BatchedTensor"}, None),
        (3, "num_datums", INT64, ONE, None, None),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", STRING, ONE, None, None),
        (2, "loss_fn_outputs", MESSAGE, MANY, "ArrayRecord", None),
        (3, "metrics", MESSAGE, MANY, {DOUBLE}, None),
    ],
    "ForwardBackwardRequest": [
        (1, "model_id", STRING, ONE, None, None),
        (2, "seq_id", INT32, ONE, None, None),
        (3, "data", MESSAGE, MANY, "Datum", None),
        (4, "loss_fn", STRING, ONE, None, None),
        (5, "loss_fn_config", MESSAGE, MANY, {DOUBLE}, None),
        (6, "forward_only", BOOL, ONE, None, None),
        (7, "loss_fn_config_v2", MESSAGE, MANY, {"LossConfigValue"}, None),
    ],
    "LossConfigValue": [(1, "number", DOUBLE, ONE, None, "value"), (2, "text", STRING, ONE, None, "value")],
    "Datum": [(1, "model_input", MESSAGE, MANY, "Chunk", None), (2, "loss_fn_inputs", MESSAGE, MANY, {"Tensor"}, None)],
    "Chunk": [
        (1, "encoded_text", MESSAGE, ONE, "EncodedTextChunk", "chunk"),
        (2, "image", MESSAGE, ONE, "ImageChunk", "chunk"),
    ],
    "EncodedTextChunk": [(1, "tokens", BYTES, ONE, None, None)],
    "ImageChunk": [(1, "data", BYTES, ONE, None, None), (2, "format", STRING, ONE, None, None)],
}
ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}
DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # DType -> numpy (bfloat16 never comes from the SDK)
FLOAT32, INT64_DTYPE = 1, 2


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="inverted_tinker_public.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in SCHEMA.items():
        message = proto.message_type.add(name=name)
        oneofs: list[str] = []
        for number, field_name, kind, label, type_name, oneof in fields:
            f = message.field.add(name=field_name, number=number, type=kind, label=label)
            if isinstance(type_name, set):  # a map: its entry type, key string
                (value,) = type_name
                entry = message.nested_type.add(name=f"{''.join(p.title() for p in field_name.split('_'))}Entry")
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, type=STRING, label=ONE)
                v = entry.field.add(
                    name="value", number=2, type=MESSAGE if isinstance(value, str) else value, label=ONE
                )
                if isinstance(value, str):
                    v.type_name = f".{PACKAGE}.{value}"
                f.type_name = f".{PACKAGE}.{name}.{entry.name}"
            elif type_name:
                f.type_name = f".{PACKAGE}.{type_name}"
            if oneof:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    message.oneof_decl.add(name=oneof)
                f.oneof_index = oneofs.index(oneof)
                f.proto3_optional = oneof.startswith("_")
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
FILE = _file()
Message = {name: message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in SCHEMA}


class WireError(InvertedError):
    """A request body that is not what the protocol says (the caller's error)."""


@dataclass(slots=True)
class Datum:
    """One training example: its input tokens and its loss inputs by name (``target_tokens``, ``weights``, ...)."""

    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(message, name: str) -> np.ndarray:
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"loss input {name!r}: unsupported dtype {message.dtype}")
    shape = [int(s) for s in message.shape]
    try:
        if message.WhichOneof("encoding") == "sparse_csr":
            csr = message.sparse_csr
            values = np.frombuffer(csr.values, dtype)
            crow, col = np.frombuffer(csr.crow_indices, np.int64), np.frombuffer(csr.col_indices, np.int64)
            if (
                len(shape) != 2
                or len(crow) != shape[0] + 1
                or len(col) != len(values)
                or (len(col) and (col.min() < 0 or col.max() >= shape[1]))
                or crow[-1] != len(values)
            ):
                raise WireError(f"loss input {name!r}: a sparse CSR tensor that does not fit its shape {shape}")
            dense = np.zeros(shape, dtype)
            dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
            return dense
        array = np.frombuffer(message.dense, dtype)
        return array.reshape(shape) if shape else array
    except ValueError as exc:
        raise WireError(f"loss input {name!r}: {exc}") from None


def read_forward_backward(body: bytes) -> FwdBwdRequest:
    request = Message["ForwardBackwardRequest"]()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict[str, float | str] = dict(request.loss_fn_config)
    config |= {
        k: getattr(v, v.WhichOneof("value")) for k, v in request.loss_fn_config_v2.items() if v.WhichOneof("value")
    }
    data = []
    for number, datum in enumerate(request.data):
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(
                    f"datum {number}: only text chunks (encoded_text) are served, not {chunk.WhichOneof('chunk')}"
                )
            if len(chunk.encoded_text.tokens) % 4:
                raise WireError(f"datum {number}: token bytes are not whole int32 values")
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        inputs = {name: _tensor(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(Datum(np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64), inputs))
    return FwdBwdRequest(request.model_id, request.seq_id, request.loss_fn, config, request.forward_only, data)


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 outputs (``logprobs``, ``elementwise_loss``) as one batched ArrayRecord."""
    out = Message["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else {}:
        arrays = [np.ascontiguousarray(o[name], np.float32) for o in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        batched = record.fields[name]
        batched.data, batched.offsets, batched.dtype = b"".join(a.tobytes() for a in arrays), offsets.tobytes(), FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = value
    return out.SerializeToString()


@dataclass(slots=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # False: it ran out of max_tokens
    top: tuple[np.ndarray, np.ndarray] | None = None  # top-k ids, log-probs, [N, k]


def _topk(message, ids: np.ndarray, logprobs: np.ndarray) -> None:
    message.length, message.k = ids.shape
    message.token_ids = np.ascontiguousarray(ids, np.int32).tobytes()
    message.logprobs = np.ascontiguousarray(logprobs, np.float32).tobytes()


def sample_response(
    sequences: list[Sequence],
    prompt_logprobs: list[float | None] | None,
    top_prompt: tuple[np.ndarray, np.ndarray] | None,
    cached_tokens: int,
) -> bytes:
    out = Message["SampleResponse"](prompt_cache_hit_tokens=cached_tokens)
    for s in sequences:
        seq = out.sequences.add(
            stop_reason=0 if s.stopped else 1,
            tokens=np.asarray(s.tokens, np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, np.float32).tobytes(),
        )
        if s.top is not None:
            _topk(seq.topk_sampled_logprobs, *s.top)
    if prompt_logprobs is not None:  # the first token has no context: NaN, which the SDK reads as None
        out.prompt_logprobs = np.array([np.nan if v is None else v for v in prompt_logprobs], np.float32).tobytes()
    if top_prompt is not None:
        _topk(out.topk_prompt_logprobs, *top_prompt)
    return out.SerializeToString()
