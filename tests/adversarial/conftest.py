"""Hostile clients against real services on loopback: each service started with keys and with
limits small enough to reach in a test, and the probes every test uses."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest

from inverted.processes import ManagedProcess

ADMIN_KEY, PROXY_KEY, BUFFER_KEY = "admin-key", "proxy-key", "buffer-key"
MAX_SESSIONS = 6


@dataclass
class Services:
    engine: ManagedProcess
    router: ManagedProcess
    proxy: ManagedProcess
    buffer: ManagedProcess


@pytest.fixture(scope="module")
def services(module_procs, tiny_model, tmp_path_factory) -> Services:
    model = tiny_model("qwen2")
    # the router calls /generate without a key, so the engine guards only its control routes here
    engine = module_procs.engine(model, "--context-length", "256", "--admin-api-key", ADMIN_KEY)
    router = module_procs.routed(engine)
    proxy = module_procs.proxy(
        router.url,
        model,
        "--proxy-api-key",
        PROXY_KEY,
        "--context-length",
        "256",
        "--proxy-max-sessions",
        str(MAX_SESSIONS),
        "--proxy-max-session-tokens",
        "600",
    )
    data = tmp_path_factory.mktemp("buffer") / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"prompt {i}", "label": i}) + "\n" for i in range(8)))
    buffer = module_procs.buffer(
        data.parent / "buffer.db", "--api-key", BUFFER_KEY, "--prompt-data", str(data), "--n-samples-per-prompt", "2"
    )
    return Services(engine, router, proxy, buffer)


# Made once: building a client (its TLS context) takes 20-50 ms, several times that on a loaded
# machine, and is none of the service's latency. No keep-alive: each probe is a new connection.
_PROBE = httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


def health_latency(url: str) -> float:
    started = time.perf_counter()
    assert _PROBE.get(url + "/health").status_code == 200
    return time.perf_counter() - started


class Beside:
    """Run ``call`` on a thread; meanwhile ``health_p_max`` samples the service's ``/health`` latency."""

    def __init__(self, call):
        self.result: object = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.result = call()
        except Exception as exc:  # the test asserts on it
            self.result = exc

    def health_while_running(self, url: str, timeout: float) -> list[float]:
        latencies = []
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            latencies.append(health_latency(url))
            time.sleep(0.05)
        self.thread.join(max(0.0, deadline - time.monotonic()))
        assert not self.thread.is_alive(), f"still no answer after {timeout} s"
        return latencies


def raw_request(url: str, head: str, body: bytes = b"", timeout: float = 10) -> tuple[int, dict]:
    """Send exactly these bytes (a declared length need not come) and read the status and JSON answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, rest = data.split(b"\r\n", 1)
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1] or b"null")


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 1 << 30


def declared_huge(path: str, host: str, headers: str = "") -> str:
    """Headers that announce a 1 GB JSON body (none of which is ever sent)."""
    return f"POST {path} HTTP/1.1\nHost: {host}\nContent-Type: application/json\n{headers}Content-Length: {1 << 30}\n"
