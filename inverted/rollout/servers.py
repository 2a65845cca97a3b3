"""Start rollout servers (embedded engines) behind the real sgl-router, and stop them cleanly.

``RolloutServers`` is an async context manager: it launches N ``inverted serve-engine``
processes on free loopback ports and one ``python -m sglang_router.launch_router`` (every
``--router-*`` flag passed through verbatim), waits for each engine's ``/health``, registers them
with the router's ``POST /workers`` and waits until the router reports them healthy. ``add_engine``
starts and registers one more while running. On exit every child gets SIGTERM, then SIGKILL after
a grace period. A child that dies during startup raises ``ServiceUnavailable`` with its exit code
and the tail of its log.

Real SGLang servers (``python -m sglang.launch_server``) join through the same registration path;
launching them is the orchestration layer's job (a later issue), since it needs GPU placement.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from inverted.config import ServersConfig
from inverted.errors import ServiceUnavailable
from inverted.rollout.sglang_client import RouterClient, SGLangClient

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ManagedProcess:
    """A child process with its log file; ``tail`` is what a failure report shows."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str

    @classmethod
    def spawn(cls, name: str, argv: list[str], log_path: Path, url: str) -> "ManagedProcess":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        logger.info("started %s (pid %d): %s", name, popen.pid, url)
        return cls(name, popen, log_path, url)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

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
        raise ServiceUnavailable(f"{self.name} not healthy after {timeout:.0f}s; log tail:\n{self.tail()}", url=self.url)

    def terminate(self, grace: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=grace)


class RolloutServers:
    """N embedded engines behind one sgl-router; use as ``async with RolloutServers(cfg) as s``."""

    def __init__(self, config: ServersConfig, router_args: list[str] | None = None):
        self.config = config
        self.router_args = list(router_args or [])
        self.log_dir = Path(config.log_dir)
        self.engines: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        self.router_url = ""

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _engine_threads(self) -> int:
        return self.config.engine_threads or max(1, (os.cpu_count() or 1) // self.config.num_engines)

    def _spawn_engine(self) -> ManagedProcess:
        port = free_port()
        index = len(self.engines)
        argv = [sys.executable, "-m", "inverted.cli", "serve-engine", "--model", self.config.hf_checkpoint,
                "--host", "127.0.0.1", "--port", str(port), "--device", self.config.engine_device,
                "--max-running-requests", str(self.config.engine_max_running_requests),
                "--num-threads", str(self._engine_threads())]
        proc = ManagedProcess.spawn(f"engine-{index}", argv, self.log_dir / f"engine-{index}.log", f"http://127.0.0.1:{port}")
        self.engines.append(proc)
        return proc

    def _spawn_router(self) -> ManagedProcess:
        port = self.config.router_port or free_port(self.config.router_host)
        given = {arg.split("=", 1)[0] for arg in self.router_args if arg.startswith("--")}
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.config.router_host, "--port", str(port)]
        if "--prometheus-port" not in given:  # the default 29000 would clash between routers
            argv += ["--prometheus-port", str(free_port())]
        if "--log-level" not in given:
            argv += ["--log-level", "warn"]
        argv += self.router_args
        url = f"http://{self.config.router_host}:{port}"
        return ManagedProcess.spawn("router", argv, self.log_dir / "router.log", url)

    async def __aenter__(self) -> "RolloutServers":
        try:
            await self.start()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    async def start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        self.router = self._spawn_router()
        self.router_url = self.router.url
        engines = [self._spawn_engine() for _ in range(self.config.num_engines)]
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy, deadline - time.monotonic()) for e in engines))
        await asyncio.to_thread(self.router.wait_healthy, deadline - time.monotonic(), "/workers")
        for engine in engines:
            await self.register(engine, deadline)
        logger.info("router %s serving %d engines", self.router_url, len(self.engines))


    async def register(self, engine: ManagedProcess, deadline: float) -> None:
        """``POST /workers`` and wait until the router marks the worker healthy."""
        async with RouterClient(self.router_url) as router:
            await router.add_worker(engine.url)
            while time.monotonic() < deadline:
                self.router.check_alive()
                if engine.url in await router.healthy_urls():
                    return
                await asyncio.sleep(0.2)
        raise ServiceUnavailable(f"router did not activate {engine.url}; log tail:\n{self.router.tail()}", url=self.router_url)

    async def add_engine(self) -> str:
        """Start one more engine and register it with the router; return its URL."""
        deadline = time.monotonic() + self.config.startup_timeout
        engine = self._spawn_engine()
        await asyncio.to_thread(engine.wait_healthy, deadline - time.monotonic())
        await self.register(engine, deadline)
        return engine.url

    def stop(self) -> None:
        for proc in [*self.engines, *([self.router] if self.router else [])]:
            proc.terminate()
        if self.engines or self.router:
            logger.info("stopped router and %d engines", len(self.engines))


async def run_demo(config: ServersConfig, router_args: list[str]) -> None:
    """Start engines behind the router, send chat prompts through it, print what came back."""
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
    prompts = ["What is 17 + 25?", "Name three colors.", "Count from one to five.", "Say hello to the world.",
               "What is 6 times 7?", "Write a short question.", "List two numbers.", "Solve 9 - 4."]
    console = Console()
    async with RolloutServers(config, router_args) as servers:
        console.print(f"router {servers.router_url} -> engines {', '.join(servers.engine_urls)}")
        async with SGLangClient(servers.router_url) as client:
            async def ask(question: str) -> dict:
                text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                    tokenize=False)
                return await client.generate({"input_ids": tokenizer.encode(text), "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 24, "temperature": 1.0}})
            started = time.monotonic()
            results = await asyncio.gather(*(ask(p) for p in prompts))
            elapsed = time.monotonic() - started
    table = Table(title="generated through sgl-router (random-weight model: the text is noise by design)")
    for column in ("prompt", "sampled text", "tokens", "mean logprob", "finish", "version"):
        caps = {"prompt": 14, "sampled text": 16}  # fits 80 columns; the others keep their full headers
        table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=caps.get(column), min_width=len(column) if column not in caps else None)
    for prompt, out in zip(prompts, results):
        meta = out["meta_info"]
        lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
        shown = " ".join(out["text"].replace("\ufffd", "").split())[:32]  # one line of the (random) text
        table.add_row(prompt, shown, str(len(out["output_ids"])), f"{sum(lps) / len(lps):.3f}",
                      meta["finish_reason"]["type"], meta["weight_version"])
    console.print(table)
    tokens = sum(len(o["output_ids"]) for o in results)
    console.print(f"{len(prompts)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s)")
