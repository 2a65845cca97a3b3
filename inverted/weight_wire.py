"""How weights travel into a rollout server, in SGLang's own formats (sglang-api.md §4, §6).

Both ends use this module (``train/weight_sync`` packs and sends, the embedded engine receives),
so each format is written once:

- **Flattened buckets** (SGLang's ``FlattenedTensorBucket``): tensors' bytes back to back in one
  1-D ``uint8`` buffer, described by ``FlattenedTensorMetadata`` with *byte* offsets.
  ``bucket_layout`` computes the offsets from names, dtypes and shapes, and refuses an offset
  that is not a multiple of its tensor's item size, as SGLang's receiver does. ``unflatten`` turns a
  buffer back into named views (no copy). ``copy_all`` is how either end copies into or out of one.
- **Payloads** (SGLang's ``MultiprocessingSerializer``): a ``ForkingPickler``-style pickle,
  base64-encoded. ``serialize`` pickles our metadata class under SGLang's qualified name, so real
  SGLang's ``SafeUnpickler`` accepts our payloads. Tensors go as torch's multiprocessing
  reductions: CPU storages as shared-memory files, if the caller chose torch's ``file_system``
  sharing strategy; CUDA tensors as IPC handles that name the device by UUID, as SGLang's patched
  reduction does. ``bucket_payload`` pickles a bucket's metadata once per layout and reuses it,
  since only the buffer's handle changes between updates. ``deserialize`` never runs plain
  pickle: an allowlist resolves SGLang's class names to ours, the torch rebuild functions, and
  the builtin containers; every other global is refused.
- ``non_finite``: the tensors holding a NaN or an infinity, which neither end lets through.
- **The update group** (``/init_weights_update_group``): ``join_update_group`` builds the process
  group the way SGLang's ``init_custom_process_group`` builds it (a TCP rendezvous, then torch's
  store prefixes for a named group), so a trainer and a real SGLang server meet in it.

This module imports only ``errors``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import datetime
import functools
import io
import logging
import pickle
import socket
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.multiprocessing import reductions

from inverted.errors import InvalidRequest

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_PATCH_MODULE = "sglang.srt.utils.patch_torch"
DEFAULT_GROUP_NAME = "weight_update_group"

logger = logging.getLogger(__name__)


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's class, field for field; offsets are in bytes)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """A tensor serialized once per server TP rank (SGLang's class): rank r decodes ``values[r]``."""

    values: list[bytes]

    def get(self, rank: int) -> torch.Tensor:
        return deserialize(self.values[rank])


def parse_dtype(name: str) -> torch.dtype:
    """A dtype named as SGLang's wire names it (``"bfloat16"``; ``"torch.bfloat16"`` is refused, as there)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"unknown dtype {name!r}: use a torch attribute name such as 'bfloat16'")
    return dtype


def bucket_layout(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[FlattenedTensorMetadata]:
    """Byte offsets of tensors laid back to back, in order; an unaligned offset is an error, as in SGLang."""
    metadata, offset = [], 0
    for name, dtype, shape in entries:
        size = torch.Size(shape)
        if any(d < 0 for d in size):
            raise InvalidRequest(f"Negative dimension in received tensor {name}: {list(size)}")
        if offset % dtype.itemsize:
            raise InvalidRequest(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype} "
                "(order a bucket's tensors by descending item size)"
            )
        nbytes = size.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, size, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata


def unflatten(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> list[tuple[str, torch.Tensor]]:
    """Named views into ``flat`` (a 1-D uint8 buffer); malformed metadata is an ``InvalidRequest``."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise InvalidRequest(
            f"flattened_tensor must be a 1-D uint8 tensor, got {flat.dtype} of shape {list(flat.shape)}"
        )
    views = []
    for meta in metadata:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise InvalidRequest(f"bucket metadata entries must be FlattenedTensorMetadata, got {type(meta).__name__}")
        shape = torch.Size(meta.shape)
        nbytes = shape.numel() * meta.dtype.itemsize
        if not (
            0 <= meta.start_idx
            and meta.end_idx == meta.start_idx + nbytes == meta.start_idx + meta.numel
            and meta.end_idx <= flat.numel()
        ):
            raise InvalidRequest(
                f"{meta.name}: byte range [{meta.start_idx}, {meta.end_idx}) does not hold a "
                f"{meta.dtype} tensor of shape {list(shape)} inside a {flat.numel()}-byte bucket"
            )
        if meta.start_idx % meta.dtype.itemsize:
            raise InvalidRequest(
                f"Unaligned received tensor {meta.name}: byte offset {meta.start_idx}, dtype {meta.dtype}"
            )
        views.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).view(shape)))
    return views


@torch.no_grad()
def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target (casting), all together, and on a GPU wait for the copies.

    Together: on a GPU a few fused launches instead of one per tensor, which made both ends
    launch-bound. Waited for: a CUDA-IPC bucket is read or refilled by the other process, which
    our stream does not order, as soon as this end hands it over or answers.
    """
    if targets:
        torch._foreach_copy_(targets, sources)
    for device in {t.device for t in targets if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


# ---- payloads -------------------------------------------------------------------------------


def non_finite(named: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> list[str]:
    """The names of floating-point tensors holding a NaN or an infinity.

    One reduction per tensor (no mask is allocated): NaN and inf survive a sum, and finite
    weights do not overflow one summed in fp32 (fp16's own range would: 65504). Both ends ask: a
    trainer must not send such weights, and a server must not serve them (it would answer
    garbage, and its health probe cannot tell).
    """
    floats = [(name, t) for name, t in (named.items() if isinstance(named, dict) else named) if t.is_floating_point()]
    sums = [t.sum(dtype=torch.promote_types(t.dtype, torch.float32)).to(torch.float64) for _, t in floats]
    if not sums or (len({s.device for s in sums}) == 1 and bool(torch.isfinite(torch.stack(sums)).all())):
        return []  # the usual answer, with one wait for a GPU (not one per tensor)
    return [name for (name, _), total in zip(floats, sums) if not torch.isfinite(total)]


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """Torch's CUDA-IPC rebuild, with the device given by UUID (SGLang's ``_rebuild_cuda_tensor_modified``)."""
    device = args[6]
    if isinstance(device, str):
        matches = [
            i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise InvalidRequest(f"no local CUDA device has UUID {device}: CUDA IPC works only on the same node")
        device = matches[0]
    return reductions.rebuild_cuda_tensor(*args[:6], device, *args[7:])  # type: ignore[call-arg]  # torch's stub has fewer


# Our objects that must pickle under SGLang's qualified names (and unpickle back to ours).
_SGLANG_ALIASES: list[tuple[Any, tuple[str, str]]] = [
    (FlattenedTensorMetadata, (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata")),
    (
        LocalSerializedTensor,
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    ),
    (_rebuild_cuda_tensor_by_uuid, (SGLANG_PATCH_MODULE, "_rebuild_cuda_tensor_modified")),
]
_ALIASED = {id(obj): name for obj, name in _SGLANG_ALIASES}


class _Pickler(pickle._Pickler):
    """ForkingPickler's output, with SGLang's names for the classes both sides share.

    The pure-Python pickler is used because only it lets a global be written under another
    module's name without importing that module; the payloads it writes are small (the bulk of a
    bucket travels as a shared-memory file or an IPC handle, not inside the pickle).
    """

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in _ALIASED:
            # A name makes ``save`` call our ``save_global``; without this, a function would reach
            # the base class's (the dispatch table holds it for functions) under our module's name.
            return _ALIASED[id(obj)][1]
        if isinstance(obj, torch.Tensor):
            rebuild, args = reductions.reduce_tensor(obj)
            if obj.is_cuda:
                args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
                rebuild = _rebuild_cuda_tensor_by_uuid
            return rebuild, args
        if type(obj) is torch.UntypedStorage:
            return reductions.reduce_storage(obj)
        if type(obj) is torch.TypedStorage:
            return reductions.reduce_typed_storage(obj)
        if isinstance(obj, torch.TypedStorage):
            return reductions.reduce_typed_storage_child(obj)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        alias = _ALIASED.get(id(obj))
        if alias is None:
            return super().save_global(obj, name)  # type: ignore[misc]  # the pure-Python pickler's, not in the stub
        self.write(pickle.GLOBAL + f"{alias[0]}\n{alias[1]}\n".encode())  # type: ignore[attr-defined]  # (every protocol)
        self.memoize(obj)  # type: ignore[attr-defined]


def _pickle(obj: Any, protocol: int) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``, readable by real SGLang."""
    return base64.b64encode(_pickle(obj, pickle.DEFAULT_PROTOCOL)).decode()


# A bucket payload is pickled in parts, and the metadata's part is kept. The pure-Python pickler
# spends ~70 us per metadata entry (measured: 6-7 ms for the 98 tensors of the `small` model; a
# 1.5B model has 339, more than CUDA IPC needs to move its 3 GB), and a bucket's layout is the
# same at every update. Protocol 3 makes the splice sound: it has no frames, and it names memo
# slots explicitly (BINPUT n), so each part only reads the slots it wrote itself.
_SPLICE_PROTOCOL = 3


def _pickled_part(obj: Any) -> bytes:
    """``obj``'s pickle opcodes, without the protocol header and the STOP."""
    return _pickle(obj, _SPLICE_PROTOCOL)[2:-1]


@functools.lru_cache(maxsize=256)
def _pickled_metadata(layout: tuple[tuple, ...]) -> bytes:
    return _pickled_part([FlattenedTensorMetadata(*entry) for entry in layout])


def bucket_payload(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> str:
    """One ``/update_weights_from_tensor`` entry for ``load_format="flattened_bucket"``, as SGLang builds it:
    ``{"flattened_tensor": flat, "metadata": metadata}``, the metadata's pickle reused across updates."""
    layout = tuple((m.name, torch.Size(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in metadata)
    raw = b"".join(
        [
            pickle.PROTO,
            bytes([_SPLICE_PROTOCOL]),
            pickle.EMPTY_DICT,
            pickle.MARK,
            _pickled_part("flattened_tensor"),
            _pickled_part(flat),
            _pickled_part("metadata"),
            _pickled_metadata(layout),
            pickle.SETITEMS,
            pickle.STOP,
        ]
    )
    return base64.b64encode(raw).decode()


def _load_storage_by_value(data: bytes) -> torch.UntypedStorage | torch.TypedStorage:
    """A storage pickled by value: torch's own loader in ``weights_only`` mode, as SGLang does."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _RefuseFdSharing:
    """Stands in for torch's fd-sharing globals (a class, since ``DupFd`` is rebuilt as an object)."""

    def __new__(cls, *_: Any) -> NoReturn:
        raise InvalidRequest(
            "the payload shares CPU memory by file descriptor, which an unrelated process cannot open: "
            "the sender must use torch.multiprocessing.set_sharing_strategy('file_system') or send by value"
        )


SHM_MANAGER_TRIES = 5


def _rebuild_storage_filename(*args: Any) -> Any:
    """torch's ``rebuild_storage_filename``, asked again when the sender's shm manager answers late.

    Opening a ``file_system`` storage registers the mapping with the sender's ``torch_shm_manager``
    daemon, and libshm gives up after 1 s without its answer ("Shared memory manager connection has
    timed out"), which a loaded machine saw (the suite on 2 cores). Nothing is mapped before the
    answer, so another try is safe; a late answer to the first is read as the next one's ("OK").
    """
    for tries_left in range(SHM_MANAGER_TRIES - 1, -1, -1):
        try:
            return reductions.rebuild_storage_filename(*args)
        except RuntimeError as error:
            if tries_left == 0 or "Shared memory manager connection has timed out" not in str(error):
                raise
            logger.warning("the weight sender's shm manager did not answer within 1 s; asking again")


class _NoAllocationBySize:
    """An allowlisted class whose constructor would allocate what a number asks (``bytearray(2**30)``,
    ``torch.UntypedStorage(2**30)``): a 100-byte payload could make the engine allocate gigabytes
    before any check. No payload SGLang makes calls them so (bytes come as bytes, storages by value
    through ``_load_from_bytes`` or shared by name), so a number is refused; anything else goes to
    the class, whose attributes this forwards (torch's rebuild functions call the storage class's)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, int) and not isinstance(a, bool) for a in args):
            raise InvalidRequest(
                f"a weight payload may not make a {self.cls.__name__} of a given size "
                f"({', '.join(map(repr, args))[:80]})"
            )
        return self.cls(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cls, name)


_ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", t.__name__): t for t in (bool, complex, dict, float, frozenset, int, list, set, slice, str, tuple)},
    **{("builtins", t.__name__): _NoAllocationBySize(t) for t in (bytearray, bytes)},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("copyreg", "__newobj__"): getattr(__import__("copyreg"), "__newobj__"),
    ("_codecs", "encode"): __import__("codecs").encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "UntypedStorage"): _NoAllocationBySize(torch.UntypedStorage),
    ("torch.storage", "UntypedStorage"): _NoAllocationBySize(torch.UntypedStorage),
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch.storage", "_load_from_bytes"): _load_storage_by_value,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    **{
        ("torch._utils", n): getattr(torch._utils, n)
        for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter")
    },
    **{
        ("torch.multiprocessing.reductions", n): getattr(reductions, n)
        for n in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        )
    },
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _RefuseFdSharing,
    ("multiprocessing.resource_sharer", "DupFd"): _RefuseFdSharing,
    **{name: obj for obj, name in _SGLANG_ALIASES},
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,  # its older home
}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return _NoAllocationBySize(getattr(torch, name))  # the legacy typed storage classes (FloatStorage, ...)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a weight payload")


def payload_bytes(data: str | bytes) -> bytes:
    """SGLang's HTTP normalisation: a str is base64; bytes starting with a pickle header are raw, else base64."""
    if isinstance(data, bytes) and len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"serialized_named_tensors: not valid base64 ({exc})") from None


def deserialize(data: str | bytes) -> Any:
    """SGLang's ``MultiprocessingSerializer.deserialize``, through the allowlist; bad input is an ``InvalidRequest``."""
    raw = payload_bytes(data)
    try:
        return _AllowlistUnpickler(io.BytesIO(raw)).load()
    except InvalidRequest:
        raise
    except Exception as exc:  # a truncated or hostile pickle raises anything from EOFError to RuntimeError
        raise InvalidRequest(
            f"serialized_named_tensors: cannot decode the payload ({type(exc).__name__}: {exc})"
        ) from None


# ---- the update group -----------------------------------------------------------------------


@dataclass
class UpdateGroup:
    """A joined weight-update group: the process group, and the TCP store it met through (kept alive with it)."""

    group: Any
    store: Any
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """One blocking broadcast of ``tensor`` from rank ``src``."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None) or getattr(self.group, "abort", None)
        if shutdown is not None:
            shutdown()
        self.group = self.store = None


def join_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> UpdateGroup:
    """Join the weight-update group (rank 0, the trainer, hosts the rendezvous); blocks until all ranks arrive.

    The store prefixes reproduce what SGLang's ``init_custom_process_group`` gets from torch
    (``PrefixStore(group_name)`` over the TCP store, then torch's ``"{group_name}/"`` and
    ``"{device}/"`` prefixes), so the key layout of the handshake is the same on both sides.
    """
    from torch.distributed import PrefixStore, TCPStore

    if backend not in ("gloo", "nccl"):
        raise InvalidRequest(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not (0 <= rank < world_size):
        raise InvalidRequest(f"rank {rank} is outside a group of world size {world_size}")
    delta = datetime.timedelta(seconds=timeout)
    store = TCPStore(master_address, master_port, world_size, rank == 0, timeout=delta, multi_tenant=True)
    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = delta
        group: Any = torch.distributed.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        gloo = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in the stub
        gloo._timeout = delta
        # Listen where the other ranks can reach: gloo's default looks up the hostname, which is
        # 127.0.0.1 on many machines, and a server on another host (or network namespace) then
        # dials its own loopback and never connects.
        gloo._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=route_address(master_address))]
        group = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, gloo)
    return UpdateGroup(group, store, rank, world_size)


def route_address(host: str) -> str:
    """This host's address on the route to ``host`` (loopback for a local one)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing
        probe.connect((host, 9))
        return probe.getsockname()[0]
