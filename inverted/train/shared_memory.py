"""The tensor transport's weight buckets in ``/dev/shm`` on a CPU: which files a process made, and
unlinking those that dead trainer ranks left behind; and the folders of torch's shared-memory
manager that a killed rank's manager leaves in the temporary folder.

A module apart from the transport (``weight_sync.transports``, which imports torch): the job's
driver reaps a killed trainer's buckets whenever it starts a trainer group, and need not load torch
for that (``devices`` says why that matters).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

from inverted.processes import alive, wait_exited

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
    wait_exited(pids, wait_s)
    reaped = 0
    for pid in pids:
        if alive(pid):
            continue
        for path in shared_buckets(pid):
            path.unlink(missing_ok=True)
            reaped += 1
    return reaped


def listening_sockets() -> set[str]:
    """The paths of the Unix sockets that some process in this network namespace holds."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {fields[7] for line in lines if len(fields := line.split()) >= 8}


def refused(path: Path) -> bool:
    """No process listens on the Unix socket ``path`` (one in another network namespace still answers)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def orphaned_manager_dirs() -> set[Path]:
    """The folders of ``torch_shm_manager`` (the daemon of torch's ``file_system`` sharing, started by
    the first process that shares a bucket) whose socket no process holds any longer. The manager
    removes its folder when its last client leaves; one killed with its rank (Ray ends a rank's
    processes with a SIGKILL) cannot, and every job's trainer left one."""
    # A socket file exists from its bind on: seen before the list of held sockets is read, one that
    # is not held then was closed (a manager still starting has made its folder but no socket yet).
    bound = set(Path(tempfile.gettempdir()).glob("torch-shm-dir-*/manager.sock"))
    try:
        held = listening_sockets()
    except OSError:  # not Linux: nothing can be told apart
        return set()
    return {sock.parent for sock in bound if str(sock) not in held and refused(sock)}


def shm_managers(parents: list[int]) -> tuple[int, ...]:
    """The pids of the ``torch_shm_manager`` daemons that processes ``parents`` started (their children
    while the parents live)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if comm.endswith("(torch_shm_manag") and int(fields.split()[1]) in parents:  # comm: 15 characters
            found.append(int(stat.parent.name))
    return tuple(found)


def reap_manager_dirs(managers: tuple[int, ...] = (), wait_s: float = 0.0) -> int:
    """Remove the orphaned manager folders on this node (another user's stay), once the ``managers``
    have exited or ``wait_s`` has passed; how many went."""
    wait_exited(managers, wait_s)
    orphans = orphaned_manager_dirs()
    for folder in orphans:
        shutil.rmtree(folder, ignore_errors=True)
    return sum(not folder.exists() for folder in orphans)
