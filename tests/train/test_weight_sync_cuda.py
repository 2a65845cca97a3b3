"""CUDA-IPC weight sync into an engine on the same GPU (skipped without one)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from inverted.hf_checkpoint import checkpoint_tensors
from inverted.train.weight_sync import TensorTransport, WeightSync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]


def test_cuda_ipc_sync_lands_exactly(procs, tiny_model):
    """(NCCL broadcast needs two GPUs: NCCL refuses two ranks on one device.)"""
    url = procs.engine(tiny_model("qwen2"), "--device", "cuda", "--dtype", "bfloat16").url
    weights = {n: t.cuda() for n, t in checkpoint_tensors(tiny_model("qwen2", seed=9)).items()}
    sync = WeightSync(TensorTransport(torch.device("cuda", 0)), [url], buffer_size=1 << 20)
    report = asyncio.run(sync.update(weights.items(), "7"))
    assert report.buckets >= 1 and httpx.get(url + "/model_info").json()["weight_version"] == "7"
    name = "model.layers.0.mlp.gate_proj.weight"
    got = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 2}).json()
    assert torch.equal(torch.tensor(got), weights[name][:2].to(torch.bfloat16).float().cpu())
