"""Weights arriving at the engine: SGLang's tensor payloads and update-group broadcasts, checked whole.

The HTTP routes (``server``) hand a request's payloads here and get back named tensors that are
known to fit: every name is a parameter of the served model, with its shape and the served dtype.
Only then does the scheduler copy them in (``CausalLM.load_weights`` checks again and copies), so a
bad payload changes nothing.

- ``RecentBuckets.decoded``: ``/update_weights_from_tensor`` (checked with ``check_fits``) and
  ``/load_lora_adapter_from_tensors`` (checked as an adapter). One entry per server TP rank (this
  engine has one). ``load_format="flattened_bucket"`` carries ``{"flattened_tensor", "metadata"}``;
  ``None`` / ``"direct"`` carry ``[(name, tensor | LocalSerializedTensor)]``. Decoding goes through
  ``weight_wire``'s allowlist. CPU tensors arrive as shared-memory files the trainer wrote (the
  sender's first copy); the scheduler's copy into the parameters is the second and last.
  ``RecentBuckets`` keeps the last such buckets mapped and decoded: the trainer reuses its
  buffers and their layouts, so its next update repeats a payload byte for byte and costs no
  unpickling, mapping, page faults or checks (2.5 ms of a 52 MB update; 3 ms of SmolLM2's
  420-tensor adapter), only the copy.
- ``UpdateGroups``: ``/init_weights_update_group`` joins the trainer's group (blocking, so it runs
  in a worker thread); ``receive`` takes one broadcast of a flattened bucket, or one per tensor, in
  list order. A request whose tensors do not fit still takes its broadcasts (into scratch memory)
  before it is refused, so the trainer's collective never hangs on our refusal. A join or
  broadcast that torch fails (a peer gone, a timeout) is an ``UpdateGroupError``.

A tensor that does not fit is a ``ModelError``, a malformed request an ``InvalidRequest``; the
server answers both 400 and the old weights keep serving.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from inverted.errors import InvalidRequest, UpdateGroupError
from inverted.hf_checkpoint import checkpoint_tensors
from inverted.weight_wire import (
    LocalSerializedTensor,
    UpdateGroup,
    bucket_layout,
    deserialize,
    join_update_group,
    parse_dtype,
    unflatten,
)

TP_SIZE = 1  # the embedded engine runs one model replica per process
LOAD_FORMATS = (None, "direct", "flattened_bucket")

Named = list[tuple[str, torch.Tensor]]
T = TypeVar("T")


def check_fits(model, named: Named) -> None:
    """``ModelError`` unless every tensor is a parameter of ``model`` with its shape and the served dtype."""
    model.check_weights(dict(named), complete=False, strict_dtype=True)


def read_checkpoint(model, path: str) -> dict[str, torch.Tensor]:
    """``/update_weights_from_disk``: every tensor of the checkpoint at ``path``, as stored, checked
    whole against ``model`` (``ModelError`` names what does not fit) before anything is copied."""
    tensors = checkpoint_tensors(path)
    model.check_weights(tensors, complete=True)
    return tensors


def collective(what: str, fn: Callable[[], T]) -> T:
    """Run a join or broadcast; torch's failures there are the peers' (gone, late), not ours."""
    try:
        return fn()
    except (torch.distributed.DistError, RuntimeError) as exc:  # gloo reports timeouts as RuntimeError
        raise UpdateGroupError(f"{what} failed: {exc}") from exc


class RecentBuckets:
    """The last shared-memory buckets received: payload -> its checked tensors, kept mapped.

    A trainer sends from the same buffers at every update, each with the layout of the update
    before, so the same payload string names the same memory, now holding new bytes. Its tensors
    (views of that memory) were checked when it first came; they are handed out again as they are.
    """

    def __init__(self, size: int = 2):
        self.size = size
        self.kept: list[tuple[str, torch.Tensor, Named]] = []  # (payload, flat buffer, its tensors)

    def decoded(
        self,
        payloads: list[str],
        load_format: str | None,
        device: torch.device,
        check: Callable[[Named], None] | None = None,
    ) -> Named:
        """TP rank 0's named tensors of a tensor request (``decode_payloads``), after ``check``; those of
        a shared-memory bucket seen before as they were then."""
        if (
            load_format == "flattened_bucket"
            and len(payloads) == TP_SIZE
            and (named := self.get(payloads[0])) is not None
        ):
            return named
        named, flat = decode_payloads(payloads, load_format, device)
        if check is not None:
            check(named)
        if flat is not None and flat.device.type == "cpu" and flat.is_shared():
            self.keep(payloads[0], flat, named)  # CUDA-IPC memory is not held on to
        return named

    def get(self, payload: str) -> Named | None:
        return next((named for seen, _, named in self.kept if seen == payload), None)

    def keep(self, payload: str, flat: torch.Tensor, named: Named) -> None:
        ptr = flat.untyped_storage().data_ptr()
        self.kept = [k for k in self.kept if k[1].untyped_storage().data_ptr() != ptr] + [(payload, flat, named)]
        self.kept = self.kept[-self.size :]


def decode_payloads(
    payloads: list[str], load_format: str | None, device: torch.device
) -> tuple[Named, torch.Tensor | None]:
    """TP rank 0's named tensors of a tensor request (weights or a LoRA adapter), unchecked, and the
    flat buffer they view (a flattened bucket's; None otherwise)."""
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(f"load_format must be one of {list(LOAD_FORMATS)} on this engine, got {load_format!r}")
    if len(payloads) != TP_SIZE:
        raise InvalidRequest(
            f"serialized_named_tensors has {len(payloads)} entries: one per server TP rank "
            f"is needed, and this server has {TP_SIZE}"
        )
    obj = deserialize(payloads[0])
    flat = None
    if load_format == "flattened_bucket":
        if not (
            isinstance(obj, dict)
            and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), list)
        ):
            raise InvalidRequest(
                "a flattened_bucket payload must decode to {'flattened_tensor': Tensor, 'metadata': [...]}"
            )
        named = unflatten(obj["flattened_tensor"], obj["metadata"])
        flat = obj["flattened_tensor"]
    else:
        if isinstance(obj, dict):  # a LoRA adapter's tensors, as SGLang's senders pickle them
            obj = list(obj.items())
        if not isinstance(obj, list) or not all(isinstance(e, tuple) and len(e) == 2 for e in obj):
            raise InvalidRequest("a payload must decode to a list of (name, tensor) pairs")
        named = [(name, value.get(0) if isinstance(value, LocalSerializedTensor) else value) for name, value in obj]
        if not all(isinstance(name, str) and isinstance(t, torch.Tensor) for name, t in named):
            raise InvalidRequest("a payload must decode to a list of (name, tensor) pairs")
        named = [(name, t.to(device)) for name, t in named]
    return named, flat


class UpdateGroups:
    """The weight-update process groups this engine has joined, by group name."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._groups: dict[str, UpdateGroup] = {}
        self._lock = threading.Lock()
        self._staging = torch.empty(0, dtype=torch.uint8)  # reused: a fresh buffer would page-fault every update

    def join(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Blocking: returns once every rank has joined. Rank ``rank_offset + tp_rank`` (tp_rank is 0 here)."""
        with self._lock:
            if group_name in self._groups:
                raise InvalidRequest(f"process group {group_name!r} already exists: destroy it first")
        group = collective(
            "Joining the weight-update group",
            lambda: join_update_group(
                master_address,
                master_port,
                world_size,
                rank_offset,
                group_name=group_name,
                backend=backend,
                timeout=self.timeout,
            ),
        )
        with self._lock:
            self._groups[group_name] = group

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise InvalidRequest(f"no process group named {group_name!r}")
        group.close()

    def receive(
        self,
        model,
        group_name: str,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        load_format: str | None,
    ) -> Named:
        """Blocking: take the trainer's broadcasts for these tensors, then check that they fit ``model``."""
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise InvalidRequest(f"no process group named {group_name!r}: call /init_weights_update_group first")
        if not (len(names) == len(dtype_names) == len(shapes)) or not names:
            raise InvalidRequest(
                f"names, dtypes and shapes must be non-empty lists of one length, got "
                f"{len(names)}, {len(dtype_names)} and {len(shapes)}"
            )
        if load_format not in (None, "flattened_bucket"):
            raise InvalidRequest(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
        entries = [(name, parse_dtype(dtype), tuple(shape)) for name, dtype, shape in zip(names, dtype_names, shapes)]
        # every shape (and, for a bucket, every offset) is checked before the first receive
        layout = bucket_layout(entries) if load_format else [bucket_layout([e])[0] for e in entries]
        device = "cuda" if model.device.type == "cuda" else "cpu"
        if load_format == "flattened_bucket":
            nbytes = layout[-1].end_idx
            if self._staging.numel() < nbytes or self._staging.device.type != device:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat = self._staging[:nbytes]
            collective("The broadcast", functools.partial(group.broadcast, flat))
            named = unflatten(flat, layout)
        else:
            named = []
            for meta in layout:
                tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                collective("The broadcast", functools.partial(group.broadcast, tensor))
                named.append((meta.name, tensor))
        check_fits(model, named)
        return named

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy(name)
