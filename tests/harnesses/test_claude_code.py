"""Claude Code (``claude -p``, the Messages API) unchanged, pointed at a session by its documented
settings: ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``, with its switches for running offline
(``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_TELEMETRY``, ``DISABLE_AUTOUPDATER``).
Its first request (a system prompt, a dozen tools, ~29,000 tokens here, ``thinking``, ``effort``,
``context_management``, beta headers, ``max_tokens: 128000``) is accepted, recorded and answered;
taught to read a file, it runs a whole episode, recorded exactly. In its own sandbox (its settings),
the policy's command reaches neither the network nor anything outside the task's directory."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Iterator

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


@contextlib.contextmanager
def listener() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on loopback, and the paths it was asked for."""
    hits: list[str] = []

    class Record(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", hits
    finally:
        server.shutdown()


def test_claude_code_runs_the_policys_commands_in_its_own_sandbox(harness_stack, tmp_path):
    """Claude Code's own sandbox (bubblewrap, and socat for its network proxy: ``make sandbox`` installs
    both), turned on by its documented settings and made a requirement (``failIfUnavailable``): the
    policy's Bash command runs in the task's directory and writes there, and is stopped at the network
    and at a write outside it. The replies are scripted (the proxy's ``script``): this is about what
    runs the policy's command, not about what sampled it."""
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    # on, its commands run without an approval (none comes in -p), and never outside it
    sandbox = {
        "enabled": True,
        "autoAllowBashIfSandboxed": True,
        "failIfUnavailable": True,
        "allowUnsandboxedCommands": False,
    }
    (home / ".claude" / "settings.json").write_text(json.dumps({"sandbox": sandbox}))
    outside = tmp_path / "outside"
    outside.mkdir()
    with listener() as (url, hits):
        command = (
            f"curl -sS -m 5 {url} && echo net-open || echo net-closed; "
            f"echo x > {outside}/escaped && echo outside-open || echo outside-closed; "
            "echo mine > written.txt && echo inside-open; cat notes.txt"
        )
        call = {"name": "Bash", "arguments": {"command": command, "description": "Read the notes"}}
        replies = ["<tool_call>\n" + json.dumps(call) + "\n</tool_call><|im_end|>", "Done.<|im_end|>"]
        played = harness_stack.play(claude_code(home), script=replies)
    assert played.done.returncode == 0, played.done.stderr[-2000:] + played.done.stdout[-2000:]
    episode = played.episode
    first, second = episode.metadata["turns"][:2]
    result = harness_stack.tokenizer.decode(episode.tokens[first["end"] : second["start"]])
    assert "the answer is 42" in result and "inside-open" in result, result
    assert "net-closed" in result and "outside-closed" in result, result
    assert not hits and not (outside / "escaped").exists()
    assert (harness_stack.work / "written.txt").read_text() == "mine\n"
    assert not any(episode.loss_mask[first["end"] : second["start"]])  # the command's output is not trained
