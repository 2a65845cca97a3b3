"""``inverted train --lora-rank``: the whole job trains an adapter, and every rollout samples from it.

The servers start with LoRA enabled, get the untrained adapter before the first rollout, and the
adapter alone after each step; the proxy (sync loop, tool env) and the single-turn rollout
function (async loop) name it in every call. The proof that rollouts used the adapter and not the
base model: the trainer scores the sampled tokens as the engine did (≤ 1e-4), and the base model
(``transformers``) does not. The run's export is a PEFT adapter that ``peft`` loads.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from envs.datasets import write_dataset
from envs.letters import rows as letter_rows
from inverted.types import Sample
from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted, metrics_rows, stored_samples

pytestmark = pytest.mark.slow  # whole jobs: left out of make test-fast

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]  # a LoRA-sized step: the policy moves at once
# Rewards that differ within every group (its two samples get 0 and 1), so that every step moves the
# adapter: a group of equal rewards has no advantage, and a step of such groups alone leaves it as it was.
TASK = textwrap.dedent("""
    async def episode(task, client):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
        return float(task.index % 2)

    def reward(sample):
        return float(sample.index % 2)
""")


def task_module(tmp_path):
    (tmp_path / "lora_task.py").write_text(TASK)
    return tmp_path


def base_gap(model_dir, sample: Sample) -> float:
    """How far the sample's sampled tokens' log-probs are from the base model's (``transformers``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].log_softmax(-1)
    base = logits.gather(1, ids[0, 1:, None])[:, 0][-sample.response_length :]
    sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
    return float((base - torch.tensor(sample.rollout_log_probs))[sampled].abs().max())


def check_peft_export(model_dir, run_dir) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((run_dir / "hf" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), run_dir / "hf")
    assert any(float(p.abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)  # trained


def test_a_lora_job_samples_from_its_adapter(tiny_model, tmp_path):
    model, run_dir = tiny_model(), tmp_path / "run"
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
            *LORA,
            pythonpath=task_module(tmp_path),
        )
    )

    rows = [m for m in metrics_rows(run_dir) if "rollout/reward_mean" in m]
    assert [m["weight_version"] for m in rows] == [1, 2]
    assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4  # the engine ran the trainer's adapter ...
    assert rows[1]["sync/bytes"] < 1e6 / 2  # ... and only the adapter moved (the model is ~4 MB in bf16)
    second = [s for s in stored_samples(run_dir).values() if set(s.weight_versions) == {"1"}]
    assert second
    assert all(base_gap(model, s) < 1e-4 for s in stored_samples(run_dir).values() if s.weight_versions[0] == "0")
    assert min(base_gap(model, s) for s in second[:2]) > 1e-3  # ... which is not the base model
    check_peft_export(model, run_dir)


def test_an_async_lora_job_with_the_single_turn_rollout(tiny_model, tmp_path):
    model, run_dir = tiny_model(), tmp_path / "run"
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
            *LORA,
            pythonpath=task_module(tmp_path),
        )
    )

    rows = [m for m in metrics_rows(run_dir) if "rollout/reward_mean" in m]
    assert len(rows) == 3 and all(m["async/staleness_max"] <= 1 for m in rows)
    fresh = [m["train/fresh_logprob_abs_diff"] for m in rows if m.get("train/fresh_logprob_abs_diff") is not None]
    assert fresh and max(fresh) < 1e-4  # tokens of the current adapter version score as the trainer scores them
    later = [s for s in stored_samples(run_dir).values() if s.weight_versions and s.weight_versions[0] != "0"]
    assert later and base_gap(model, later[0]) > 1e-3
    check_peft_export(model, run_dir)
