"""slime's training-side plug-ins on our trainer: a custom loss, importance weights, the pg-loss reducer,
and what they import from ``slime.backends.megatron_utils.loss``.

Our loss is a weighted sum: each token's weight in an optimizer step is fixed before the step
(``losses.token_weights``, the ``--loss-aggregation`` over the whole global batch), so
micro-batches and data-parallel ranks just add up. slime's plug-ins are written in its terms, and
these adapters translate, one micro-batch at a time:

- ``sum_of_sample_mean(x)`` is ``sum(weight * x)``: the configured aggregation of a per-token
  tensor (slime's per-sample mean, which Megatron then divides by the global batch size, is our
  ``seq_mean_token_mean``).
- ``--custom-pg-loss-reducer-function-path``: the reducer's value for the micro-batch, divided by
  the samples of the optimizer step (slime divides by ``--global-batch-size``), is the
  policy-gradient term; KL and entropy keep the aggregation. The reducer is told
  ``calculate_per_token_loss`` as slime's ``args`` has it (False unless the flag is given); when
  True, the division is by the step's trained tokens, as Megatron's per-token loss.
- ``--custom-tis-function-path``: gets the policy-gradient loss per token and the per-sample
  log-probs and masks, returns the reweighted loss and masks. A token whose mask it zeroes leaves
  the loss; with ``seq_mean_token_mean`` its sample's other tokens are renormalised, as slime
  rebuilds its per-sample means from the returned masks.
- ``--custom-loss-function-path`` (``--loss-type custom_loss``): ``fn(args, batch, logits,
  sum_of_sample_mean) -> (loss, metrics)``. ``batch`` holds slime's per-sample lists
  (``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``, ``advantages``,
  ``log_probs`` (the old policy's), ``rollout_log_probs``, ``ref_log_probs`` when there is a
  reference) and ``logits`` are in slime's layout, ``[1, sum(total_lengths), V / tp]`` with the
  samples back to back (our packing shares a group's prompt; the rows are copied out for the
  plug-in). ``get_log_probs_and_entropy`` reads log-probs from them, tensor-parallel-correct, and
  ``sft_loss_function`` is slime's SFT loss on it (both under ``slime.backends.megatron_utils.loss``).
  Where the Samples recorded kept sets (top-p/top-k sampling masks), each response token's row has
  the tokens outside its set pushed far below (``logprobs.masked_logits``), so the plug-in's softmax
  reads the distribution the token was sampled from.

``custom_loss``, ``custom_tis`` and ``reduce_pg`` take the plug-in and slime's ``args`` first: bound
to them (``compat.slime_forms``), each is the trainer's hook of that name (``plugins.LossPlugins``).
A Sample without rollout log-probs reaches them with the trainer's old log-probs in their place.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from inverted.train.logprobs import keep_mask, masked_logits, token_logprobs_and_entropy
from inverted.train.packing import MicroBatch


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: Any,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Per sample, the response tokens' log-probs (and entropies) from slime-layout logits ``[1, T, V / tp]``,
    as slime returns them: an empty tensor (its non-loss-data slot) and ``{"log_probs", "entropy"}``."""
    rows, targets, offset = [], [], 0
    for tokens, total, response in zip(unconcat_tokens, total_lengths, response_lengths):
        rows.append(torch.arange(offset + total - response - 1, offset + total - 1))
        targets.append(tokens[total - response : total])
        offset += total
    index = torch.cat(rows).to(logits.device) if rows else torch.zeros(0, dtype=torch.long, device=logits.device)
    logp, entropy = token_logprobs_and_entropy(
        logits[0][index], torch.cat(targets).to(logits.device), args.rollout_temperature, with_entropy
    )[:2]
    out = {"log_probs": list(logp.split(response_lengths))}
    if entropy is not None:  # asked for
        out["entropy"] = list(entropy.split(response_lengths))
    return torch.empty((0,), device=logits.device), out


def sft_loss_function(
    args: Any, batch: dict[str, Any], logits: torch.Tensor, sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's SFT loss: the negative log-likelihood of the response tokens, aggregated by
    ``sum_of_sample_mean``; ``{"loss"}`` detached as its metric."""
    _, out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    log_probs = torch.cat(out["log_probs"], dim=0)
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:  # keep the graph connected, as slime does
        loss = loss + 0 * logits.sum()
    return loss, {"loss": loss.clone().detach()}


def sequences(mb: MicroBatch) -> tuple[list[torch.Tensor], list[int]]:
    """Each sample's row positions in the packed micro-batch (its prompt, then its response) and its length."""
    positions = mb.sequence_positions()
    return positions, [len(p) for p in positions]


def custom_loss(
    fn: Callable[..., Any],
    args: Any,
    mb: MicroBatch,
    logits: torch.Tensor,
    per_token: dict[str, torch.Tensor],
    weight: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's custom loss on one micro-batch; ``per_token`` holds the micro-batch's flat tensors by
    slime's batch name (``log_probs``, ``advantages``, ...)."""
    positions, totals = sequences(mb)
    batch: dict[str, Any] = {name: list(values.split(mb.response_lengths)) for name, values in per_token.items()}
    batch.update(
        unconcat_tokens=[mb.tokens_T[p].to(logits.device) for p in positions],
        total_lengths=totals,
        response_lengths=list(mb.response_lengths),
    )
    rows = (
        torch.cat(positions).to(logits.device) if positions else torch.zeros(0, dtype=torch.long, device=logits.device)
    )
    unshared = logits[rows]
    if mb.kept is not None:  # each response token's kept set (sampling masks): the plug-in's softmax is over it
        predictors = torch.cat(
            [
                torch.arange(end - response - 1, end - 1)
                for end, response in zip(itertools.accumulate(totals), mb.response_lengths)
            ]
        ).to(logits.device)
        unshared = masked_logits(
            unshared, predictors, keep_mask(mb.kept, len(predictors), logits.shape[-1], logits.device)
        )
    loss, metrics = fn(args, batch, unshared[None], lambda x: (weight * x).sum())
    return loss, {
        name: torch.as_tensor(value).detach().to(weight.device, torch.float64).reshape(())
        for name, value in metrics.items()
    }


def reduce_pg(
    reducer_of: Callable[..., Any],
    mb: MicroBatch,
    pg: torch.Tensor,
    mask: torch.Tensor,
    divisor: int,
    per_token_loss: bool,
) -> torch.Tensor:
    """The policy-gradient term of one micro-batch through slime's reducer, divided as slime divides:
    by the optimizer step's samples, or with ``--calculate-per-token-loss`` by its trained tokens."""
    _, totals = sequences(mb)
    reducer = reducer_of(totals, list(mb.response_lengths), list(mask.split(mb.response_lengths)), per_token_loss)
    return reducer(pg) / divisor


def custom_tis(
    fn: Callable[..., Any],
    args: Any,
    mb: MicroBatch,
    pg: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    aggregation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """slime's importance-weight function on one micro-batch: the reweighted pg loss, the token
    weights with its rejections applied, and its ``tis`` values (if it reports them)."""
    lengths = list(mb.response_lengths)
    _, totals = sequences(mb)
    pg_out, masks, metrics = fn(
        args,
        pg_loss=pg,
        train_log_probs=list(old.split(lengths)),
        rollout_log_probs=list(rollout.split(lengths)),
        loss_masks=list(mask.split(lengths)),
        total_lengths=totals,
        response_lengths=lengths,
    )
    kept = torch.cat([m.to(weight.dtype) for m in masks]) if masks else torch.zeros_like(weight)
    weight = weight * kept
    if aggregation == "seq_mean_token_mean":  # a sample's mean over the tokens it still has
        seq = torch.repeat_interleave(
            torch.arange(len(lengths), device=mask.device), torch.tensor(lengths, device=mask.device)
        )
        before = mask.new_zeros(len(lengths)).index_add(0, seq, mask)
        after = mask.new_zeros(len(lengths)).index_add(0, seq, kept * mask)
        weight = weight * (before / after.clamp(min=1))[seq]
    return pg_out, weight, (metrics or {}).get("tis")
