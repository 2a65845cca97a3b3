"""How real SGLang is launched on a CPU: the import stand-ins, the flags the launcher adds, and keys
through a pipe. (That a whole job on SGLang calls no stand-in: ``tests/job/test_sglang_job.py``.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inverted.processes import ManagedProcess, Secret
from inverted.rollout.servers import SGLANG_LAUNCH

STAND_INS = SGLANG_LAUNCH.parent


def launcher():
    spec = importlib.util.spec_from_file_location("sglang_launch", SGLANG_LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python(code: str, *path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose path starts with ``path`` (as the launcher sets it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    env.pop("INVERTED_SGLANG_STAND_INS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_stand_ins_satisfy_imports_decline_probes_and_raise_when_called():
    assert importlib.util.find_spec("sgl_kernel") is None and importlib.util.find_spec("torchvision") is None
    result = python(
        """
import importlib.util
print("probe", importlib.util.find_spec("torchvision"))
import sgl_kernel
from sgl_kernel import scalar_type, fused_experts
import torchvision.transforms as T
from torchvision.transforms.functional import InterpolationMode
print("mode", InterpolationMode.BICUBIC)
try:
    fused_experts(1, 2)
except Exception as exc:
    print("raised", type(exc).__name__, exc)
""",
        STAND_INS,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "probe None"  # transformers probes torchvision this way: it must see none
    assert out[1] == "mode <stand-in torchvision.transforms.functional.InterpolationMode.BICUBIC>"
    assert out[2].startswith(
        "raised StandInCalled sgl_kernel.fused_experts was called, but sgl_kernel is an import stand-in here"
    )
    assert "import stand-ins for sgl_kernel, torchvision" in result.stderr
    assert "[inverted] import stand-in called: sgl_kernel.fused_experts" in result.stderr


def test_a_real_package_is_never_replaced(tmp_path):
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    result = python("import sgl_kernel; print(sgl_kernel.REAL)", STAND_INS, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    assert "import stand-ins for torchvision (" in result.stderr


def test_the_launcher_adds_the_cpu_settings_the_user_did_not_give():
    cpu_argv = launcher().cpu_argv
    assert cpu_argv(["--model-path", "m"]) == [
        "--model-path",
        "m",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "32768",
        "--sleep-on-idle",
    ]
    mine = ["--dtype", "bfloat16", "--max-total-tokens=4096", "--sleep-on-idle"]
    assert cpu_argv(mine) == [*mine, "--device", "cpu"]


def test_a_script_gets_its_secret_arguments_through_a_pipe(tmp_path):
    """SGLang's launcher runs with SGLang's interpreter, where inverted may not be installed: keys reach it
    by ``--secrets-fd``, and never show on a command line."""
    script = tmp_path / "show.py"
    script.write_text(f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("launch", {str(SGLANG_LAUNCH)!r})
launch = importlib.util.module_from_spec(spec); spec.loader.exec_module(launch)
print(launch.read_secrets(sys.argv[1:]), flush=True)
time.sleep(30)
""")
    proc = ManagedProcess.spawn(
        "show",
        [sys.executable, str(script), "--port", "1", Secret("--api-key=k3y")],
        tmp_path / "show.log",
        "http://127.0.0.1:1",
    )
    try:
        deadline = time.monotonic() + 30
        while "]" not in proc.tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.tail().strip() == "['--port', '1', '--api-key=k3y']"
        assert b"k3y" not in Path(f"/proc/{proc.popen.pid}/cmdline").read_bytes()
    finally:
        proc.terminate()


def test_secrets_go_only_to_commands_that_can_read_them(tmp_path):
    with pytest.raises(ValueError, match="'python -m MODULE' or 'python SCRIPT.py'"):
        ManagedProcess.spawn("x", [sys.executable, "-c", "pass", Secret("--api-key=k")], tmp_path / "x.log", "")
