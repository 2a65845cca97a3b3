"""opencode (``opencode run PROMPT``, Chat Completions through the AI SDK's OpenAI-compatible provider)
unchanged, pointed at a session by its documented settings: a custom provider in the project's
``opencode.json`` (``npm: @ai-sdk/openai-compatible``, ``options.baseURL``, ``options.apiKey``) and the
user's own model name under it (``--model inverted/my-policy``).

What it sends: streamed calls with ``max_tokens: 32000`` for a model it does not know (cut to the
context left, with why on the turn; here the session's own limit wins), ``stream_options.include_usage``,
``tool_choice: auto`` and 10 tools (``bash``, ``read``, ...); and, beside the main call, a call with
its own system prompt and no tools that writes the thread's title: a side call, never the episode's
Sample."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import fresh_repo, harness_binary

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

MODEL = "my-policy"


def opencode(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        (work / "opencode.json").write_text(
            json.dumps(
                {
                    "$schema": "https://opencode.ai/config.json",
                    "provider": {
                        "inverted": {
                            "npm": "@ai-sdk/openai-compatible",
                            "name": "inverted",
                            "options": {"baseURL": base_url, "apiKey": "sk-inverted"},
                            "models": {MODEL: {"name": MODEL}},
                        }
                    },
                    "model": f"inverted/{MODEL}",
                }
            )
        )
        env = {"PATH": os.environ["PATH"], "HOME": str(home)}
        return subprocess.run(
            [str(harness_binary("opencode")), "run", "--model", f"inverted/{MODEL}", "What does notes.txt say?"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_opencode_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = opencode(tmp_path / "opencode-home")
    replies = [
        '<tool_call>\n{"name": "bash", "arguments": '
        + json.dumps({"command": "cat notes.txt", "description": "Show notes.txt"})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout, played.done.stdout[-2000:]
    main = [r for r in played.requests if r["body"].get("tools")]
    assert main and all(r["body"]["model"] == MODEL and r["body"]["max_tokens"] >= 32000 for r in main)
    assert played.episode.metadata["lineage"] == "main"
    titles = [s for s in played.samples if "title generator" in harness_stack.tokenizer.decode(s.tokens[:200])]
    assert all(s.metadata["side_call"] for s in titles)
    check_episode(harness_stack, played, main[-1], replies)
