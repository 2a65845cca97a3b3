"""Any OpenEnv environment (Hugging Face / Meta's ``openenv-core``), played by the policy.

An OpenEnv environment is a server with ``reset`` and ``step``; a client holds one environment
instance per WebSocket connection. Each episode opens its own connection with the library's
``GenericEnvClient`` (plain dicts, no environment package needed), resets it with the row's
arguments (its seed, say), and plays: the **driver** writes each observation as the user's message,
the policy replies through the session's client, the driver reads the reply as an action, and the
server steps. The conversation only grows, so the episode is one branch of its session. The
reward is the sum of the step rewards.

The server and the driver are chosen on the command line, never by a dataset row (a row that
named a module would have it imported): ``--env-args '{"driver": ..., "app": ...}'`` (or ``"url"``;
``"max_turns"``, 16 by default; ``"max_sessions"``, the sessions the server allows, 1 by default as
OpenEnv's) beside ``--env-path envs.openenv:episode``. The server is

- ``url``: one already running (a container, a Space, a process of your own);
- ``app``: ``module:attr`` of the environment's ASGI app (what ``create_app`` returns), served as
  OpenEnv documents it, ``uvicorn module:attr``, on 127.0.0.1 and a free port: started once per
  process on first use, and stopped when the process exits (or dies).

A row carries data only: ``metadata.openenv.reset``, the arguments of the episode's ``reset``,
checked against OpenEnv's own ``ResetRequest``.

The driver is a module with ``observe(observation: dict) -> str`` and ``act(reply: str) -> dict``, and
optionally ``SYSTEM_PROMPT``. Without one (no ``"driver"`` in ``--env-args``) an environment runs as it
is, no code written: the policy is shown each observation as JSON and told the server's own action
schema (OpenEnv's ``GET /schema``), and replies with an action as JSON, constrained to that schema
(``response_format``; the proxy records the policy's own logprobs of those tokens). ``act`` raising
``ValueError`` means the reply is not an action: the episode ends there with the rewards so far, so the
policy is trained on its mistake. Anything else that goes wrong (the server refusing an action ``act``
let through, say) fails the episode. ``envs.guess_number`` is an environment and its driver.

    python -m envs.openenv [--driver envs.guess_number] (--app envs.guess_number:app | --url URL) \\
        --out FILE --count N [--seed S] [--max-turns T]
    inverted train ... --env-path envs.openenv:episode --env-args '{"app": ..., "max_turns": T}'
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import importlib
import json
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
import pydantic
from openenv.core.env_server.types import ResetRequest
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed

from envs.datasets import write_rows

MODEL = "policy"  # the proxy serves the one policy whatever the name
START_TIMEOUT_S = 60.0
CAPACITY_PAUSE_S = (0.05, 2.0)  # the first and the longest pause before asking a full server again

_sessions: dict[tuple[str, int], asyncio.Semaphore] = {}  # (server, event loop) -> its free sessions

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
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                app,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=out,
            env=env,
            preexec_fn=_die_with_parent,
        )
    atexit.register(_stop, process, log)
    return process, f"http://127.0.0.1:{port}", log


def _stop(process: subprocess.Popen, log: Path) -> None:
    """At exit: the server goes, and its log with it (a failure to start has quoted it already)."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
    log.unlink(missing_ok=True)


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
                raise RuntimeError(
                    f"the OpenEnv server {app!r} exited ({process.returncode}): {log.read_text()[-2000:]}"
                )
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(
        f"the OpenEnv server {app!r} did not answer {url}/health within {START_TIMEOUT_S:g}s: {log.read_text()[-2000:]}"
    )


def reset_args(metadata: dict[str, Any]) -> dict[str, Any]:
    """The row's ``reset`` arguments, checked against OpenEnv's ``ResetRequest``; a row naming code is refused."""
    spec = metadata.get("openenv")
    if not isinstance(spec, dict) or not set(spec) <= {"reset"}:
        named = sorted(set(spec) - {"reset"}) if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(
            f"a row's metadata.openenv holds only its 'reset' arguments (got {named}): the server and "
            "the driver are chosen by --env-args, never by a row"
        )
    try:
        return ResetRequest.model_validate(spec.get("reset") or {}).model_dump(exclude_unset=True)
    except pydantic.ValidationError as exc:
        raise ValueError(f"a row's metadata.openenv.reset is not an OpenEnv ResetRequest: {exc}") from None


async def episode(
    task,
    client,
    *,
    driver: str | None = None,
    app: str | None = None,
    url: str | None = None,
    max_turns: int = 16,
    max_sessions: int = 1,
) -> float:
    """One episode on the server ``url`` (or ``app``'s), played by ``driver`` (None: ``SchemaDriver``);
    all from ``--env-args``.

    At most ``max_sessions`` episodes of this process hold a session on one server (OpenEnv's
    servers allow one unless built with ``max_concurrent_envs``; they do not publish it): the rest
    wait their turn. A server that still says it is full (another process holds its sessions) is
    tried again, with a growing pause: a refusal is no episode.
    """
    reset = reset_args(task.metadata)
    if (app is None) == (url is None):
        raise ValueError(
            f"--env-args names the OpenEnv server by 'app' or by 'url', one of them (got app={app!r}, url={url!r})"
        )
    url = url or await serve(app)
    player = importlib.import_module(driver) if driver else await SchemaDriver.of(url)
    pause = CAPACITY_PAUSE_S[0]
    async with _turns(url, max_sessions):
        while True:
            async with GenericEnvClient(base_url=url) as env:
                try:
                    result = await env.reset(**reset)
                except (RuntimeError, ConnectionClosed) as exc:
                    if isinstance(exc, RuntimeError) and "CAPACITY_REACHED" not in str(exc):
                        raise
                else:
                    return await _play(env, result, player, client, max_turns)
            await asyncio.sleep(pause)
            pause = min(2 * pause, CAPACITY_PAUSE_S[1])


def _turns(url: str, max_sessions: int) -> asyncio.Semaphore:
    """The episodes of this event loop that may hold a session on ``url`` at once."""
    key = (url, id(asyncio.get_running_loop()))
    return _sessions.setdefault(key, asyncio.Semaphore(max_sessions))


async def _play(env: GenericEnvClient, result: Any, player: Any, client: Any, max_turns: int) -> float:
    system = getattr(player, "SYSTEM_PROMPT", None)
    messages = [{"role": "system", "content": system}] if system else []
    total = 0.0
    for _ in range(max_turns):
        if result.done:
            break
        messages.append({"role": "user", "content": player.observe(result.observation)})
        reply = await client.chat.completions.create(model=MODEL, messages=messages, **getattr(player, "REQUEST", {}))
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        try:
            action = player.act(text)
        except ValueError:  # not an action: the policy's mistake, and its episode's end
            break
        result = await env.step(action)
        total += float(result.reward or 0.0)
    return total


class SchemaDriver:
    """The driver of an environment that has none: observations as JSON, actions as JSON under the
    server's own action schema, which constrains the policy's reply (no reply is malformed)."""

    _schemas: dict[str, dict[str, Any]] = {}  # server -> its action schema, asked once per process

    def __init__(self, action_schema: dict[str, Any]) -> None:
        schema = dict(action_schema)
        # OpenEnv's Action base class carries a free-form ``metadata`` the environment does not read
        if "metadata" in schema.get("properties", {}) and "metadata" not in schema.get("required", []):
            schema["properties"] = {k: v for k, v in schema["properties"].items() if k != "metadata"}
        self.SYSTEM_PROMPT = (
            "You act in an environment. Each message is what you observe, as JSON. Reply with "
            f"your next action: one JSON object of this schema: {json.dumps(schema)}"
        )
        # compact JSON: a grammar that allows whitespace anywhere lets a weak policy fill its budget with it
        # (llguidance's option; JSON Schema validators ignore keywords they do not know)
        constrained = schema | {"x-guidance": {"whitespace_flexible": False}}
        self.REQUEST = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "action", "schema": constrained, "strict": True},
            }
        }

    @classmethod
    async def of(cls, url: str) -> "SchemaDriver":
        if url not in cls._schemas:
            async with httpx.AsyncClient(timeout=30) as http:
                reply = await http.get(url.rstrip("/") + "/schema")
                reply.raise_for_status()
                cls._schemas[url] = reply.json()["action"]
        return cls(cls._schemas[url])

    @staticmethod
    def observe(observation: dict[str, Any]) -> str:
        """The observation's own fields (not the reward, the end or the framework's metadata)."""
        shown = {k: v for k, v in observation.items() if v is not None and k not in ("reward", "done", "metadata")}
        return json.dumps(shown, sort_keys=True)

    @staticmethod
    def act(reply: str) -> dict[str, Any]:
        action = json.loads(reply)  # not JSON: a ValueError, the episode's end
        if not isinstance(action, dict):
            raise ValueError(f"an action is a JSON object, not {type(action).__name__}")
        return action


def rows(count: int, seed: int) -> list[dict[str, Any]]:
    return [
        {"input": f"episode, seed {seed + i}", "metadata": {"openenv": {"reset": {"seed": seed + i}}}}
        for i in range(count)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument(
        "--driver",
        help="module with observe(observation) and act(reply) (default: the "
        "observation as JSON, the action as JSON under the server's schema)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--app", help="module:attr of the environment's ASGI app, served on first use")
    where.add_argument("--url", help="an environment server already running")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=256, help="episodes to write")
    parser.add_argument("--seed", type=int, default=0, help="row i resets with seed + i")
    parser.add_argument("--max-turns", type=int, default=16, help="model turns per episode at most")
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=1,
        help="episodes a process plays on the server at once (its max_concurrent_envs)",
    )
    args = parser.parse_args(argv)
    try:
        if args.driver:
            importlib.import_module(args.driver)  # a wrong name fails here, not in every episode
    except ImportError as exc:
        parser.error(f"--driver {args.driver!r}: {exc}")
    print(write_rows(rows(args.count, args.seed), args.out))
    server = {"app": args.app} if args.app else {"url": args.url}
    env_args = json.dumps(
        {
            **({"driver": args.driver} if args.driver else {}),
            **server,
            "max_turns": args.max_turns,
            "max_sessions": args.max_sessions,
        }
    )
    print(f"train on it with: --env-path envs.openenv:episode --env-args '{env_args}'")


if __name__ == "__main__":
    main()
