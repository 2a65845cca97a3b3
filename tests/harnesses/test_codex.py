"""OpenAI Codex CLI (``codex exec``, the Responses API) unchanged, pointed at a session by its documented
settings: a ``model_providers`` entry in ``$CODEX_HOME/config.toml`` with the session's ``base_url``
and the environment variable that holds the key (``env_key``), and the user's own model name
(``-m my-policy``), as everyone who trains their own model runs it. It runs in its own sandbox
(``--sandbox workspace-write``: bubblewrap, the directory writable, the rest read-only, no network),
with ``--skip-git-repo-check`` (the directory is no repo). Codex starts that sandbox through helper
binaries it places under ``CODEX_HOME``, and refuses to place them under the temporary directory:
so ``TMPDIR`` points elsewhere than the home, which lives under pytest's ``/tmp``.

What it sends for a model it does not know: its tools in ``tools`` (``exec_command`` and seven more
functions, a namespace, and the hosted ``web_search``, which no implementation serves here: left out
of the prompt, with why on the turn), ``reasoning`` with ``context``, ``include:
["reasoning.encrypted_content"]``, ``client_metadata``, ``prompt_cache_key``, ``store: false``,
streaming, beta headers. Its default model's "responses lite" (tools in ``additional_tools`` input
items, a freeform ``exec`` tool) is held token for token in ``tests/rollout/proxy/test_fields.py``."""

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


def codex(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            'model_provider = "inverted"\n\n[model_providers.inverted]\nname = "inverted"\n'
            f'base_url = "{base_url}"\nenv_key = "INVERTED_SESSION_KEY"\nwire_api = "responses"\n'
        )
        scratch = home.parent / "codex-tmp"
        scratch.mkdir(exist_ok=True)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "CODEX_HOME": str(home),
            "TMPDIR": str(scratch),
            "INVERTED_SESSION_KEY": "sk-inverted",
        }
        return subprocess.run(
            [
                str(harness_binary("codex")),
                "exec",
                "-m",
                MODEL,
                "--skip-git-repo-check",
                "--sandbox",
                "workspace-write",
                "What does notes.txt say?",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


def test_codex_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = codex(tmp_path / "codex-home")
    # The command also asks whether /etc is writable: outside the sandbox it is (to root), inside it is not.
    command = "cat notes.txt; test -w /etc || echo read-only"
    replies = [
        '<tool_call>\n{"name": "exec_command", "arguments": '
        + json.dumps({"cmd": command})
        + "}\n</tool_call><|im_end|>",
        "The file says: the answer is 42.<|im_end|>",
    ]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    # Codex shows the model's last words. Its tool's output holds a random chunk id and wall times, so the
    # last prompt is never quite the taught one: what the model says there may stray from what it was
    # taught (under load it has), but it is what Codex must show.
    turn = played.episode.metadata["turns"][-1]
    said = harness_stack.tokenizer.decode(played.episode.tokens[turn["start"] : turn["end"]], skip_special_tokens=True)
    assert said.strip() and said.strip() in played.done.stdout, (said, played.done.stdout[-2000:])
    main = [r for r in played.requests if r["path"].endswith("/v1/responses")]
    first, last = main[0]["body"], main[-1]["body"]
    assert first["model"] == MODEL and first["stream"] is True
    hosted = [i for i, tool in enumerate(first["tools"]) if tool["type"] == "web_search"]
    assert hosted, [tool["type"] for tool in first["tools"]]
    accepted = played.episode.metadata["turns"][0]["accepted"]
    assert {"reasoning.summary", f"tools[{hosted[0]}]"} <= set(accepted), accepted
    assert "none is configured" in accepted[f"tools[{hosted[0]}]"]
    # the call went back as a function_call, and its output as a function_call_output
    kinds = [item.get("type") for item in last["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds, kinds
    (ran,) = [item["output"] for item in last["input"] if item.get("type") == "function_call_output"]
    assert "the answer is 42" in ran and ("read-only" in ran or not os.access("/etc", os.W_OK)), ran
    check_episode(harness_stack, played, main[-1], replies)
