"""Tinker's built-in losses, on one datum's per-token tensors, sum-reduced as the SDK documents them.

Every loss reads the trainer's log-prob of each target token (``logp``, with gradient) and the
datum's ``loss_fn_inputs`` by the SDK's names; none normalises (the client scales through
``weights`` and ``advantages``). With ``p = exp(logp - logprobs)``, the sampler's ``logprobs``:

| name | loss |
|---|---|
| ``cross_entropy`` | ``-sum(weights * logp)`` |
| ``importance_sampling`` | ``-sum(p * advantages)`` |
| ``ppo`` | ``-sum(min(p * A, clip(p, low, high) * A))``, ``clip_low_threshold`` / ``clip_high_threshold`` (0.8 / 1.2) |
| ``cispo`` | ``-sum(sg(clip(p, low, high)) * logp * A)`` |
| ``dro`` | ``-sum(logp * A - beta / 2 * (logp - logprobs)^2)``, ``beta`` (default 0.05) |
| ``gspo`` | ``ppo`` on ``sg(s) * exp(logp - sg(logp))``, ``s = exp(mean(logp - logprobs))`` (``sequence_ratio_mask``) |

``gspo`` is the token-level variant Tinker documents (GSPO-token): every token carries its
sequence's ratio as its value and its own log-prob's gradient, so per-token advantages still work.

``DEFAULTS`` holds each config's defaults and ``REQUIRED`` each loss's inputs; a missing input, an
unknown config key or an unknown loss is a ``LossInputError`` naming what is served.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inverted.errors import InvertedError

Loss = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


class LossInputError(InvertedError):
    """A loss asked for that is not served, or given inputs it cannot use (the caller's error)."""


def cross_entropy(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(logp * weights).sum() if weights is not None else -logp.sum()


def _ratio(logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def importance_sampling(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    return -(_ratio(logp, inputs) * inputs["advantages"]).sum()


def ppo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    ratio, advantages = _ratio(logp, inputs), inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def cispo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    clipped = _ratio(logp, inputs).clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(clipped * logp * inputs["advantages"]).sum()


def dro(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    quadratic = (logp - inputs["logprobs"]).square()
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * quadratic).sum()


def gspo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    in_ratio = inputs["sequence_ratio_mask"] != 0  # check_inputs saw that it marks a token
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())  # the sequence's value, each token's own gradient
    advantages = inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LOSSES: dict[str, Loss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
POLICY = ("target_tokens", "logprobs", "advantages")
REQUIRED = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": POLICY,
    "ppo": POLICY,
    "cispo": POLICY,
    "dro": POLICY,
    "gspo": (*POLICY, "sequence_ratio_mask"),
}
CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": CLIPS,
    "cispo": CLIPS,
    "dro": {"beta": 0.05},
    "gspo": CLIPS,
}
# The SDK's names whose definition is not ours to serve: said so, not approximated.
NOT_SERVED = {"stable_reinforce": "its definition is not published"}


def resolve(name: str, config: dict[str, float | str]) -> tuple[Loss, dict[str, float]]:
    """The loss ``name`` and its config with defaults, or ``LossInputError``."""
    if name not in LOSSES:
        why = f" ({NOT_SERVED[name]})" if name in NOT_SERVED else ""
        raise LossInputError(f"loss_fn {name!r} is not served{why}; served: {', '.join(LOSSES)}")
    unknown = set(config) - set(DEFAULTS[name])
    if unknown:
        raise LossInputError(
            f"loss_fn {name!r} takes no config {sorted(unknown)}; it takes {sorted(DEFAULTS[name]) or 'none'}"
        )
    values = DEFAULTS[name] | config
    if any(isinstance(v, str) for v in values.values()):
        raise LossInputError(f"loss_fn {name!r}: every config value is a number, got {values}")
    return LOSSES[name], {k: float(v) for k, v in values.items()}


def check_inputs(name: str, inputs: dict, length: int, where: str) -> None:
    """Every input ``name`` needs, each with one value per position of the datum."""
    for key in REQUIRED[name]:
        if key not in inputs:
            raise LossInputError(
                f"{where}: loss_fn {name!r} needs loss_fn_inputs {list(REQUIRED[name])}; {key!r} is missing"
            )
    for key, value in inputs.items():
        if key not in REQUIRED[name] + ("weights",):
            raise LossInputError(f"{where}: loss_fn {name!r} takes no input {key!r}")
        if value.shape != (length,):
            raise LossInputError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}, the input has {length} tokens"
            )
    if "sequence_ratio_mask" in inputs and not inputs["sequence_ratio_mask"].any():
        raise LossInputError(
            f"{where}: sequence_ratio_mask marks no token (gspo's ratio is a mean over those it marks)"
        )
