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

from inverted.config import from_flags
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from tests.train.samples import make_samples
from tests.train.workers import step_at_version

PLUGINS = "tests.compat.slime_plugins"


def grpo_advantages(samples) -> list[float]:
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s.reward)
    return [
        (s.reward - statistics.mean(by_group[s.group_index])) / (statistics.stdev(by_group[s.group_index]) + 1e-6)
        for s in samples
    ]


def token_logprobs(tiny_model, samples) -> list[torch.Tensor]:
    """Each Sample's response tokens' log-probs under the starting policy, by ``transformers``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), torch_dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in samples:
            logp = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
            out.append(
                logp[s.prompt_length - 1 : len(s.tokens) - 1].gather(
                    -1, torch.tensor(s.tokens[s.prompt_length :])[:, None]
                )[:, 0]
            )
    return out


def nll_token_mean(tiny_model, samples) -> float:
    """The negative log-likelihood of the trained tokens, per token (our default aggregation)."""
    mask = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    return -sum(float((lp * m).sum()) for lp, m in zip(token_logprobs(tiny_model, samples), mask)) / sum(
        float(m.sum()) for m in mask
    )


def one_step(tiny_model, tmp_path, samples, **flags) -> dict[str, float]:
    cfg = from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), lr=1e-3, **flags)
    spawn(step_at_version, 1, cfg, samples, 0, str(tmp_path / "step.pt"))
    return torch.load(tmp_path / "step.pt")["metrics"]


@pytest.fixture
def samples():
    return make_samples(seed=3)


def test_dr_grpo_reducer_divides_by_its_constant(tiny_model, tmp_path, samples):
    from tests.compat.slime_plugins import DR_GRPO_DIVISOR

    metrics = one_step(
        tiny_model, tmp_path, samples, custom_pg_loss_reducer_function_path=f"{PLUGINS}:get_pg_loss_reducer"
    )
    expected = (
        sum(-a * s.loss_mask.count(1) for a, s in zip(grpo_advantages(samples), samples))
        / DR_GRPO_DIVISOR
        / len(samples)
    )
    assert abs(expected) > 1e-3
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_slimes_reducer_is_told_slimes_calculate_per_token_loss(tiny_model, tmp_path, samples, per_token):
    """slime's default is a per-sample mean (``calculate_per_token_loss`` False, whatever our
    ``--loss-aggregation``), divided by the step's samples; with ``--calculate-per-token-loss`` (our
    ``--per-token-loss``) the token sum, divided by the step's tokens. Told True by default, the
    reducer's loss was ~length x off."""
    metrics = one_step(
        tiny_model,
        tmp_path,
        samples,
        custom_pg_loss_reducer_function_path=f"{PLUGINS}:sum_of_sample_mean",
        per_token_loss=per_token,
    )
    advantages = grpo_advantages(samples)
    if per_token:
        expected = sum(-a * s.loss_mask.count(1) for a, s in zip(advantages, samples)) / sum(
            s.loss_mask.count(1) for s in samples
        )
    else:
        expected = sum(-a for a in advantages) / len(samples)
    assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_disable_rewards_normalization_trains_on_the_raw_rewards(tiny_model, tmp_path, samples):
    metrics = one_step(tiny_model, tmp_path, samples, raw_rewards=True)  # slime's --disable-rewards-normalization
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
    metrics = one_step(
        tiny_model, tmp_path, samples, loss_type="custom_loss", custom_loss_function_path=f"{PLUGINS}:nll_loss"
    )
    assert metrics["train/loss"] == pytest.approx(nll_token_mean(tiny_model, samples), rel=1e-4)
    assert metrics["train/custom/nll"] == pytest.approx(metrics["train/loss"], rel=1e-6)


def test_sft_loss_is_the_nll_of_the_trained_tokens(tiny_model, tmp_path, samples):
    """slime's ``sft_loss``: ``-sum_of_sample_mean(log_probs)``, here our aggregation (token_mean) of the
    NLL of each trained token, against ``transformers``."""
    metrics = one_step(tiny_model, tmp_path, samples, loss_type="sft_loss")
    assert metrics["train/loss"] == pytest.approx(nll_token_mean(tiny_model, samples), rel=1e-4)


def test_slimes_own_sft_loss_function_is_the_loss(tiny_model, tmp_path, samples):
    """``--custom-loss-function-path slime.backends.megatron_utils.loss.sft_loss_function``, as slime's
    loss.py has it: ``-sum_of_sample_mean(log_probs)`` through its ``get_log_probs_and_entropy``; its
    ``loss`` metric beside it."""
    metrics = one_step(
        tiny_model,
        tmp_path,
        samples,
        loss_type="custom_loss",
        custom_loss_function_path="slime.backends.megatron_utils.loss.sft_loss_function",
    )
    assert metrics["train/loss"] == pytest.approx(nll_token_mean(tiny_model, samples), rel=1e-4)
    assert metrics["train/custom/loss"] == pytest.approx(metrics["train/loss"], rel=1e-6)


def with_kept_sets(samples, vocab: int):
    """Each response token's kept set, as a sampler under top-k leaves it: the token and five others."""
    g = torch.Generator().manual_seed(5)
    for s in samples:
        ids, offsets = [], [0]
        for token in s.response_tokens:
            ids += [token] + [t for t in torch.randperm(vocab, generator=g)[:5].tolist() if t != token]
            offsets.append(len(ids))
        s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets = ids, offsets
    return samples


def masked_nll_token_mean(tiny_model, samples) -> float:
    """The trained tokens' negative log-likelihood with each softmax over the token's kept set, by ``transformers``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), torch_dtype=torch.float32)
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0, s.prompt_length - 1 : len(s.tokens) - 1]
            for row, token, kept, mask in zip(logits, s.response_tokens, s.kept_sets(), s.loss_mask):
                total -= mask * float(row[kept].log_softmax(-1)[kept.index(token)])
                tokens += mask
    return total / tokens


@pytest.mark.parametrize("loss", ["sft_loss", "sft_loss_lora", "slime_custom_loss"])
def test_a_loss_reads_each_tokens_kept_set(tiny_model, tmp_path, samples, loss):
    """Samples sampled under top-k carry each token's kept set: the trainer's own loss (through the fused
    head; with LoRA too, whose new adapter leaves the policy as it was) and a slime custom loss that reads
    the logits (slime's ``sft_loss_function``) all train on the distribution over the set,
    ``transformers``' log-softmax restricted to it."""
    samples = with_kept_sets(samples, transformers.AutoConfig.from_pretrained(tiny_model("qwen2")).vocab_size)
    flags = (
        {"loss_type": "sft_loss"}
        if loss.startswith("sft_loss")
        else {
            "loss_type": "custom_loss",
            "custom_loss_function_path": "slime.backends.megatron_utils.loss.sft_loss_function",
        }
    )
    if loss == "sft_loss_lora":
        flags["lora_rank"] = 4
    metrics = one_step(tiny_model, tmp_path, samples, **flags)
    assert metrics["train/loss"] == pytest.approx(masked_nll_token_mean(tiny_model, samples), rel=1e-4)
    assert metrics["train/loss"] < nll_token_mean(tiny_model, samples) - 1.0  # six tokens, not the vocabulary


def test_samples_without_rollout_logprobs_train_on_the_trainers_own(tiny_model, tmp_path, samples):
    """Rollout log-probs are optional, as in slime. Without them a Sample's tokens are weighted 1 by TIS
    (the trainer's old log-probs stand in: ratio 1) and left out of the mismatch metric; the others'
    are weighted and measured as usual, recomputed here with ``transformers``."""
    for s in samples[1::2]:
        s.rollout_log_probs = None
    metrics = one_step(tiny_model, tmp_path, samples, use_tis=True, tis_clip=1.5, tis_clip_low=0.5)
    logps, advantages = token_logprobs(tiny_model, samples), grpo_advantages(samples)
    recorded = [(lp, s) for lp, s in zip(logps, samples) if s.rollout_log_probs is not None]
    weights = [
        (lp - torch.tensor(s.rollout_log_probs)).exp().clamp(0.5, 1.5)
        if s.rollout_log_probs is not None
        else torch.ones_like(lp)
        for lp, s in zip(logps, samples)
    ]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    tokens = sum(float(m.sum()) for m in masks)
    expected_pg = sum(float((-a * w * m).sum()) for a, w, m in zip(advantages, weights, masks)) / tokens
    assert metrics["train/samples_without_rollout_logprobs"] == len(samples) // 2
    assert metrics["train/pg_loss"] == pytest.approx(expected_pg, rel=1e-4)
    assert metrics["train/tis_mean"] == pytest.approx(
        sum(float((w * m).sum()) for w, m in zip(weights, masks)) / tokens, rel=1e-4
    )
    gaps = [
        ((lp - torch.tensor(s.rollout_log_probs)).abs(), torch.tensor(s.loss_mask, dtype=torch.float32))
        for lp, s in recorded
    ]
    assert metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(
        sum(float((g * m).sum()) for g, m in gaps) / sum(float(m.sum()) for _, m in gaps), rel=1e-4
    )
    # KL as reward (the sampler's log-probs against the reference) leaves them out too
    assert one_step(tiny_model, tmp_path, samples, kl_coef=0.1)["train/samples_without_rollout_logprobs"] == 4


def test_remove_sample_keeps_a_sample_out_of_the_loss(tiny_model, tmp_path, samples):
    for s in samples[1::2]:
        s.remove_sample = True  # what a sample filter sets (slime's field of that name)
    metrics = one_step(tiny_model, tmp_path, samples)
    assert metrics["train/loss_tokens"] == sum(s.loss_mask.count(1) for s in samples[0::2])
