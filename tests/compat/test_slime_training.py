"""slime's training plug-ins change one optimizer step exactly as an independent recomputation predicts.

One optimizer step on a fresh policy: the old log-probs are the live ones, so every ratio is 1 and
each token's policy-gradient loss is minus its advantage. What each plug-in does to the loss can
then be written down from the Samples alone (and, for the custom loss, from ``transformers``).
"""

from __future__ import annotations

import statistics

import pytest
import torch
import transformers

from inverted.config import TrainConfig, from_flags
from inverted.train.parallel import spawn
from tests.train.samples import make_samples
from tests.train.workers import step_at_version

PLUGINS = "tests.compat.slime_plugins"


def grpo_advantages(samples) -> list[float]:
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s.reward)
    return [(s.reward - statistics.mean(by_group[s.group_index])) / (statistics.stdev(by_group[s.group_index]) + 1e-6)
            for s in samples]


def one_step(tiny_model, tmp_path, samples, **flags) -> dict[str, float]:
    cfg = from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), lr=1e-3, **flags)
    spawn(step_at_version, 1, cfg, samples, 0, str(tmp_path / "step.pt"))
    return torch.load(tmp_path / "step.pt")["metrics"]


@pytest.fixture
def samples():
    return make_samples(seed=3)


def test_dr_grpo_reducer_divides_by_its_constant(tiny_model, tmp_path, samples):
    from inverted.compat import slime

    slime.install()  # as the plug-in loader does: the plug-ins import slime's paths (alone, this test ran first)
    from tests.compat.slime_plugins import DR_GRPO_DIVISOR

    metrics = one_step(tiny_model, tmp_path, samples, custom_pg_loss_reducer_function_path=f"{PLUGINS}:get_pg_loss_reducer")
    expected = sum(-a * s.loss_mask.count(1) for a, s in zip(grpo_advantages(samples), samples)) / DR_GRPO_DIVISOR / len(samples)
    assert abs(expected) > 1e-3
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_slimes_reducer_is_told_slimes_calculate_per_token_loss(tiny_model, tmp_path, samples, per_token):
    """slime's default is a per-sample mean (``calculate_per_token_loss`` False, whatever our
    ``--loss-aggregation``), divided by the step's samples; with ``--calculate-per-token-loss`` the
    token sum, divided by the step's tokens. Told True by default, the reducer's loss was ~length x off."""
    import json

    metrics = one_step(tiny_model, tmp_path, samples, custom_pg_loss_reducer_function_path=f"{PLUGINS}:sum_of_sample_mean",
                       slime_args=json.dumps({"calculate_per_token_loss": True}) if per_token else None)
    advantages = grpo_advantages(samples)
    if per_token:
        expected = sum(-a * s.loss_mask.count(1) for a, s in zip(advantages, samples)) / \
            sum(s.loss_mask.count(1) for s in samples)
    else:
        expected = sum(-a for a in advantages) / len(samples)
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_disable_rewards_normalization_trains_on_the_raw_rewards(tiny_model, tmp_path, samples):
    import json

    metrics = one_step(tiny_model, tmp_path, samples, slime_args=json.dumps({"rewards_normalization": False}))
    tokens = sum(s.loss_mask.count(1) for s in samples)
    expected = sum(-s.reward * s.loss_mask.count(1) for s in samples) / tokens
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)


def test_custom_tis_reweights_and_rejects(tiny_model, tmp_path, samples):
    metrics = one_step(tiny_model, tmp_path, samples, custom_tis_function_path=f"{PLUGINS}:half_and_reject_first")
    tokens = sum(s.loss_mask.count(1) for s in samples)  # token_mean: the denominators stay the original ones
    kept = [s.loss_mask.count(1) - s.loss_mask[0] for s in samples]
    expected = sum(-0.5 * a * k for a, k in zip(grpo_advantages(samples), kept)) / tokens
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["train/tis_mean"] == pytest.approx(0.5)


def test_reward_post_process_replaces_the_group_normalisation(tiny_model, tmp_path, samples):
    metrics = one_step(tiny_model, tmp_path, samples, custom_reward_post_process_path=f"{PLUGINS}:rewards_as_given")
    tokens = sum(s.loss_mask.count(1) for s in samples)
    expected = sum(-s.reward * s.loss_mask.count(1) for s in samples) / tokens
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_custom_loss_is_the_loss(tiny_model, tmp_path, samples):
    """slime's custom loss (an NLL through slime's get_log_probs_and_entropy) equals transformers' NLL."""
    metrics = one_step(tiny_model, tmp_path, samples, loss_type="custom_loss",
                       custom_loss_function_path=f"{PLUGINS}:nll_loss")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), torch_dtype=torch.float32)
    total, tokens = 0.0, sum(s.loss_mask.count(1) for s in samples)
    with torch.no_grad():
        for s in samples:
            logp = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
            start = s.prompt_length
            picked = logp[start - 1:len(s.tokens) - 1].gather(-1, torch.tensor(s.tokens[start:])[:, None])[:, 0]
            total += -float((picked * torch.tensor(s.loss_mask, dtype=torch.float32)).sum())
    assert metrics["train/loss"] == pytest.approx(total / tokens, rel=1e-4)
    assert metrics["train/custom/nll"] == pytest.approx(metrics["train/loss"], rel=1e-6)


def test_sft_loss_is_the_nll_of_the_trained_tokens(tiny_model, tmp_path, samples):
    """slime's ``sft_loss``: ``-sum_of_sample_mean(log_probs)``, here our aggregation (token_mean) of the
    NLL of each trained token, against ``transformers``."""
    metrics = one_step(tiny_model, tmp_path, samples, loss_type="sft_loss")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), torch_dtype=torch.float32)
    total, tokens = 0.0, sum(s.loss_mask.count(1) for s in samples)
    with torch.no_grad():
        for s in samples:
            logp = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
            picked = logp[s.prompt_length - 1:len(s.tokens) - 1].gather(-1, torch.tensor(s.tokens[s.prompt_length:])[:, None])
            total += -float((picked[:, 0] * torch.tensor(s.loss_mask, dtype=torch.float32)).sum())
    assert metrics["train/loss"] == pytest.approx(total / tokens, rel=1e-4)


def test_remove_sample_keeps_a_sample_out_of_the_loss(tiny_model, tmp_path, samples):
    for s in samples[1::2]:
        s.metadata["remove_sample"] = True
    metrics = one_step(tiny_model, tmp_path, samples)
    assert metrics["train/loss_tokens"] == sum(s.loss_mask.count(1) for s in samples[0::2])
