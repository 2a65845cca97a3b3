"""Each CPU workaround of ``inverted.train.megatron_patches``, checked in a fresh process (it changes globals)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the compatibility layer is for machines without CUDA"
)

PROBE = r"""
import torch
try:
    torch.cuda.synchronize()
    raise SystemExit("synchronize worked before apply(): the probe proves nothing")
except (AssertionError, RuntimeError):
    pass
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.utils import GlobalMemoryBuffer
from inverted.train import megatron_patches

try:
    torch.cuda.current_device()
    raise SystemExit("current_device worked before apply(): the probe proves nothing")
except (AssertionError, RuntimeError):
    pass
megatron_patches.apply()
megatron_patches.apply()  # idempotent

# 1. current_device answers the CPU, and Megatron's scratch buffer allocates there.
assert torch.cuda.current_device() == torch.device("cpu")
scratch = GlobalMemoryBuffer().get_tensor((3, 4), torch.float32, "mpu")
assert scratch.device.type == "cpu" and scratch.shape == (3, 4)

# 2. The tracker keeps named CPU streams: forking draws from the stream, and leaves the default one untouched.
tracker = mcore_random.get_cuda_rng_tracker()
assert isinstance(tracker, mcore_random.CudaRNGStatesTracker)
tracker.add("model-parallel-rng", 123)
torch.manual_seed(0)
expected_default = torch.rand(3)
torch.manual_seed(0)
with tracker.fork():
    first = torch.rand(3)
with tracker.fork():
    second = torch.rand(3)
assert torch.equal(torch.rand(3), expected_default), "fork() disturbed the default generator"
torch.manual_seed(123)
stream = torch.rand(6)
assert torch.equal(torch.cat([first, second]), stream), "fork() did not continue the named stream"
try:
    tracker.add("other", 123)
    raise SystemExit("a reused seed was accepted")
except RuntimeError:
    pass

# 3. Pipeline schedules: .cuda() stays put, synchronize() returns, the schedules' counter is made on the CPU.
from megatron.core.pipeline_parallel import schedules
weight = torch.ones(2)
assert weight.cuda() is weight
torch.cuda.synchronize()
counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
assert counter.device.type == "cpu" and counter.dtype == torch.int
assert schedules.torch.float32 is torch.float32 and torch.zeros(1).device.type == "cpu"
print("ok")
"""


def test_cpu_workarounds():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_unsupported_megatron_version_is_refused(monkeypatch):
    import megatron.core

    from inverted.train import megatron_patches

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="supports megatron-core"):
        megatron_patches.apply()
