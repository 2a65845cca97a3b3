"""Claude Code through the Python ``claude-agent-sdk`` (its bundled CLI), unchanged: the SDK's quick start
in ``claude_agent_sdk_agent.py``, pointed at a session by ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``
with Claude Code's switches for running offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import fresh_repo
from tests.harnesses.test_claude_code import QUESTION

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast


def sdk_agent(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": "sk-ant-inverted",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "PYTHONPATH": str(Path(__file__).parent),
        }
        return subprocess.run(
            [sys.executable, "-m", "claude_agent_sdk_agent", QUESTION],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_claude_agent_sdk_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    notes = harness_stack.work / "notes.txt"
    replies = [
        '<tool_call>\n{"name": "Read", "arguments": '
        + json.dumps({"file_path": str(notes)})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(sdk_agent(tmp_path / "home"), replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout
    main = [
        r
        for r in played.requests
        if r["path"].endswith("/v1/messages") and r["body"]["model"] == played.episode.metadata["model"]
    ]
    assert "sdk-py" in main[0]["headers"].get("user-agent", "") + json.dumps(main[0]["body"]["system"])
    check_episode(harness_stack, played, main[-1], replies)
