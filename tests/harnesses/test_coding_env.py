"""``envs.coding``: mini-swe-agent fixes a tiny repository in a fresh temporary copy, and the reward is the
repository's test. Taught to fix it, the harness earns 1.0; every command it runs has the copy as its
working directory (the model's ``pwd`` comes back in the tool's output), which is gone afterwards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest

from envs.coding import PROMPT, REPOS, episode
from inverted.types import Task
from tests.harnesses.conftest import ROOT
from tests.harnesses.test_mini_swe_agent import SUBMIT, bash

pytestmark = pytest.mark.slow  # coding-agent harnesses and SDKs, each taught a tiny model: left out of make test-fast

FIX = "pwd && sed -i 's/numbers\\[1:\\]/numbers/' calc.py"


def play(base_url: str, work: Path) -> float:
    async def one() -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-inverted") as client:
            task = Task(
                lease_id="l", group_index=0, index=0, prompt_index=0, prompt=PROMPT, metadata={"repo": "off_by_one"}
            )
            return await episode(task, client)

    return asyncio.run(one())


def test_the_harness_fixes_the_repository_in_a_temporary_copy_and_the_test_is_the_reward(harness_stack, tmp_path):
    assert "numbers[1:]" in REPOS["off_by_one"]["calc.py"]
    played = harness_stack.taught_episode(play, [bash(FIX), bash(SUBMIT)], tmp_path)
    assert played.done == 1.0
    last = [r for r in played.requests if r["path"].endswith("/chat/completions")][-1]["body"]
    observation = json.loads([m for m in last["messages"] if m["role"] == "tool"][0]["content"])
    where = Path(observation["output"].splitlines()[0])
    assert where.name == "repo" and where.parent.name.startswith("inverted-coding-")
    assert where.parent.parent == Path(tempfile.gettempdir()) and not where.exists()  # deleted with the copy
    # untaught (the base model), nothing is fixed: the reward is the test's, not the harness's exit status
    harness_stack.load(harness_stack.model)
    assert harness_stack.play(play).done == 0.0


def test_a_job_runs_the_coding_harness_end_to_end_then_trains_a_step(tiny_model, tmp_path):
    """``inverted train --env-path envs.coding:episode``: the rollouts (mini-swe-agent on the tiny random
    model, which fixes nothing), saved; then one training step on them."""
    from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted, metrics_rows

    rows = tmp_path / "coding.jsonl"
    written = subprocess.run([sys.executable, "-m", "envs.coding", "--out", str(rows), "--count", "2"], cwd=ROOT)
    assert written.returncode == 0
    data = tmp_path / "rollouts.jsonl"
    run = [*ONE_ENGINE_RUN]
    run[run.index("--rollout-max-response-len") + 1] = "24"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(rows),
            "--metadata-key",
            "metadata",
            "--env-path",
            "envs.coding:episode",
            "--num-rollout",
            "1",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(tmp_path / "rollout-run"),
            *run,
            timeout=600,
        )
    )
    from inverted.types import Sample

    saved = [Sample.from_json(json.loads(line)) for line in data.read_text().splitlines()]
    assert len(saved) == 4 and {s.reward for s in saved} == {0.0}
    assert all(s.status != Sample.Status.FAILED and sum(s.loss_mask) > 0 for s in saved)  # cut at 24 tokens: truncated
    run_dir = tmp_path / "train-run"
    check(
        inverted(
            "train",
            "--debug-train-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--load-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "1",
        )
    )
    assert [m["step"] for m in metrics_rows(run_dir)] == [0]
