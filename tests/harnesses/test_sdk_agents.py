"""A quick-start agent of each agent SDK, at its defaults, with one tool and only the endpoint and key set
(``sdk_agents/``): each runs an episode, a tool call between two model calls, recorded exactly.
openai-agents, at its defaults under two model names and both of its APIs, is tested beside the
proxy (``tests/rollout/proxy/test_agent_apis.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harnesses.checks import check_episode
from tests.harnesses.conftest import ROOT

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

AGENTS = Path(__file__).parent / "sdk_agents"
SDK_ENVS = ROOT / ".harnesses" / "sdk"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
ANSWER = "It is sunny, 24C in Paris.<|im_end|>"
# sdk: (its environment, or None for ours; the replies its loop needs: smolagents answers with a tool)
SDKS = {
    "langgraph": ("langgraph", [CALL, ANSWER]),
    "pydantic_ai": ("pydantic_ai", [CALL, ANSWER]),
    "smolagents": (
        None,
        [
            CALL,
            '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "It is sunny, 24C '
            'in Paris."}}\n</tool_call><|im_end|>',
        ],
    ),
    "adk": ("adk", [CALL, ANSWER]),
    "adk_gemini": ("adk", [CALL, ANSWER]),  # ADK's default: a Gemini model, through the Gemini API
    "strands": ("strands", [CALL, ANSWER]),
    "llama_index": ("llama_index", [CALL, ANSWER]),
    "autogen": ("autogen", [CALL, ANSWER]),
}


def python_of(env: str | None) -> str:
    if env is None:
        return sys.executable
    python = SDK_ENVS / env / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: `make harnesses` installs the agent SDKs (make test does)")
    return str(python)


def sdk_agent(sdk: str, home: Path):
    python = python_of(SDKS[sdk][0])

    def run(base_url: str, work: Path) -> subprocess.CompletedProcess:
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "sk-inverted",
            "OTEL_SDK_DISABLED": "true",
            "GOOGLE_GEMINI_BASE_URL": base_url.removesuffix("/v1"),
            "GOOGLE_API_KEY": "sk-inverted",
        }
        return subprocess.run(
            [python, str(AGENTS / f"{sdk}_agent.py")],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )

    return run


@pytest.mark.parametrize("sdk", list(SDKS))
def test_an_sdks_quick_start_agent_runs_an_episode_unchanged_recorded_exactly(harness_stack, tmp_path, sdk):
    home = tmp_path / "home"
    home.mkdir()
    played = harness_stack.taught_episode(sdk_agent(sdk, home), SDKS[sdk][1], tmp_path)
    assert played.done.returncode == 0, (played.done.stdout[-2000:], played.done.stderr[-3000:])
    assert "sunny, 24C" in played.done.stdout
    calls = [r for r in played.requests if r["path"].endswith(("/chat/completions", "/responses", "Content"))]
    check_episode(harness_stack, played, calls[-1], SDKS[sdk][1])
    assert json.dumps(played.episode.metadata["turns"])  # every turn recorded, with what it accepted
