"""mini-swe-agent (PyPI; litellm, Chat Completions, its ``bash`` tool) unchanged: its ``mini`` command with
the model given as litellm names an OpenAI-compatible one (``openai/...``), the session in
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (litellm's documented settings), its documented switches
for running without set-up or prices (``MSWEA_CONFIGURED``, ``MSWEA_COST_TRACKING=ignore_errors``,
no cost limit), ``--yolo`` (no confirmation: its unsandboxed local environment, in a throw-away
directory) and ``--exit-immediately``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import fresh_repo

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def mini(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "sk-inverted",
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
        }
        mini_cli = Path(sys.executable).parent / "mini"
        return subprocess.run(
            [
                str(mini_cli),
                "-m",
                "openai/gpt-5-mini",
                "-t",
                "What does notes.txt say?",
                "--yolo",
                "--exit-immediately",
                "-l",
                "0",
                "-o",
                str(home / "run.traj.json"),
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def bash(command: str) -> str:
    return (
        '<tool_call>\n{"name": "bash", "arguments": ' + json.dumps({"command": command}) + "}\n</tool_call><|im_end|>"
    )


def test_mini_swe_agent_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    replies = [bash("cat notes.txt"), bash(SUBMIT)]
    played = harness_stack.taught_episode(mini(tmp_path / "home"), replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    trajectory = json.loads((tmp_path / "home" / "run.traj.json").read_text())
    assert trajectory["info"]["exit_status"] == "Submitted", trajectory["info"]
    outputs = [m["content"] for m in trajectory["messages"] if m["role"] == "tool"]
    assert "the answer is 42" in outputs[0]
    last = [r for r in played.requests if r["path"].endswith("/chat/completions")][-1]
    check_episode(harness_stack, played, last, replies)
