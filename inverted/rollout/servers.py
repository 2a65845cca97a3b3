"""Start rollout servers behind the real sgl-router, and stop them cleanly.

``RolloutServers`` is an async context manager: it launches N rollout servers and one ``python -m
sglang_router.launch_router`` (every ``--router-*`` flag passed through verbatim), waits for each
server's ``/health``, registers them with the router's ``POST /workers`` and waits until the router
reports them healthy. While running, ``add_engine`` adds one more server, ``dead`` lists the servers
whose process has exited, ``retire`` takes one out of the router, and ``start_engine``, ``adopt`` and
``register`` bring a replacement in (the job gives it the current weights before ``adopt``, so it never
serves stale ones). On exit every child gets SIGTERM, then SIGKILL after a grace period. A child that
dies during startup raises ``ServiceUnavailable`` with its exit code and the tail of its log.

The servers are real SGLang (its ``sglang.launch_server``, every ``--sglang-*`` flag passed through,
started by ``sglang_cpu/launch.py`` with ``--rollout-sglang-python``'s interpreter, which sets SGLang's
CPU path on a machine without a GPU) or embedded engines (``inverted serve-engine``), per
``--rollout-backend``; ``auto`` picks SGLang where the package and CUDA are present, and the embedded
engine on a CPU, where it starts in seconds and decodes faster (``bench/engine_throughput.py
--vs-sglang``). Where a server runs is the ``launch``
function's business: on this machine by default, or in a Ray placement bundle
(``inverted.placement``), which hands back a handle with the same methods as ``ManagedProcess``.
In a LoRA run both kinds start with the same LoRA flags (``lora_argv``), and with rollout routing
replay with ``--enable-return-routed-experts`` (``ROUTED_EXPERTS_ARGV``): the job's ``flags``.

The router keeps its cache-aware policy, with tighter load balancing than its defaults (which let
one server run 64 more requests than another): an RL batch arrives at once, often with one
system prompt in every request, and cache-aware routing alone then sends all of it to one server
(measured on the demo: one engine did 84% of the work). ``--router-*`` flags override each default.

With keys set (``inverted train`` sets random ones) the router runs with its own authentication:
``/workers`` takes only the admin key (sgl-router's control plane), ``/generate`` only the router
key, which it sends on to the servers, which require it too. ``verify_workers`` checks that the
router serves no worker these servers do not include (the job calls it before each training step).

Workers are registered with a failure threshold well above the router's default, and real SGLang
servers run with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``: a server paused for a weight
update answers its health probe late, and must not be evicted for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from inverted.devices import cuda_available
from inverted.errors import ServiceUnavailable, UnknownWorker
from inverted.hf_checkpoint import context_length
from inverted.processes import ManagedProcess, Secret, Terminable, free_port, terminate_all
from inverted.rollout.config import ServersConfig
from inverted.rollout.sglang_client import RouterClient, SGLangClient
from inverted.types import POLICY_ADAPTER

logger = logging.getLogger(__name__)

HEALTH_FAILURE_THRESHOLD = 10  # the router's default is 3 probes (~3 minutes at its 60 s interval)
ROUTER_DEFAULTS = {"--log-level": "warn", "--balance-abs-threshold": "2", "--balance-rel-threshold": "1.1"}


class ServerHandle(Terminable, Protocol):
    """A launched server process, wherever it runs (``ManagedProcess`` here, a Ray actor's elsewhere)."""

    name: str
    url: str

    def check_alive(self) -> None: ...
    def tail(self, lines: int = 30) -> str: ...
    def wait_healthy(self, timeout: float, path: str = "/health") -> None: ...


ArgvFor = Callable[[str, int], list[str]]  # (host, port) -> the server's command line
Launch = Callable[[str, ArgvFor, Path, dict[str, str]], ServerHandle]  # (name, argv_for, log, env)


def launch_local(name: str, argv_for: ArgvFor, log_path: Path, env: dict[str, str]) -> ManagedProcess:
    """Start a server on this machine, on a free loopback port."""
    port = free_port()
    return ManagedProcess.spawn(name, argv_for("127.0.0.1", port), log_path, f"http://127.0.0.1:{port}", env)


def resolve_backend(config: ServersConfig) -> str:
    """``sglang`` or ``embedded`` for ``--rollout-backend`` (``auto``: SGLang when it can run here)."""
    if config.rollout_backend != "auto":
        return config.rollout_backend
    import importlib.util

    if not cuda_available():
        return "embedded"
    try:
        return "sglang" if importlib.util.find_spec("sglang.launch_server") else "embedded"
    except (ImportError, ValueError):  # a partial or stand-in sglang package: not a server we can launch
        return "embedded"


def lora_argv(rank: int, modules: list[str], preload: str | None = None) -> list[str]:
    """Server flags for a LoRA run (the same in SGLang and the embedded engine): adapters of up to
    ``rank`` on ``modules``; ``preload``: a PEFT directory served as ``POLICY_ADAPTER`` from the start
    (else the first weight sync brings the adapter)."""
    argv = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules]
    return argv + (["--lora-paths", f"{POLICY_ADAPTER}={preload}"] if preload else [])


# How a real SGLang server starts (the machine's settings for SGLang, on the node it lands on): a file
# run by its path with SGLang's interpreter, which need not hold inverted.
SGLANG_LAUNCH = Path(__file__).with_name("sglang_cpu") / "launch.py"

# SGLang's flag (and the embedded engine's) for /generate's return_routed_experts.
ROUTED_EXPERTS_ARGV = ["--enable-return-routed-experts"]


def engine_argv(
    cfg: ServersConfig, backend: str, sglang_args: list[str], flags: list[str], threads: int, host: str, port: int
) -> list[str]:
    """The command line of one rollout server (a plain function, so a Ray actor can receive it)."""
    # one argument each: a random key may begin with "-", which argparse would take for a flag
    # through a pipe, never on the command line (processes.Secret)
    keys = [Secret(f"--admin-api-key={cfg.admin_api_key}")] if cfg.admin_api_key else []
    keys += [Secret(f"--api-key={cfg.router_api_key}")] if cfg.router_api_key else []  # what the router sends on
    length = ["--context-length", str(cfg.context_length)] if cfg.context_length else []
    length += ["--max-total-tokens", str(cfg.max_total_tokens)] if cfg.max_total_tokens else []
    if backend == "sglang":  # its OpenAI routes render chats: with the job's template (the embedded engine has none)
        template = ["--chat-template", cfg.chat_template] if cfg.chat_template else []
        python = cfg.rollout_sglang_python or sys.executable
        return [
            python,
            str(SGLANG_LAUNCH),
            "--model-path",
            cfg.hf_checkpoint,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(cfg.rollout_num_gpus_per_engine),
            *keys,
            *length,
            *template,
            *flags,
            *sglang_args,
        ]
    return [
        sys.executable,
        "-m",
        "inverted.cli",
        "serve-engine",
        "--model",
        cfg.hf_checkpoint,
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        cfg.engine_device,
        "--dtype",
        cfg.engine_dtype,
        "--max-running-requests",
        str(cfg.engine_max_running_requests),
        "--stored-copy-rows",
        str(cfg.engine_stored_copy_rows),
        "--num-threads",
        str(threads),
        *keys,
        *length,
        *flags,
    ]


class RolloutServers:
    """N rollout servers behind one sgl-router; use as ``async with RolloutServers(cfg) as s``."""

    def __init__(
        self,
        config: ServersConfig,
        router_args: list[str] | None = None,
        sglang_args: list[str] | None = None,
        launch: Launch = launch_local,
        flags: list[str] | None = None,
    ):
        """``flags``: what the job's mode adds to every server's command line (``lora_argv``,
        ``ROUTED_EXPERTS_ARGV``)."""
        # Every server, and the proxy in front of them, holds requests to one length, decided here
        # (SGLang's own default would be the model's whole max_position_embeddings).
        self.config = config = dataclasses.replace(
            config, context_length=context_length(config.hf_checkpoint, config.context_length)
        )
        self.router_args = list(router_args or [])
        self.sglang_args = list(sglang_args or [])
        self.flags = list(flags or [])
        self.launch = launch
        self.backend = resolve_backend(config)
        self.log_dir = Path(config.log_dir)
        self.engines: list[ServerHandle] = []
        self.launched = 0  # servers started so far, replacements included (names their logs)
        self.started: set[str] = set()  # their URLs: the only workers the router may serve
        self.router: ManagedProcess | None = None
        # Known before ``start``, so that a client of the router (the proxy) can boot alongside it.
        self.router_url = f"http://{config.router_host}:{config.router_port or free_port(config.router_host)}"

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _engine_threads(self) -> int:
        return self.config.engine_threads or max(1, (os.cpu_count() or 1) // self.config.num_engines)

    def _spawn_engine(self, name: str) -> ServerHandle:
        """Launch a server named by ``_next_name`` (which runs on the event loop; this may not)."""
        threads = self._engine_threads()
        env = (
            {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "OMP_NUM_THREADS": str(threads)}
            if self.backend == "sglang"
            else {}
        )
        argv_for = functools.partial(engine_argv, self.config, self.backend, self.sglang_args, self.flags, threads)
        handle = self.launch(name, argv_for, self.log_dir / f"{name}.log", env)
        self.started.add(handle.url)
        return handle

    def _next_name(self) -> str:
        name, self.launched = f"engine-{self.launched}", self.launched + 1
        return name

    def _spawn_router(self, append: bool = False) -> ManagedProcess:
        port = self.router_url.rsplit(":", 1)[1]
        given = {arg.split("=", 1)[0] for arg in self.router_args if arg.startswith("--")}
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.config.router_host, "--port", port]
        # Its metrics bind where it does (sgl-router's default is 0.0.0.0, and the page lists the
        # servers' URLs), on a port of their own: 29000 would clash between routers.
        host = self.config.router_host
        defaults = {**ROUTER_DEFAULTS, "--prometheus-host": host, "--prometheus-port": str(free_port(host))}
        for flag, value in defaults.items():
            if flag not in given:
                argv += [flag, value]
        # sgl-router's own authentication: /generate takes the data key (which it sends on to the
        # servers), /workers only the job's admin key ('id:name:role:key'), so nobody else on the
        # machine can add a worker of their own or generate through the job's servers. The keys go
        # through a pipe, never on the command line (processes.Secret).
        if self.config.router_api_key:
            argv.append(Secret(f"--api-key={self.config.router_api_key}"))
        if self.config.admin_api_key:
            argv.append(Secret(f"--control-plane-api-keys=inverted:job:admin:{self.config.admin_api_key}"))
        argv += self.router_args
        return ManagedProcess.spawn("router", argv, self.log_dir / "router.log", self.router_url, append=append)

    def control(self) -> RouterClient:
        """A client of the router's worker API, with the job's admin key."""
        return RouterClient(self.router_url, api_key=self.config.admin_api_key)

    async def verify_workers(self, heal: Callable[[], Awaitable[None]] | None = None) -> None:
        """Raise ``UnknownWorker`` if the router serves a worker this object did not start (and take it
        out): its samples must not be trained on. ``heal``: the job's supervisor. A router that does
        not answer is healed (a restart under way is waited out, a dead router started again), and the
        new one is asked: a router killed just before a step must not stop the job."""
        try:
            strangers = await self._strangers()
        except ServiceUnavailable as error:
            if heal is None:
                raise
            logger.warning("the router did not answer (%s); healing the job, then asking again", error)
            await heal()
            strangers = await self._strangers()
        if strangers:
            raise UnknownWorker(
                f"the router served {strangers}, which this job did not start; they are removed, "
                "and what they generated is not trained on",
                url=self.router_url,
            )

    async def _strangers(self) -> list[str]:
        """The workers the router serves that this object did not start, taken out of it."""
        async with self.control() as router:
            strangers = sorted(await router.urls() - self.started)
            for url in strangers:
                await router.remove_worker(url)
        return strangers

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
        engines = [self._spawn_engine(self._next_name()) for _ in range(self.config.num_engines)]
        self.engines += engines
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy, deadline - time.monotonic()) for e in engines))
        await asyncio.to_thread(self.router.wait_healthy, deadline - time.monotonic())
        for engine in engines:
            await self.register(engine, deadline)
        logger.info("router %s serving %d %s servers", self.router_url, len(self.engines), self.backend)

    async def register(self, engine: ServerHandle, deadline: float | None = None) -> None:
        """``POST /workers`` and wait until the router marks the worker healthy."""
        deadline = deadline or time.monotonic() + self.config.startup_timeout
        process = self.router
        assert process is not None, "the router is started first"
        async with self.control() as router:
            await router.add_worker(engine.url, health_failure_threshold=HEALTH_FAILURE_THRESHOLD)
            while time.monotonic() < deadline:
                process.check_alive()
                if engine.url in await router.healthy_urls():
                    return
                await asyncio.sleep(0.2)
        raise ServiceUnavailable(
            f"router did not activate {engine.url}; log tail:\n{process.tail()}", url=self.router_url
        )

    async def start_engine(self) -> ServerHandle:
        """Start one more server and wait until it is healthy; it serves nothing until ``adopt``/``register``.
        Placing it may wait for a node (Ray), so it happens off the event loop: several start at once."""
        engine = await asyncio.to_thread(self._spawn_engine, self._next_name())
        try:
            await asyncio.to_thread(engine.wait_healthy, self.config.startup_timeout)
        except BaseException:
            engine.terminate()
            raise
        return engine

    def adopt(self, engine: ServerHandle) -> None:
        """Count ``engine`` among the servers (weight updates reach it from now on)."""
        self.engines.append(engine)

    async def add_engine(self) -> str:
        """Start one more server and register it with the router; return its URL."""
        engine = await self.start_engine()
        self.adopt(engine)
        await self.register(engine)
        return engine.url

    @property
    def router_exited(self) -> bool:
        return self.router is not None and self.router.exited

    async def restart_router(self) -> None:
        """A new router at the dead one's address, serving every live server again (its state, the
        workers it served, died with it; the proxy's calls meanwhile wait, ``server_loss_wait``)."""
        self.router = self._spawn_router(append=True)
        await asyncio.to_thread(self.router.wait_healthy, self.config.startup_timeout)
        dead = self.dead()
        await asyncio.gather(*(self.register(engine) for engine in self.engines if engine not in dead))

    def dead(self) -> list[ServerHandle]:
        """The servers whose process has exited."""
        gone = []
        for engine in self.engines:
            try:
                engine.check_alive()
            except ServiceUnavailable:
                gone.append(engine)
        return gone

    async def retire(self, engine: ServerHandle) -> None:
        """Take a (dead) server out of the router and of the server list, and clean up after it."""
        self.engines.remove(engine)
        async with self.control() as router:
            await router.remove_worker(engine.url)
        await asyncio.to_thread(engine.terminate)

    def stop(self) -> None:
        terminate_all([*self.engines, *([self.router] if self.router else [])])
        if self.engines or self.router:
            logger.info("stopped router and %d engines", len(self.engines))


async def run_demo(config: ServersConfig, router_args: list[str], sglang_args: list[str]) -> None:
    """Start engines behind the router, send chat prompts through it, print what came back."""
    from rich.console import Console
    from rich.table import Table

    from inverted.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(config.hf_checkpoint, config.chat_template)
    config = dataclasses.replace(
        config,
        admin_api_key=config.admin_api_key or secrets.token_urlsafe(24),
        router_api_key=config.router_api_key or secrets.token_urlsafe(24),
    )
    prompts = [
        "What is 17 + 25?",
        "Name three colors.",
        "Count from one to five.",
        "Say hello to the world.",
        "What is 6 times 7?",
        "Write a short question.",
        "List two numbers.",
        "Solve 9 - 4.",
    ]
    console = Console()
    async with RolloutServers(config, router_args, sglang_args) as servers:
        console.print(f"router {servers.router_url} -> engines {', '.join(servers.engine_urls)}")
        async with SGLangClient(servers.router_url, api_key=config.router_api_key) as client:

            async def ask(question: str) -> Any:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
                )
                return await client.generate(
                    {
                        "input_ids": tokenizer.encode(text),
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 24, "temperature": 1.0},
                    }
                )

            started = time.monotonic()
            results = await asyncio.gather(*(ask(p) for p in prompts))
            elapsed = time.monotonic() - started
    table = Table(title="generated through sgl-router (random-weight model: the text is noise by design)")
    for column in ("prompt", "sampled text", "tokens", "mean logprob", "finish", "version"):
        caps = {"prompt": 14, "sampled text": 16}  # fits 80 columns; the others keep their full headers
        table.add_column(
            column,
            no_wrap=True,
            overflow="ellipsis",
            max_width=caps.get(column),
            min_width=len(column) if column not in caps else None,
        )
    for prompt, out in zip(prompts, results):
        meta = out["meta_info"]
        lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
        shown = " ".join(out["text"].replace("\ufffd", "").split())[:32]  # one line of the (random) text
        table.add_row(
            prompt,
            shown,
            str(len(out["output_ids"])),
            f"{sum(lps) / len(lps):.3f}",
            meta["finish_reason"]["type"],
            meta["weight_version"],
        )
    console.print(table)
    tokens = sum(len(o["output_ids"]) for o in results)
    console.print(f"{len(prompts)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s)")
