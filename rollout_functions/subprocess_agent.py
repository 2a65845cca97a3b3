"""Run an existing agent program unchanged, once per task (``--agent-command``).

The program is started with its session in the environment variables the SDKs read:
``OPENAI_BASE_URL`` (the session's ``/v1`` base) and ``OPENAI_API_KEY`` (the session token) for
OpenAI's, ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` for Anthropic's, ``GOOGLE_GEMINI_BASE_URL``
with ``GEMINI_API_KEY`` and ``GOOGLE_API_KEY`` for Google's (Gemini CLI, ``google-genai``), and
``OPENAI_AGENTS_DISABLE_TRACING=1`` (the openai-agents SDK would upload its traces to OpenAI with
the session token as the key), plus ``INVERTED_TASK`` (the task as JSON: prompt, label,
metadata, tools), ``INVERTED_SESSION_ID`` and ``INVERTED_REWARD_FILE``. The command is split like
a shell would split it, but no shell runs it.

The reward, first found wins: the number or JSON object the program wrote to
``INVERTED_REWARD_FILE``; a reward it posted itself to ``POST /sessions/{id}/reward``; else its exit
status (0 → 1.0, anything else → 0.0). A program killed by a signal or by the episode timeout makes
a failed Sample; its output goes to the log at DEBUG (the last lines at WARNING when it fails).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shlex
import tempfile
from pathlib import Path

from inverted.plugins import RolloutContext
from inverted.rollout.proxy.client import ProxyClient, SessionHandle
from inverted.types import Reward, Sample, Task
from rollout_functions.episodes import run_all

logger = logging.getLogger(__name__)


def read_reward_file(path: Path) -> Reward | None:
    text = path.read_text().strip() if path.exists() else ""
    if not text:
        return None
    value = json.loads(text)
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ValueError(f"reward file holds {text[:80]!r}: expected a number or an object of numbers")
    return float(value) if not isinstance(value, dict) else value


async def run_agent(ctx: RolloutContext, task: Task, session: SessionHandle) -> tuple[Reward | None, int]:
    """Run the program to its end; return (the reward it wrote, its exit status)."""
    with tempfile.TemporaryDirectory(prefix="inverted-agent-") as scratch:
        reward_file = Path(scratch) / "reward"
        env = {
            **os.environ,
            "OPENAI_BASE_URL": session.base_url,
            "OPENAI_API_KEY": session.token,
            "ANTHROPIC_BASE_URL": session.base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": session.token,
            "GOOGLE_GEMINI_BASE_URL": session.base_url.removesuffix("/v1"),
            "GEMINI_API_KEY": session.token,
            "GOOGLE_API_KEY": session.token,
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
            "INVERTED_SESSION_ID": session.session_id,
            "INVERTED_REWARD_FILE": str(reward_file),
            "INVERTED_TASK": json.dumps(
                {"prompt": task.prompt, "label": task.label, "metadata": task.metadata, "tools": task.tools}
            ),
        }
        process = await asyncio.create_subprocess_exec(
            *shlex.split(ctx.config.agent_command),
            env=env,
            cwd=scratch,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await process.communicate()
        finally:
            if process.returncode is None:  # cancelled by the episode timeout
                process.kill()
                await process.wait()
        tail = output.decode(errors="replace")[-2000:]
        logger.debug("agent for task %d/%d exited %d:\n%s", task.group_index, task.index, process.returncode, tail)
        if process.returncode < 0:
            raise RuntimeError(f"agent killed by signal {-process.returncode}; output tail:\n{tail}")
        return read_reward_file(reward_file), process.returncode


async def play(ctx: RolloutContext, task: Task, session: SessionHandle, proxy: ProxyClient) -> Reward | None:
    written, status = await run_agent(ctx, task, session)
    if written is not None:
        return written
    recorded = await proxy.samples(session.session_id)
    if recorded and recorded[-1].reward is not None:
        return None  # the agent posted its own reward
    return 1.0 if status == 0 else 0.0


async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]:
    return await run_all(ctx, tasks, lambda task: functools.partial(play, ctx, task))


generate_rollout.requires = ("agent_command",)  # checked by the job before anything starts
