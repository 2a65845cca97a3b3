"""The tensor transport's weight buckets in ``/dev/shm`` on a CPU: which files a process made, and
unlinking those that dead trainer ranks left behind.

A module apart from the transport (``weight_sync.transports``, which imports torch): the job's
driver reaps a killed trainer's buckets whenever it starts a trainer group, and need not load torch
for that (``devices`` says why that matters).
"""

from __future__ import annotations

import time
from pathlib import Path

from inverted.processes import alive

SHARED_MEMORY = Path("/dev/shm")


def shared_buckets(pid: int | str = "*") -> set[Path]:
    """The shared-memory bucket files of process ``pid`` (of every process by default) on this node:
    torch names each ``torch_<pid>_<random>_<n>`` after the process that made it."""
    return set(SHARED_MEMORY.glob(f"torch_{pid}_*"))


def orphaned_buckets() -> set[Path]:
    """The bucket files on this node whose maker has exited: memory that no process will unlink. (A live
    process's files may be in use: another job's, or a service's between two weight syncs.)"""
    return {path for path in shared_buckets() if not alive(int(path.name.split("_")[1]))}


def reap_buckets(pids: list[int], wait_s: float = 0.0) -> int:
    """Unlink the shared-memory buckets that processes ``pids`` made and died without unlinking; how many.

    A trainer that is killed (a SIGKILL, Ray ending its actor) never reaches ``release``, and its
    buckets then outlive it: each is RAM, a whole bucket (``--update-weight-buffer-size``). Files of a process
    still alive after ``wait_s`` (for one just killed to exit) are left alone; a server that maps
    one keeps its mapping.
    """
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    reaped = 0
    for pid in pids:
        if alive(pid):
            continue
        for path in shared_buckets(pid):
            path.unlink(missing_ok=True)
            reaped += 1
    return reaped
