"""The sandbox of a policy's commands (``envs.sandbox``), through the harness's own sandbox mode as
``envs.coding`` configures it (mini-swe-agent's ``bubblewrap`` environment, real ``bwrap``): a
model's network call, a write outside its copy, a memory hog and a fork bomb are each stopped, while
the task's own test still runs in the copy, and the machine outside is untouched."""

from __future__ import annotations

import http.server
import os
import threading
import time
from pathlib import Path

import pytest

from envs import sandbox
from envs.coding import REPOS, TEST
from tests.harnesses.conftest import ROOT

pytestmark = pytest.mark.slow  # mini-swe-agent comes with the harnesses (make harnesses)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    problem = sandbox.problem()
    if problem is not None:
        pytest.fail(f"no sandbox can start: {problem}")
    from minisweagent.environments import get_environment

    work = tmp_path_factory.mktemp("task") / "repo"
    work.mkdir()
    for name, text in REPOS["off_by_one"].items():
        (work / name).write_text(text)
    sandbox.let_nobody_write(work)
    config = sandbox.mini_environment(work, timeout_s=20)
    return get_environment(config), work


def run(environment, command: str) -> dict:
    env, _ = environment
    return env.execute({"command": command})


def test_the_tasks_test_runs_and_its_fix_is_written_in_the_copy(environment):
    _, work = environment
    failing = run(environment, f"python {TEST}")
    assert failing["returncode"] == 1 and "AssertionError" in failing["output"]
    fixed = run(environment, f"sed -i 's/numbers\\[1:\\]/numbers/' calc.py && python {TEST}")
    assert fixed["returncode"] == 0 and fixed["output"].strip() == "ok", fixed
    assert "numbers[1:]" not in (work / "calc.py").read_text()


def test_a_network_call_is_stopped_and_nothing_reaches_the_machine(environment):
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/exfiltrate"
    try:
        assert (
            run(environment, f"python -c \"import urllib.request; urllib.request.urlopen('{url}', timeout=5)\"")[
                "returncode"
            ]
            != 0
        )
        assert (
            run(environment, "python -c \"import socket; socket.create_connection(('1.1.1.1', 443), timeout=5)\"")[
                "returncode"
            ]
            != 0
        )
        assert run(environment, f"curl -s --max-time 5 {url} || wget -q -T 5 {url}")["returncode"] != 0
    finally:
        server.shutdown()
    assert seen == []


def test_a_write_outside_the_copy_is_stopped(environment, tmp_path):
    outside = [ROOT / "pwned.txt", Path("/etc/pwned.txt"), Path.home() / "pwned.txt"]
    for target in outside:
        done = run(environment, f"echo x > {target}")
        assert done["returncode"] != 0 and (
            "Read-only file system" in done["output"] or "Permission denied" in done["output"]
        ), (target, done)
    done = run(environment, f"echo x > {tmp_path}/pwned.txt; rm -rf {ROOT}/inverted")  # /tmp is the sandbox's own
    assert not any(p.exists() for p in [*outside, tmp_path / "pwned.txt"]) and (ROOT / "inverted").is_dir()


def test_a_memory_hog_and_a_fork_bomb_are_stopped_and_leave_nothing_running(environment):
    hog = run(environment, "python -c 'x = bytearray(3 << 30)'")
    assert hog["returncode"] != 0 and "MemoryError" in hog["output"]
    started = time.monotonic()
    run(environment, ":(){ :|:& };:")
    assert time.monotonic() - started < 60  # ended by its limits or its timeout, not left running
    # whether its shell returned first (the namespace dies with it) or the process limit refused its
    # forks (seen both ways), what holds is the time above and that nothing of it is left running
    left = sandbox.NOBODY if os.geteuid() == 0 else None
    deadline = time.monotonic() + 10
    while _processes_of(left) and time.monotonic() < deadline:  # the namespace's last ones being reaped
        time.sleep(0.2)
    assert _processes_of(left) == 0
    assert run(environment, "echo still fine")["output"].strip() == "still fine"


def _processes_of(uid: int | None) -> int:
    """Processes left of the sandbox's user (as root: ``nobody``; else none to count apart)."""
    if uid is None:
        return 0
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _uid(e) == uid)


def _uid(entry) -> int | None:
    try:
        return entry.stat().st_uid
    except OSError:
        return None
