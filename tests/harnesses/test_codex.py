"""OpenAI Codex CLI (``codex exec``, the Responses API) unchanged, pointed at a session by its documented
settings: a ``model_providers`` entry in ``$CODEX_HOME/config.toml`` with the session's ``base_url``
and the environment variable that holds the key (``env_key``). It runs in its documented
unsandboxed mode (``--sandbox danger-full-access``) inside a throw-away directory, since its
sandbox cannot start in this container, with ``--skip-git-repo-check`` (the directory is no repo).

What it sends by default: "responses lite" (its tools in an ``additional_tools`` input item, in
namespaces, the main one a freeform ``custom`` tool, ``exec``, that runs JavaScript), ``reasoning``
with ``context``, ``include: ["reasoning.encrypted_content"]``, ``text.verbosity``,
``client_metadata``, ``prompt_cache_key``, ``store: false``, streaming, beta headers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import fresh_repo, harness_binary

COMMAND = 'text(await tools.exec_command({cmd: "cat notes.txt"}))'
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def codex(home: Path):
    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        fresh_repo(work)
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            'model_provider = "inverted"\n\n[model_providers.inverted]\nname = "inverted"\n'
            f'base_url = "{base_url}"\nenv_key = "INVERTED_SESSION_KEY"\nwire_api = "responses"\n')
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
               "INVERTED_SESSION_KEY": "sk-inverted"}
        return subprocess.run([str(harness_binary("codex")), "exec", "--skip-git-repo-check", "--sandbox",
                               "danger-full-access", "What does notes.txt say?"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return run


def tools_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses tools as the functions a chat template renders: a custom tool takes one string, ``input``."""
    found = []
    for tool in items:
        if tool["type"] == "namespace":
            found += tools_of(tool["tools"])
        elif tool["type"] in ("function", "custom"):
            parameters = tool["parameters"] if tool["type"] == "function" else CUSTOM_INPUT
            found.append({"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                           "parameters": parameters}})
    return found


def as_chat(body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A Responses request as chat messages and tools, read from OpenAI's documented item shapes."""
    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(part["text"] for part in content)

    messages: list[dict] = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    tools = tools_of(body.get("tools", []))
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind == "additional_tools":
            tools += tools_of(item["tools"])
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": text(item["content"])})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item["arguments"] if kind == "function_call" else json.dumps({"input": item["input"]})
            made = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(made)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [made]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text(item["output"])})
        else:
            raise AssertionError(f"an input item this test does not know: {kind}")
    return messages, tools


def test_codex_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path):
    run = codex(tmp_path / "codex-home")
    replies = ['<tool_call>\n{"name": "exec", "arguments": ' + json.dumps({"input": COMMAND}) +
               '}\n</tool_call><|im_end|>', "The file says: the answer is 42.<|im_end|>"]
    played = harness_stack.taught_episode(run, replies, tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-2000:])
    assert "the answer is 42" in played.done.stdout
    main = [r for r in played.requests if r["path"].endswith("/v1/responses")]
    first, last = main[0]["body"], main[-1]["body"]
    assert first["input"][0]["type"] == "additional_tools" and first["stream"] is True
    accepted = played.episode.metadata["turns"][0]["accepted"]
    assert {"reasoning.effort", "include.reasoning.encrypted_content", "tools[].format"} <= set(accepted), accepted
    # the exec call went back as a custom_tool_call, and its output as a custom_tool_call_output
    kinds = [item.get("type") for item in last["input"]]
    assert "custom_tool_call" in kinds and "custom_tool_call_output" in kinds, kinds
    check_episode(harness_stack, played, *as_chat(last), replies)
