"""Unchanged agent programs of each SDK, run by ``subprocess_agent`` through a real proxy and
engine: each finds its session in the environment variables its SDK reads, and is recorded."""

from __future__ import annotations

import asyncio
import sys

import pytest

from inverted.plugins import RolloutContext
from inverted.rollout.config import RolloutConfig
from inverted.types import Sample, Task
from rollout_functions.subprocess_agent import generate_rollout

# Each program is configured by its SDK's own environment variables only, and writes its reply's
# length as the reward.
PROGRAMS = {
    "openai-agents": """
import os, agents  # the SDK's default model speaks the Responses API
agent = agents.Agent(name="a", instructions="Be brief.", model_settings=agents.ModelSettings(max_tokens=4))
result = agents.Runner.run_sync(agent, "Name a color.")
open(os.environ["INVERTED_REWARD_FILE"], "w").write(str(len(result.final_output)))
""",
    "anthropic": """
import os, anthropic
reply = anthropic.Anthropic().messages.create(model="any", max_tokens=4,
                                              messages=[{"role": "user", "content": "Name a color."}])
assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 4
open(os.environ["INVERTED_REWARD_FILE"], "w").write(str(len(reply.content[0].text) if reply.content else 0))
""",
    "gemini": """
import json, os, urllib.request  # Google's REST shape, as its SDKs send it, with the variables they read
body = {"contents": [{"role": "user", "parts": [{"text": "Name a color."}]}]}
url = os.environ["GOOGLE_GEMINI_BASE_URL"] + "/v1beta/models/gemini-2.5-flash:generateContent"
headers = {"x-goog-api-key": os.environ["GEMINI_API_KEY"], "content-type": "application/json"}
reply = json.load(urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)))
assert reply["usageMetadata"]["candidatesTokenCount"] == 4
assert os.environ["GOOGLE_API_KEY"] == os.environ["GEMINI_API_KEY"]
text = "".join(part.get("text", "") for part in reply["candidates"][0]["content"]["parts"])
open(os.environ["INVERTED_REWARD_FILE"], "w").write(str(len(text)))
""",
}


@pytest.mark.parametrize("sdk", sorted(PROGRAMS))
def test_an_unchanged_agent_program_of_each_sdk_is_recorded(agent_stack, tmp_path, sdk):
    model, engine, proxy = agent_stack
    program = tmp_path / "agent.py"
    program.write_text(PROGRAMS[sdk])
    tasks = [Task(lease_id="l", group_index=0, index=i, prompt_index=0, prompt="p") for i in range(2)]
    config = RolloutConfig(agent_command=f"{sys.executable} {program}")
    ctx = RolloutContext(
        rollout_id=0,
        config=config,
        proxy_url=proxy.url,
        proxy_api_key="admin-key",
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"max_tokens": 4, "min_tokens": 4},
    )
    samples = asyncio.run(generate_rollout(ctx, tasks))
    for sample in samples:
        assert sample.status != Sample.Status.FAILED, sample.metadata.get("error")
        assert sample.response_length == 4 and sample.loss_mask == [1] * 4
        assert sample.metadata["turns"][0]["sampling_params"]["max_new_tokens"] == 4
    assert "answered 4" not in proxy.log_path.read_text()  # no call was refused (by this program or another)
