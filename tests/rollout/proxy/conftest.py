"""The proxy stack for these tests: a taught tiny model in the embedded engine (with its request
log on), the real sgl-router in front, and the proxy in front of that; all real processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inverted.processes import ManagedProcess
from tests.conftest import ProcessPool, server_requests
from tests.rollout.proxy.scripted import teach


@pytest.fixture(scope="session")
def taught_model(tiny_model, models_dir) -> Path:
    out = models_dir / "taught-qwen2"
    if not (out / "config.json").exists():
        teach(tiny_model("qwen2"), out)
    return out


@dataclass
class Stack:
    engine: ManagedProcess
    router: ManagedProcess
    proxy: ManagedProcess
    model: Path

    def engine_requests(self) -> list[dict]:
        """What the server received and produced, from its own request log."""
        return server_requests(self.engine)

    def engine_metric(self, name: str) -> float:
        for line in httpx.get(self.engine.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"the engine has no metric {name}")


def start_stack(pool: ProcessPool, model: Path, backend: str = "embedded") -> Stack:
    engine = pool.logged_server(backend, model)
    router = pool.routed(engine)
    proxy = pool.proxy(router.url, model, "--proxy-api-key", "admin-key")
    return Stack(engine, router, proxy, model)


@pytest.fixture(scope="session")
def stack(session_procs, taught_model) -> Stack:
    """One stack for this folder's modules (per test process). Each test reads only what it caused:
    the engine's log and the metrics after a mark it took first. A module that pauses the engine or
    changes its weight version starts its own (``test_pause``)."""
    return start_stack(session_procs, taught_model)
