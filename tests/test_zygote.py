"""The tests' servers come forked from a zygote (``tests/zygote.py``): each must behave as the process
``python -m MODULE ARGS`` would, for what the tests read of it: its output in its log, its environment
as its parent has it now, its exit status, signals, and its death with the zygote's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from inverted.processes import free_port
from tests.conftest import until
from tests.zygote import Zygote


def test_a_child_runs_its_module_as_main_with_its_own_log_environment_and_exit_status(tmp_path, monkeypatch):
    (tmp_path / "probe.py").write_text("import os, sys; print(os.environ['ZYGOTE_PROBE'], sys.argv[1:]); sys.exit(3)")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    zygote = Zygote()
    monkeypatch.setenv("ZYGOTE_PROBE", "set after the zygote started")
    child = zygote.spawn([sys.executable, "-m", "probe", "a", "b"], tmp_path / "probe.log")
    assert child.wait(60) == 3
    assert (tmp_path / "probe.log").read_text() == "set after the zygote started ['a', 'b']\n"

    argv = [sys.executable, "-m", "json.tool", str(tmp_path / "absent.json")]  # a usage error, on stderr
    failing = zygote.spawn(argv, tmp_path / "fail.log")
    fresh = subprocess.run(argv, capture_output=True, text=True)
    assert failing.wait(60) == fresh.returncode == 2
    assert (tmp_path / "fail.log").read_text() == fresh.stderr


def test_a_server_child_is_signalled_and_dies_with_the_zygote(tmp_path):
    zygote = Zygote()
    ports = [free_port(), free_port()]
    servers = [
        zygote.spawn(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)], tmp_path / f"http-{port}.log"
        )
        for port in ports
    ]
    for port in ports:
        until(lambda: _answers(port), f"nothing answered on {port}", 30)
    servers[0].kill()
    assert servers[0].wait(30) == -signal.SIGKILL and not _answers(ports[0])
    os.kill(zygote.process.pid, signal.SIGKILL)  # a test worker that dies takes its zygote, and that its servers
    until(lambda: not _answers(ports[1]), "a server outlived its zygote", 30)


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
