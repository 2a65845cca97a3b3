"""Claude Code (``claude -p``, the Messages API) unchanged, pointed at a session by its documented
settings: ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``, with its switches for running offline
(``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_TELEMETRY``, ``DISABLE_AUTOUPDATER``).
Its first request (a system prompt, a dozen tools, ~29,000 tokens here, ``thinking``, ``effort``,
``context_management``, beta headers, ``max_tokens: 128000``) is accepted, recorded and answered;
taught to read a file, it runs a whole episode, recorded exactly."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import fresh_repo, harness_binary

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

QUESTION = "What does notes.txt say?"


def claude_code(home: Path):
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
        }
        return subprocess.run(
            [str(harness_binary("claude")), "-p", QUESTION],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def test_claude_code_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = claude_code(tmp_path / "home")
    notes = harness_stack.work / "notes.txt"
    replies = [
        '<tool_call>\n{"name": "Read", "arguments": '
        + json.dumps({"file_path": str(notes)})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, played.done.stderr[-2000:]
    assert "the answer is 42" in played.done.stdout
    main = [
        r
        for r in played.requests
        if r["path"].endswith("/v1/messages") and r["body"]["model"] == played.episode.metadata["model"]
    ]
    first = main[0]["body"]
    # the defaults it sends, every one accepted: what the turn recorded for them
    assert first["max_tokens"] >= 32000 and first.get("thinking") and first.get("tools")
    accepted = played.episode.metadata["turns"][0]["accepted"]
    assert {"thinking", "metadata", "context_management", "cache_control"} <= set(accepted), accepted
    check_episode(harness_stack, played, main[-1], replies)
