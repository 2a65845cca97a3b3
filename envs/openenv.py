"""Any OpenEnv environment (Hugging Face / Meta's ``openenv-core``), played by the policy.

An OpenEnv environment is a server with ``reset`` and ``step``; a client holds one environment
instance per WebSocket connection. Each episode opens its own connection with the library's
``GenericEnvClient`` (plain dicts, no environment package needed), resets it with the row's
arguments (its seed, say), and plays: the **driver** writes each observation as the user's message,
the policy replies through the session's client, the driver reads the reply as an action, and the
server steps. The conversation only grows, so the episode is one branch of its session. The
reward is the sum of the step rewards.

The server is named by the row:

- ``url``: one already running (a container, a Space, a process of your own);
- ``app``: ``module:attr`` of the environment's ASGI app (what ``create_app`` returns), served as
  OpenEnv documents it, ``uvicorn module:attr``, on 127.0.0.1 and a free port: started once per
  process on first use, and stopped when the process exits (or dies).

The driver is a module with ``observe(observation: dict) -> str`` and ``act(reply: str) -> dict``,
and optionally ``SYSTEM_PROMPT``. ``act`` raising ``ValueError`` means the reply is not an action:
the episode ends there with the rewards so far, so the policy is trained on its mistake. Anything
else that goes wrong (the server refusing an action ``act`` let through, say) fails the episode.
``envs.guess_number`` is an environment and its driver.

    python -m envs.openenv --driver envs.guess_number (--app envs.guess_number:app | --url URL) \\
        --out FILE --count N [--seed S] [--max-turns T]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from openenv.core.generic_client import GenericEnvClient

from envs.datasets import write_rows

MODEL = "policy"  # the proxy serves the one policy whatever the name
START_TIMEOUT_S = 60.0

_servers: dict[str, tuple[subprocess.Popen, str, Path]] = {}  # app -> (process, url, log), started here
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None  # looked up before any fork


def _die_with_parent() -> None:
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(app: str) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="openenv-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the app's module as we see it
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
                                    "--log-level", "warning"], stdout=out, stderr=out, env=env,
                                   preexec_fn=_die_with_parent)
    atexit.register(process.terminate)
    return process, f"http://127.0.0.1:{port}", log


async def serve(app: str) -> str:
    """The URL of ``app``'s server, started on first use.

    It is forked from the event loop's thread, not a pool thread: the signal a child gets when its
    parent dies follows the thread that forked it, and pool threads end before the process does.
    """
    if app not in _servers:
        _servers[app] = _spawn(app)
    process, url, log = _servers[app]
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the OpenEnv server {app!r} exited ({process.returncode}): "
                                   f"{log.read_text()[-2000:]}")
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the OpenEnv server {app!r} did not answer {url}/health within {START_TIMEOUT_S:g}s "
                       f"(its log: {log})")


async def episode(task, client) -> float:
    spec = task.metadata["openenv"]
    driver = importlib.import_module(spec["driver"])
    url = spec.get("url") or await serve(spec["app"])
    system = getattr(driver, "SYSTEM_PROMPT", None)
    messages = [{"role": "system", "content": system}] if system else []
    total = 0.0
    async with GenericEnvClient(base_url=url) as env:
        result = await env.reset(**spec.get("reset", {}))
        for _ in range(spec["max_turns"]):
            if result.done:
                break
            messages.append({"role": "user", "content": driver.observe(result.observation)})
            reply = await client.chat.completions.create(model=MODEL, messages=messages)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            try:
                action = driver.act(text)
            except ValueError:  # not an action: the policy's mistake, and its episode's end
                break
            result = await env.step(action)
            total += float(result.reward or 0.0)
    return total


def rows(driver: str, server: dict[str, str], count: int, seed: int, max_turns: int) -> list[dict[str, Any]]:
    importlib.import_module(driver)  # a wrong name fails here, not in every episode
    return [{"input": f"{driver} episode, seed {seed + i}",
             "metadata": {"openenv": {**server, "driver": driver, "reset": {"seed": seed + i}, "max_turns": max_turns}}}
            for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--driver", required=True, help="module with observe(observation) and act(reply)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--app", help="module:attr of the environment's ASGI app, served on first use")
    where.add_argument("--url", help="an environment server already running")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=256, help="episodes to write")
    parser.add_argument("--seed", type=int, default=0, help="row i resets with seed + i")
    parser.add_argument("--max-turns", type=int, default=16, help="model turns per episode at most")
    args = parser.parse_args(argv)
    try:
        written = rows(args.driver, {"app": args.app} if args.app else {"url": args.url}, args.count, args.seed,
                       args.max_turns)
    except ImportError as exc:
        parser.error(f"--driver {args.driver!r}: {exc}")
    print(write_rows(written, args.out))


if __name__ == "__main__":
    main()
