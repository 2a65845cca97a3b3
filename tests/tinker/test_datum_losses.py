"""Tinker's losses (``train/datum_losses.py``) against an exact recomputation of the SDK's documented formulas.

Each loss's value and its gradient with respect to the trainer's log-probs are recomputed in float64
numpy from the formulas Tinker's documentation gives (sum-reduced, no normalisation), on random
inputs whose ratios fall on both sides of the clip thresholds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inverted.train import datum_losses

rng = np.random.default_rng(0)
N = 64
LOGP = rng.normal(-2.0, 1.0, N)
SAMPLED = LOGP + rng.normal(0.0, 0.4, N)  # ratios from ~0.3 to ~3: both clips bite
ADV = rng.normal(0.0, 1.0, N)
WEIGHTS = rng.uniform(0.0, 1.0, N)
MASK = (np.arange(N) >= 10).astype(float)  # gspo's sequence: the sampled tokens after a 10-token prompt


def reference(name: str, config: dict[str, float]) -> tuple[float, np.ndarray]:
    """(loss, d loss / d logp), by hand."""
    ratio = np.exp(LOGP - SAMPLED)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if name == "cross_entropy":
        return -(WEIGHTS * LOGP).sum(), -WEIGHTS
    if name == "importance_sampling":
        return -(ratio * ADV).sum(), -ratio * ADV
    if name == "ppo":
        clipped = np.clip(ratio, low, high)
        unclipped_wins = ratio * ADV <= clipped * ADV
        inside = (ratio > low) & (ratio < high)
        grad = np.where(unclipped_wins | inside, -ratio * ADV, 0.0)
        return -np.minimum(ratio * ADV, clipped * ADV).sum(), grad
    if name == "cispo":
        clipped = np.clip(ratio, low, high)
        return -(clipped * LOGP * ADV).sum(), -clipped * ADV
    if name == "dro":
        beta = config.get("beta", 0.05)
        return -(LOGP * ADV - 0.5 * beta * (LOGP - SAMPLED) ** 2).sum(), -(ADV - beta * (LOGP - SAMPLED))
    if name == "gspo":  # one ratio per sequence, each token's gradient its own: d s_t / d logp_t = s
        s = np.exp((LOGP - SAMPLED)[MASK != 0].mean())
        clipped = np.clip(s, low, high)
        keeps_gradient = (s * ADV <= clipped * ADV) | (low < s < high)
        return -np.minimum(s * ADV, clipped * ADV).sum(), np.where(keeps_gradient, -s * ADV, 0.0)
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name,config",
    [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
        ("cispo", {}),
        ("cispo", {"clip_high_threshold": 1.5}),
        ("dro", {}),
        ("dro", {"beta": 0.3}),
        ("gspo", {}),
        ("gspo", {"clip_low_threshold": 0.999, "clip_high_threshold": 1.001}),
    ],
)  # gspo's ratio (0.991) clipped
def test_each_loss_and_its_gradient_equal_the_documented_formula(name, config):
    loss, resolved = datum_losses.resolve(name, config)
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    inputs = {
        "weights": torch.tensor(WEIGHTS),
        "logprobs": torch.tensor(SAMPLED),
        "advantages": torch.tensor(ADV),
        "sequence_ratio_mask": torch.tensor(MASK),
    }
    value = loss(logp, {k: v for k, v in inputs.items() if k in datum_losses.REQUIRED[name] + ("weights",)}, resolved)
    value.backward()
    expected, grad = reference(name, config)
    assert float(value.detach()) == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(logp.grad.numpy(), grad, rtol=1e-12, atol=1e-12)


def test_unknown_losses_and_configs_are_refused_with_what_is_served():
    with pytest.raises(datum_losses.LossInputError, match="not published.*served: cross_entropy, importance_sampling"):
        datum_losses.resolve("stable_reinforce", {})
    with pytest.raises(datum_losses.LossInputError, match="takes no config \\['beta'\\]"):
        datum_losses.resolve("ppo", {"beta": 1.0})
    with pytest.raises(datum_losses.LossInputError, match="'advantages' is missing"):
        datum_losses.check_inputs("cispo", {"target_tokens": np.zeros(3), "logprobs": np.zeros(3)}, 3, "datum 0")
    with pytest.raises(datum_losses.LossInputError, match="'sequence_ratio_mask' is missing"):
        datum_losses.check_inputs(
            "gspo", {"target_tokens": np.zeros(3), "logprobs": np.zeros(3), "advantages": np.zeros(3)}, 3, "datum 0"
        )
    with pytest.raises(datum_losses.LossInputError, match="sequence_ratio_mask marks no token"):
        datum_losses.check_inputs(
            "gspo",
            {
                "target_tokens": np.zeros(3),
                "logprobs": np.zeros(3),
                "advantages": np.zeros(3),
                "sequence_ratio_mask": np.zeros(3),
            },
            3,
            "datum 0",
        )
    with pytest.raises(datum_losses.LossInputError, match="has shape \\[2\\], the input has 3 tokens"):
        datum_losses.check_inputs("cross_entropy", {"target_tokens": np.zeros(2)}, 3, "datum 0")
