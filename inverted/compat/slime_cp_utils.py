"""slime's ``slime.backends.megatron_utils.cp_utils`` at context parallel of size 1.

Context parallelism splits one sequence over ranks, which Megatron allows only with Transformer
Engine; inverted's trainer runs without it on CPU and at CP 1 everywhere. Plug-ins written for slime
still call these helpers (its importance-sampling example ``mis.py`` gathers and slices log-probs
with them), and at CP 1 each is what slime's own is in its ``cp_size == 1`` branch: gathering and
slicing return their input, and ``get_sum_of_sample_mean`` is each sample's masked mean, summed (or
with ``calculate_per_token_loss`` the masked sum). ``get_logits_and_tokens_offset_with_cp``, which
slime asserts is only called at CP > 1, refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def get_logits_and_tokens_offset_with_cp(total_length: int, response_length: int) -> Any:
    raise AssertionError("get_logits_and_tokens_offset_with_cp: context parallel size is 1 (slime asserts > 1)")


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    sample_denoms: list[torch.Tensor] | torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reduction of a flat per-token tensor: each sample's masked sum over its denominator (its
    mask's sum unless ``sample_denoms`` gives one), summed; or the masked sum of every token."""
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum(
            (x_i * mask_i).sum() / torch.clamp_min(denom, 1)
            for x_i, mask_i, denom in zip(x.split(response_lengths, dim=0), loss_masks, sample_denoms)
        )

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum((x_i * mask_i).sum() for x_i, mask_i in zip(x.split(response_lengths, dim=0), loss_masks))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """The whole response's tensor: at CP 1 this rank already holds all of it."""
    return tensor


def slice_with_cp(tokens: torch.Tensor, pad_value: Any) -> torch.Tensor:
    """This rank's share of a sequence: at CP 1, all of it."""
    return tokens


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor, total_length: int, response_length: int
) -> list[float] | torch.Tensor:
    """This rank's share of a response's log-probs: at CP 1, all of them (whose length slime checks)."""
    assert len(log_prob) == response_length, (
        f"log_prob length mismatch: len(log_prob)={len(log_prob)}, response_length={response_length}, "
        f"total_length={total_length}"
    )
    return log_prob
