"""Ports for the servers a job or a test starts: free when drawn, and never where outgoing connections
take theirs (the kernel's ephemeral range), so no client can take one before its server binds it. And
the processes a job stops at its end: side by side."""

from __future__ import annotations

import random
import socket
import sys
import time

from inverted import processes
from inverted.processes import LOWEST_PORT, ManagedProcess, ephemeral_ports, free_port, terminate_all


def test_ports_are_drawn_below_the_ephemeral_range_and_apart_in_processes_seeded_alike():
    low, high = ephemeral_ports()
    assert LOWEST_PORT + 1000 < low < high  # this machine leaves room below the range
    random.seed(0)
    first = [free_port() for _ in range(8)]
    random.seed(0)  # a second test process that seeded random the same way draws other ports
    second = [free_port() for _ in range(8)]
    assert all(LOWEST_PORT <= p < low for p in first + second) and first != second
    for port in first:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: a server can bind it


def test_a_held_port_is_passed_over_and_a_range_without_room_falls_back_to_the_kernel(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]
        draws = iter([taken, spare])
        monkeypatch.setattr(processes._DRAW, "randrange", lambda a, b: next(draws))
        assert free_port() == spare
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (LOWEST_PORT, 60999))
    port = free_port()  # the kernel's choice
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_handed_out_is_not_handed_out_again_before_its_server_binds_it(monkeypatch):
    """A job draws its proxy's port, then others while the proxy still imports: the same draw again is
    passed over, though nothing holds the port yet."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        second = probe.getsockname()[1]
    draws = iter([first, first, second])
    monkeypatch.setattr(processes._DRAW, "randrange", lambda a, b: next(draws))
    assert free_port() == first and free_port() == second


# A member of a group that, told to stop, exits cleanly only once every member has been told: stopped
# one after the other, the first would wait out its deadline and be killed.
GROUP_MEMBER = """
import pathlib, signal, sys, time
told, me, size = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def stop(*_):
    (told / me).touch()
    deadline = time.monotonic() + 20
    while len(list(told.iterdir())) < size and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(0 if len(list(told.iterdir())) == size else 3)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_a_jobs_processes_are_stopped_side_by_side(tmp_path):
    """``terminate_all`` (a job's end: its servers, its services) signals every process before it waits
    for any: each exits of its own accord once all were told, none is killed at its grace's end."""
    told = tmp_path / "told"
    told.mkdir()
    members = [
        ManagedProcess.spawn(
            f"member-{i}", [sys.executable, "-c", GROUP_MEMBER, str(told), str(i), "3"], tmp_path / f"{i}.log", "-"
        )
        for i in range(3)
    ]
    deadline = time.monotonic() + 30
    while not all("ready" in m.tail() for m in members) and time.monotonic() < deadline:
        time.sleep(0.05)  # each has its handler in place
    terminate_all(members)
    assert [m.popen.returncode for m in members] == [0, 0, 0], [m.tail() for m in members]
