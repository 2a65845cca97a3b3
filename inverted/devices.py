"""Whether this machine offers torch a CUDA device, asked without loading torch where it cannot.

Importing torch costs a process about 150 MB of private memory (measured: 147 MB anonymous), which
the job's driver would pay only to learn how to place its servers and trainer. torch reaches a GPU
through its driver's device nodes (NVIDIA's ``/dev/nvidiactl``, ROCm's ``/dev/kfd``, which torch
also reports as CUDA, WSL's ``/dev/dxg``): where none exists, torch cannot see one, and is not
asked. Where one does, torch answers, as before.

``native_bf16`` says whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): where it
does not, torch emulates bfloat16, slower than float32. The VM type varies, so it is read, never assumed.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


@functools.cache
def cuda_available() -> bool:
    if not any(Path(node).exists() for node in DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


@functools.cache
def native_bf16() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: torch's own dispatch decides, and nothing here can say
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo) is not None
