"""Servers for the tests, forked from an interpreter that has already imported what they import.

A server started as ``python -m inverted.cli serve-engine ...`` spends ~2.5 s of CPU importing
torch, transformers and FastAPI before it reads its first flag (measured: 2.8 s to ``/health`` for
an engine, 2.9 s for a proxy), and the suite starts over a hundred of them on two cores. Here one
process per test worker (the zygote, as Android names the same trick) imports all of that once and
then forks a child per server: the child points its output at the server's log, takes the
environment its parent would have passed, and runs the same module as ``__main__`` with the same
arguments, through the same entry point. It is a real process on its own pid, signalled and killed
like any other; its exit status comes from the zygote, its parent, which reaps it when asked.

The zygote only imports: no parallel region runs, so there is no OpenMP pool for a fork to break.
The one thread it has besides its own is OpenBLAS's (numpy's), which OpenBLAS shuts down before any
fork (``pthread_atfork``). ``spin_briefly`` runs first, as the engine's command runs it, because
libgomp reads its spin count when torch loads it.

Protocol: one JSON line per request on the zygote's stdin, one JSON line back on its stdout:
``{"spawn": [module, args...], "log": path, "append": bool, "env": {...}}`` -> ``{"pid": N}``, and
``{"poll": pid}`` -> ``{"returncode": int | null}``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "fastapi",
    "uvicorn",
    "httpx",
    "sglang_router.launch_router",
    "inverted.engine.server",
    "inverted.rollout.proxy.service",
    "inverted.buffer.service",
)


def _serve() -> dict:
    """The zygote's loop; returns only in a forked child, with the request it is to run."""
    from inverted.cli import spin_briefly

    spin_briefly()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)

    for line in sys.stdin:
        request = json.loads(line)
        if "poll" in request:
            pid, status = os.waitpid(request["poll"], os.WNOHANG)
            reply = {"returncode": os.waitstatus_to_exitcode(status) if pid else None}
        else:
            pid = os.fork()
            if pid == 0:
                return request
            reply = {"pid": pid}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    sys.exit(0)  # the test worker closed the pipe: it is done


def _run(request: dict, zygote: int) -> None:
    """In the child: become ``python -m MODULE ARGS`` with its output in the log."""
    from inverted.processes import die_with_parent, run_as_main

    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    log = os.open(request["log"], flags, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, onto in ((null, 0), (log, 1), (log, 2)):  # also closes the zygote's pipes
        os.dup2(fd, onto)
    os.close(log)
    os.close(null)
    # PYTHONUNBUFFERED's effect, which a forked interpreter read long ago
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), write_through=True, errors="backslashreplace"
    )
    os.environ.clear()
    os.environ.update(request["env"])
    die_with_parent(zygote)
    module, *args = request["spawn"]
    run_as_main(module, args)


class Child:
    """A forked server, answering as ``subprocess.Popen`` does for what ``ManagedProcess`` and the tests use."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.request({"poll": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # unreaped until polled, so the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test worker's handle on its zygote, started on first use; safe to call from several threads."""

    def __init__(self):
        from inverted.processes import die_with_parent

        self.lock = threading.Lock()
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )

    def request(self, message: dict) -> dict:
        with self.lock:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote exited with code {self.process.wait()}")
        return json.loads(line)

    def spawn(self, argv: list[str], log_path: Path, append: bool = False) -> Child:
        """``argv``: ``[sys.executable, "-m", MODULE, ARGS...]``, as ``ManagedProcess.spawn`` takes it."""
        if argv[:2] != [sys.executable, "-m"]:
            raise ValueError(f"the zygote runs 'python -m MODULE' commands only, not {argv[:3]}")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        pid = self.request({"spawn": argv[2:], "log": str(log_path), "append": append, "env": env})["pid"]
        return Child(self, pid)


if __name__ == "__main__":
    _run(_serve(), os.getppid())
