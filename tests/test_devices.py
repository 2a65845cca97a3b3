"""``devices.cuda_available``: torch's answer where a GPU driver's device node exists, and no torch
loaded where none does; and the job's driver, which trains nothing, does not load torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from inverted.devices import DEVICE_NODES


def run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_cuda_available_is_torchs_answer_and_loads_torch_only_beside_a_gpu_driver():
    available, loaded = run(
        "import sys; from inverted.devices import cuda_available; print(cuda_available(), 'torch' in sys.modules)"
    )
    if any(Path(node).exists() for node in DEVICE_NODES):
        assert loaded == "True" and available == run("import torch; print(torch.cuda.is_available())")[0]
    else:
        assert (available, loaded) == ("False", "False")


def test_the_drivers_modules_do_not_load_torch():
    """The controller, the servers' launcher, the trainer group's handle, and the metrics sink as it
    writes (TensorBoard's own writer, not torch's): ~150 MB of private memory that a process that
    trains nothing would carry (docs/performance-history.md)."""
    assert run(
        "import sys, tempfile; import inverted.cli, inverted.controller, inverted.placement, "
        "inverted.train.actor, inverted.rollout.servers; from inverted.metrics import build_metrics_sink; "
        "out = tempfile.TemporaryDirectory(); sink = build_metrics_sink(out.name); sink.log({'a/b': 1.0}, 0); "
        "sink.close(); out.cleanup(); print('torch' in sys.modules)"
    ) == ["False"]
