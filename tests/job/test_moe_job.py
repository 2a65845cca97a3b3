"""``inverted train`` on a Mixture-of-Experts model: the embedded engines serve Qwen3-MoE, Megatron
trains it, and every expert goes back to the engines after each step, so the engine scores the next
rollout's tokens as the trainer does (sync), or the tokens of the current version (async). Both
run with rollout routing replay: the engines return each token's experts, the proxy (sync) or the
single-turn rollout (async) keeps them in the Samples, the buffer stores them, and the trainer
replays them (a Sample without them would stop the job)."""

from __future__ import annotations

import pytest

from envs.datasets import write_dataset
from envs.letters import rows as letter_rows
from inverted.hf_checkpoint import ModelSpec
from tests.job.test_lora_job import task_module
from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted, metrics_rows

pytestmark = pytest.mark.slow  # whole jobs: left out of make test-fast


def test_a_moe_job_trains_and_serves_every_expert(tiny_model, tmp_path):
    model, run_dir = tiny_model("qwen3_moe"), tmp_path / "run"
    data = write_dataset(letter_rows, tmp_path / "letters.jsonl", count=8)
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data),
            "--env-path",
            "lora_task:episode",
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *ONE_ENGINE_RUN,
            "--lr",
            "1e-2",
            "--use-rollout-routing-replay",
            "--moe-aux-loss-coeff",
            "0.01",
            pythonpath=task_module(tmp_path),
        )
    )
    rows = [m for m in metrics_rows(run_dir) if "rollout/reward_mean" in m]
    assert [m["weight_version"] for m in rows] == [1, 2]
    assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4  # the engine ran the trainer's experts
    spec = ModelSpec.from_checkpoint(model)
    # Reported every step, within the loss's range (its value is checked in tests/train/test_routing_replay.py).
    assert all(0 < m["train/moe_aux_loss"] <= spec.num_experts / spec.moe_top_k for m in rows)


def test_an_async_moe_job_with_the_single_turn_rollout(tiny_model, tmp_path):
    model, run_dir = tiny_model("qwen3_moe"), tmp_path / "run"
    data = write_dataset(letter_rows, tmp_path / "letters.jsonl", count=16)
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--rollout-function-path",
            "rollout_functions.single_turn:generate_rollout",
            "--custom-rm-path",
            "lora_task:reward",
            "--async-mode",
            "--num-rollout",
            "3",
            *ONE_ENGINE_RUN,
            "--lr",
            "1e-2",
            "--use-rollout-routing-replay",
            pythonpath=task_module(tmp_path),
        )
    )
    rows = [m for m in metrics_rows(run_dir) if "rollout/reward_mean" in m]
    assert len(rows) == 3 and all(m["async/staleness_max"] <= 1 for m in rows)
    fresh = [m["train/fresh_logprob_abs_diff"] for m in rows if m.get("train/fresh_logprob_abs_diff") is not None]
    mixed = [m.get("rollout/mixed_version_samples") for m in rows]  # partial rollouts, resumed on new weights
    assert fresh and max(fresh) < 1e-4, (fresh, mixed)
