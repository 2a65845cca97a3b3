"""Process plumbing the services share: children that die with their parent (``ManagedProcess``
starts one with its log file and waits for its health), free ports, one app served by several
processes on one port, and a heap that Python's collector leaves alone once started.

``serve_workers`` exists for two reasons. uvicorn's own ``--workers`` share one listening socket,
and asyncio accepts every pending connection when it wakes, so a burst of new connections lands
on whichever worker woke first (seen with ``ss``: all four of ``bench/buffer_throughput.py``'s on
one of three workers). Here every worker binds the port itself with ``SO_REUSEPORT`` (Linux), and
the kernel spreads new connections over the workers by a hash of their addresses. And uvicorn's
workers outlive a supervisor killed with SIGKILL; ours die with it.

A command line is readable by everyone on the machine (``ps``, ``/proc/PID/cmdline``), so a key
never goes on one. An argument wrapped in ``Secret`` is handed over by ``ManagedProcess.spawn``
through a pipe instead: the child is ``python -m inverted.processes FD MODULE ARGS...``, which
reads the secret arguments from the pipe and runs ``MODULE`` as ``__main__`` with all of them, so
the servers we launch (ours, sgl-router's launcher) take their keys as the flags they document, and
``ps`` shows everything but the keys. A script run by its path in another environment, where
``inverted`` is not installed (SGLang's launcher), gets ``--secrets-fd FD`` first and reads the pipe
itself.

uvicorn times out a connection only between requests (keep-alive); one that opens and never
finishes its headers is held forever, so enough of them (20,100 in the audit) leave no room for
anyone else. Every service is served with ``HeaderDeadline``: a request's headers must arrive
within ``HEADERS_TIMEOUT_S`` of its first byte (or of the connection, for the first), else the
connection is closed.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import httpx
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inverted.errors import ServiceUnavailable

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Take everything made so far (imports, tokenizer, model) out of Python's cyclic collector.

    A service that imports torch and transformers holds ~240k objects that live as long as it does.
    Every full collection walks them all, with the GIL held: 150-240 ms (measured in the proxy and
    the controller during jobs). One such pause at the start of a rollout delayed half of its model
    calls by 0.2-0.4 s. Frozen objects are never collected, so call this once, when startup is done.
    """
    gc.collect()
    gc.freeze()


def die_with_parent(parent: int | None = None) -> None:
    """In a child: get SIGTERM when the parent dies, so a crashed or killed parent (a job, a Ray
    actor, a supervisor) leaves no orphaned servers behind (Linux; elsewhere a no-op).

    ``parent``: its pid, for a child that gets here long after it started (a Python process that
    first imports): if the parent died meanwhile, no signal will come, so the child ends now.
    """
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other ``SO_REUSEPORT`` sockets of this user may share."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def tcp_sockets(port: int, state: str) -> set[str]:
    """Inodes of this machine's TCP sockets on local ``port`` in ``state`` (Linux ``/proc/net/tcp``'s
    hex code: ``"0A"`` listening, ``"01"`` established); how a caller sees that every worker listens."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in map(str.split, rows.readlines()[1:]):
                if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == state:
                    found.add(row[9])
    return found


HEADERS_TIMEOUT_S = 10.0


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's HTTP protocol (httptools), with a deadline on each request's headers: a client that
    connects and sends nothing, or its headers a byte at a time, is closed after ``HEADERS_TIMEOUT_S``
    (bodies have their own bound, each service's body limit; idle keep-alive is uvicorn's 5 s)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._deadline: Any = self.loop.call_later(HEADERS_TIMEOUT_S, self._too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # the next request on a kept-alive connection
            self._deadline = self.loop.call_later(HEADERS_TIMEOUT_S, self._too_slow)

    def on_headers_complete(self) -> None:
        self._cancel()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


# How every service is served: quiet (each logs its own events), with the header deadline.
UVICORN_OPTIONS: dict[str, Any] = {"log_level": "warning", "access_log": False, "http": HeaderDeadline}


def _worker(app_factory: str, host: str, port: int, supervisor: int, setup: Callable[[], None] | None) -> None:
    import uvicorn

    die_with_parent(supervisor)
    if setup is not None:
        setup()
    config = uvicorn.Config(app_factory, factory=True, **UVICORN_OPTIONS)
    uvicorn.Server(config).run(sockets=[reuse_port_socket(host, port)])


def serve_workers(
    app_factory: str, host: str, port: int, workers: int, name: str, setup: Callable[[], None] | None = None
) -> None:
    """Serve ``app_factory`` (``"module:function"``, called in each worker) from ``workers`` processes
    until SIGTERM or SIGINT; a worker that dies is replaced. The environment reaches the workers, and
    each runs ``setup`` first (the entry point's: a fresh interpreter has none of its set-up)."""
    holder = reuse_port_socket(host, port)  # never listens: keeps the port ours while workers come and go
    spawn = multiprocessing.get_context("spawn")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def start() -> multiprocessing.process.BaseProcess:
        process = spawn.Process(target=_worker, args=(app_factory, host, port, os.getpid(), setup), name=name)
        process.start()
        return process

    running = [start() for _ in range(workers)]
    while not stop.wait(0.5):
        for i, process in enumerate(running):
            if not process.is_alive():
                logger.warning(
                    "%s worker (pid %d) exited with code %s; starting another", name, process.pid, process.exitcode
                )
                running[i] = start()
    for process in running:
        process.terminate()
    for process in running:
        process.join(10)
        if process.is_alive():
            process.kill()
    holder.close()


LOWEST_PORT = 20000  # below it: the ports services are configured on (8000, 8080, ...) and Ray's workers' (10002-19999)
_DRAW = random.SystemRandom()  # from os.urandom: two processes that seeded ``random`` alike still draw apart
_GIVEN: set[int] = set()  # the ports ``free_port`` handed out in this process


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_exited(pids: Iterable[int], wait_s: float) -> None:
    """Until none of ``pids`` is alive, or ``wait_s`` has passed (a process just killed is still exiting)."""
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds, for a server about to start, drawn at random from below the ephemeral range.

    The port the kernel picks for a bind to 0 comes from the ephemeral range, where every outgoing
    connection takes its local port too: between this check and the server's own bind a client
    could take it ("address already in use", seen with two test processes connecting all the time).
    A port this process handed out is never handed out again: its server may not have bound it yet
    (a job draws its proxy's port, then its router's metrics port and its servers' ports while the
    proxy still imports; seen once: a resumed job's proxy found its port taken, and its requests were
    answered 404 by whatever held it).
    """
    low = ephemeral_ports()[0]
    if low > LOWEST_PORT + 1000:
        for _ in range(100):
            port = _DRAW.randrange(LOWEST_PORT, low)
            if port in _GIVEN:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket() as sock:  # a machine whose ephemeral range leaves no room below it
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _GIVEN.add(port)
    return port


class Terminable(Protocol):
    """A process handle that stops its process and waits for it to exit (``ManagedProcess``, a Ray actor's)."""

    def terminate(self, grace: float = 10.0) -> None: ...


def terminate_all(processes: Iterable[Terminable]) -> None:
    """Stop ``processes`` side by side: each waits for its own exit (a server's graceful shutdown, a
    Ray actor's round trip), so one after the other they would wait in turn."""
    with ThreadPoolExecutor(thread_name_prefix="terminate") as pool:
        for done in [pool.submit(process.terminate) for process in processes]:
            done.result()


class Secret(str):
    """A command-line argument that must not show in ``ps`` (a key): ``ManagedProcess.spawn`` pipes it."""


def run_as_main(module: str, args: list[str]) -> None:
    """In an interpreter already running: become ``python -m MODULE ARGS...``."""
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_with_secret_arguments(argv: list[str]) -> None:
    """``python -m inverted.processes FD MODULE ARGS...``: run ``MODULE`` as ``__main__`` with ``ARGS``
    and the arguments its parent wrote to the pipe ``FD`` (``ManagedProcess.spawn``)."""
    fd, module, *args = argv
    with os.fdopen(int(fd)) as pipe:
        secret = json.load(pipe)
    run_as_main(module, [*args, *secret])


@dataclass
class ManagedProcess:
    """A child process with its log file; ``tail`` is what a failure report shows."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str

    @classmethod
    def spawn(
        cls,
        name: str,
        argv: list[str],
        log_path: Path,
        url: str,
        env: dict[str, str] | None = None,
        append: bool = False,
    ) -> "ManagedProcess":
        """Start ``argv`` (its ``Secret`` arguments through a pipe: ``python -m MODULE``, or ``python SCRIPT.py``
        that reads ``--secrets-fd FD``);
        ``append``: after what the log holds (a restart keeps its predecessor's last words)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        secret = [str(a) for a in argv if isinstance(a, Secret)]
        read_end = None
        if secret:
            script = len(argv) > 1 and str(argv[1]).endswith(".py")
            if argv[1:2] != ["-m"] and not script:
                raise ValueError(
                    f"{name}: secret arguments go to 'python -m MODULE' or 'python SCRIPT.py' commands "
                    f"only, not {argv[:3]}"
                )
            read_end, write_end = os.pipe()
            with os.fdopen(write_end, "w") as pipe:  # a few hundred bytes: the pipe's buffer holds them
                json.dump(secret, pipe)
            public = [a for a in argv[2:] if not isinstance(a, Secret)]
            argv = (
                [argv[0], argv[1], "--secrets-fd", str(read_end), *public]
                if script
                else [argv[0], "-m", __name__, str(read_end), *public]
            )
        try:
            with open(log_path, "ab" if append else "wb") as log:
                popen = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                    preexec_fn=die_with_parent,
                    pass_fds=() if read_end is None else (read_end,),
                )
        finally:
            if read_end is not None:
                os.close(read_end)
        logger.info("started %s (pid %d): %s", name, popen.pid, url)
        return cls(name, popen, log_path, url)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def exited(self) -> bool:
        return self.popen.poll() is not None

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise ServiceUnavailable(f"{self.name} exited with code {code}; log tail:\n{self.tail()}", url=self.url)

    def wait_healthy(self, timeout: float, path: str = "/health") -> None:
        """Poll ``path`` until it answers 200; raise ServiceUnavailable (with the log tail) if the
        process dies or ``timeout`` seconds pass. Blocking: async callers run it in a thread."""
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    if http.get(self.url + path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise ServiceUnavailable(
            f"{self.name} not healthy after {timeout:.0f}s; log tail:\n{self.tail()}", url=self.url
        )

    def terminate(self, grace: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=grace)


if __name__ == "__main__":
    run_with_secret_arguments(sys.argv[1:])
