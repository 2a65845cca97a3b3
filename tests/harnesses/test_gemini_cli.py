"""Gemini CLI (``gemini -p``, the Gemini API) unchanged, pointed at a session by its documented
settings: ``GOOGLE_GEMINI_BASE_URL`` (the session's path; the CLI adds ``/v1beta/models/...``),
``GEMINI_API_KEY``, the API-key auth chosen in ``~/.gemini/settings.json`` (headless runs ask no
questions), and the user's own model name (``-m my-policy``). ``--yolo`` approves its tools, and its
folder-trust check is off in the same settings file, as its docs describe for automation; so is its
loop detection (``SETTINGS``).

What it sends: ``streamGenerateContent?alt=sse``; a 20 kB ``systemInstruction``; a first user turn
of two text parts (a ``<session_context>`` and the task); ``tools[0].functionDeclarations`` (19, with
``parametersJsonSchema``); ``generationConfig`` with ``temperature``, ``topP``, ``topK`` and
``thinkingConfig.includeThoughts``; headers ``x-goog-api-key``, ``x-goog-api-client``."""

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
# Its loop detection hangs up on an untaught model's repeated words (the proxy then records nothing for
# the call, as for any call its client abandons): off, as the teaching stages need the prompt recorded.
SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
    "model": {"disableLoopDetection": True},
}


def gemini(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        (home / ".gemini").mkdir(parents=True, exist_ok=True)
        (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS))
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "GEMINI_API_KEY": "sk-inverted",
            "GOOGLE_GEMINI_BASE_URL": base_url.removesuffix("/v1"),
        }
        return subprocess.run(
            [str(harness_binary("gemini")), "-m", MODEL, "--yolo", "-p", "What does notes.txt say?"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_gemini_cli_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = gemini(tmp_path / "gemini-home")
    replies = [
        '<tool_call>\n{"name": "read_file", "arguments": '
        + json.dumps({"file_path": "notes.txt"})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout, played.done.stdout[-2000:]
    main = [r for r in played.requests if r["path"].endswith(f"/v1beta/models/{MODEL}:streamGenerateContent")]
    first, last = main[0], main[-1]
    assert first["query"] == "alt=sse" and first["headers"]["x-goog-api-key"] == "sk-inverted"
    assert played.episode.metadata["model"] == MODEL
    # the call went back as a model turn's functionCall, its result as a user turn's functionResponse
    parts = [next(iter(p)) for c in last["body"]["contents"] for p in c["parts"]]
    assert "functionCall" in parts and "functionResponse" in parts, parts
    check_episode(harness_stack, played, last, replies)
