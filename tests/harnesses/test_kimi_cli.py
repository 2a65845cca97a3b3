"""Kimi CLI (``kimi --print``, Chat Completions through its default ``kimi`` provider) unchanged,
pointed at a session by its documented environment overrides: ``KIMI_BASE_URL``, ``KIMI_API_KEY`` and
``KIMI_MODEL_NAME`` (the user's own model name), with no config file. It needs Python >= 3.13
(``make harnesses`` installs it into an environment of its own where one is found).

What it sends by default: Moonshot's ``thinking: {"type": "disabled"}`` (a 400 here before: now the
template's switch, or accepted with its reason), ``max_completion_tokens`` sized to its 100,000-token
default window (cut to the context left), streaming with usage."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import ROOT, fresh_repo

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

MODEL = "my-policy"
KIMI = ROOT / ".harnesses" / "kimi" / "bin" / "kimi"


def kimi(home: Path):
    if not KIMI.exists():
        pytest.fail(f"{KIMI} is missing: `make harnesses` installs Kimi CLI where a Python >= 3.13 is found")

    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "KIMI_BASE_URL": base_url,
            "KIMI_API_KEY": "sk-inverted",
            "KIMI_MODEL_NAME": MODEL,
        }
        return subprocess.run(
            [str(KIMI), "--print", "--yolo", "-p", "What does notes.txt say?"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_kimi_cli_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = kimi(tmp_path / "kimi-home")
    replies = [
        '<tool_call>\n{"name": "ReadFile", "arguments": '
        + json.dumps({"path": "notes.txt"})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout, played.done.stdout[-2000:]
    main = [r for r in played.requests if r["path"].endswith("/chat/completions")]
    assert main[0]["body"]["model"] == MODEL and main[0]["body"].get("thinking") == {"type": "disabled"}
    assert "thinking" in played.episode.metadata["turns"][0]["accepted"]  # no thinking mode in this template
    check_episode(harness_stack, played, main[-1], replies)
