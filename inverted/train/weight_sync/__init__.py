"""Weight sync: the trainer's weights into every rollout server, in flattened buckets.

- ``buckets``: named tensors → SGLang ``FlattenedTensorBucket`` layout, two buffers in turn (one
  where a transport does not overlap packing with sending).
- ``transports``: tensor (shared memory / CUDA IPC), distributed (gloo / NCCL broadcast), disk.
- ``sync``: one update end to end (pause, session, buckets, version, flush, continue), timed.

``make_weight_sync`` builds one from the trainer's config; ``Trainer.sync_weights`` drives it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inverted.rollout.sglang_client import ServerKeys
from inverted.train.config import WeightSyncConfig
from inverted.train.weight_sync.buckets import Bucket, BucketPacker
from inverted.train.weight_sync.sync import SyncReport, WeightSync
from inverted.train.weight_sync.transports import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    Transport,
    on_this_host,
)
from inverted.types import POLICY_ADAPTER

# --update-weight-buffer-size 0. On a GPU, slime's default. On a CPU a bucket is host memory that
# the trainer and the engines keep mapped between updates (the engines keep each one decoded), so it
# is sized to hold a large tensor (a 135M model's embedding is 108 MiB) and no more: SmolLM2's job
# peaked 0.6 GB lower at 128 MiB than at 512, its sync no slower (docs/performance-history.md).
BUCKET_BYTES_GPU = 512 * 1024**2
BUCKET_BYTES_CPU = 128 * 1024**2

__all__ = [
    "Bucket",
    "BucketPacker",
    "DiskTransport",
    "DistributedTransport",
    "SyncReport",
    "TensorTransport",
    "Transport",
    "WeightSync",
    "choose_transport",
    "make_weight_sync",
]


def choose_transport(kind: str, urls: list[str], *, lora: bool = False) -> str:
    """``--update-weight-transport``; ``auto``: tensor (CUDA IPC on a GPU, shared memory on CPU) when every
    server is on this host, whatever address it binds, else distributed (a LoRA adapter: else disk, as
    SGLang loads adapters by tensor or by path)."""
    if kind != "auto":
        return kind
    return "tensor" if all(on_this_host(url) for url in urls) else "disk" if lora else "distributed"


def make_weight_sync(
    cfg: WeightSyncConfig,
    hf_checkpoint: str,
    output_dir: str,
    urls: list[str],
    *,
    keys: ServerKeys = ServerKeys(),
    adapter: dict | None = None,
    adapter_name: str = POLICY_ADAPTER,
) -> WeightSync:
    """A weight sync by ``choose_transport``'s transport. The disk transport writes under ``output_dir``
    unless told where, beside ``hf_checkpoint``'s config."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    kind = choose_transport(cfg.update_weight_transport, urls, lora=adapter is not None)
    if kind == "tensor":
        transport: Transport = TensorTransport(device)
    elif kind == "distributed":
        transport = DistributedTransport(device, timeout=cfg.update_weight_timeout)
    else:
        transport = DiskTransport(device, cfg.update_weight_disk_dir or f"{output_dir}/weight_updates", hf_checkpoint)
    checkpoint_dtype = json.loads((Path(hf_checkpoint) / "config.json").read_text()).get("torch_dtype")
    size = cfg.update_weight_buffer_size or (BUCKET_BYTES_CPU if device.type == "cpu" else BUCKET_BYTES_GPU)
    # A bucket no larger than the checkpoint: a small model's buckets would otherwise take the whole
    # --update-weight-buffer-size each (on a CPU, RAM in /dev/shm; the bytes are written to share them).
    stored = sum(f.stat().st_size for f in Path(hf_checkpoint).glob("*.safetensors"))
    return WeightSync(
        transport,
        urls,
        buffer_size=min(size, stored or size),
        pause_mode=cfg.pause_mode,
        keys=keys,
        checkpoint_dtype=checkpoint_dtype,
        adapter=adapter,
        adapter_name=adapter_name,
    )
