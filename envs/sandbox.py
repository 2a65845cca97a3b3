"""A policy's commands under bubblewrap: no network, the whole system read-only except the task's
copy, and limits on each command's time, memory, processes and file sizes.

A policy under RL runs whatever it samples, a ``curl`` to the internet, an ``rm -rf`` outside its
task, a fork bomb. A harness environment (``envs.coding``) gives the harness's own sandbox mode
this wrapper: mini-swe-agent's ``bubblewrap`` environment runs each command as
``python envs/sandbox.py BWRAP_ARGS... --bind COPY COPY --chdir COPY bash -c COMMAND``, and this
script sets the limits, drops root (to ``nobody``, so that the process limit binds: the kernel
does not count root's processes), and becomes ``bwrap``. The sandbox itself:

- ``--unshare-all``: its own network (loopback only, nothing reachable), pids, IPC and hostname;
- ``--ro-bind / /``, then a fresh ``/tmp``, ``/dev`` and ``/proc``; the task's copy bound writable;
  ``python`` is the system's (the job's packages are not the task's);
- ``--die-with-parent``: a command killed for its time takes every process it started with it.

Debian's ``bubblewrap`` package provides ``bwrap`` (the set-up installs it: ``.ci/run``,
``make sandbox``); ``problem()`` says why a sandbox cannot start here.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
MEMORY_BYTES = 2 << 30  # address space of each process
PROCESSES = 128  # processes of the sandbox's user, beyond those it already runs
CPU_S = 60  # CPU seconds of each process; the harness bounds wall time (mini-swe-agent: its timeout)
FILE_BYTES = 256 << 20  # largest file a command may write
# ``python`` in the sandbox: the system's (a job's interpreter may sit where ``nobody`` cannot read it)
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or os.path.realpath(sys.executable)
BWRAP_ARGS = [
    "--unshare-all",
    "--die-with-parent",
    "--new-session",
    "--ro-bind",
    "/",
    "/",
    "--dev",
    "/dev",
    "--proc",
    "/proc",
    "--tmpfs",
    "/tmp",
    "--dir",
    "/tmp/.bin",
    "--symlink",
    PYTHON,
    "/tmp/.bin/python",
    "--symlink",
    PYTHON,
    "/tmp/.bin/python3",
    "--setenv",
    "HOME",
    "/tmp",
    "--setenv",
    "PATH",
    "/tmp/.bin:/usr/local/bin:/usr/bin:/bin",
]


def problem() -> str | None:
    """Why a sandbox cannot start here, or None when one can (it starts one, running ``true``)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed: Debian's bubblewrap package provides it (make sandbox)"
    try:
        done = subprocess.run(
            [sys.executable, __file__, *BWRAP_ARGS, "true"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "bwrap did not start within 30 s"
    return None if done.returncode == 0 else f"bwrap cannot start a sandbox here: {done.stderr.strip()[-500:]}"


def mini_environment(work: Path, timeout_s: int) -> dict:
    """mini-swe-agent's ``bubblewrap`` environment with this wrapper, for commands run in ``work``."""
    return {
        "environment_class": "bubblewrap",
        "executable": sys.executable,
        "cwd": str(work),
        "timeout": timeout_s,
        "wrapper_args": [str(Path(__file__).resolve()), *BWRAP_ARGS],
    }


def let_nobody_write(work: Path) -> None:
    """As root, the sandbox runs as ``nobody``: the task's copy becomes theirs, and the directories
    above it let them pass (search only, ``o+x``: nothing in them can be listed)."""
    if os.geteuid() != 0:
        return
    for path in [work, *work.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    for parent in work.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)


def _own_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def limit_and_drop() -> None:
    """The limits, then (as root) ``nobody``: the kernel never limits the number of root's processes."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    processes = _own_processes(os.getuid()) + PROCESSES
    for kind, value in (
        (resource.RLIMIT_AS, MEMORY_BYTES),
        (resource.RLIMIT_NPROC, processes),
        (resource.RLIMIT_CPU, CPU_S),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
    ):
        resource.setrlimit(kind, (value, value))


def main() -> None:
    limit_and_drop()
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        sys.exit("bwrap is not installed: Debian's bubblewrap package provides it (make sandbox)")
    os.execv(bwrap, [bwrap, *sys.argv[1:]])


if __name__ == "__main__":
    main()
