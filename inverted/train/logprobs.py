"""Per-token log-probabilities and entropies from (vocab-parallel) logits, in fp32, at a temperature.

Under tensor parallelism each rank holds a slice of the vocabulary (``[T, V / tp]``), so a
softmax needs the maximum and the normaliser of the whole row: both are all-reduced over the
tensor-parallel group. The reductions that carry gradients use Megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), because
every TP rank computes the same loss from the reduced values; the detached maximum only shifts
for stability. Logits are divided by the rollout temperature first, so the training log-probs
are those of the distribution the engine sampled from.
"""

from __future__ import annotations

import torch


def token_logprobs_and_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target_t)`` and the entropy of each row's distribution, ``[T]`` each (fp32)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    logits = logits_TV.float() / temperature
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width

    row_max = logits.detach().max(dim=-1).values
    if tp_size > 1:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - row_max[:, None]
    exp = shifted.exp()
    local = (targets_T >= start) & (targets_T < start + width)
    picked = shifted.gather(-1, (targets_T - start).clamp(0, width - 1)[:, None]).squeeze(-1) * local
    sums = torch.stack([exp.sum(-1), picked] + ([(exp * shifted).sum(-1)] if with_entropy else []))
    if tp_size > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    log_z = sums[0].log()
    logprobs = sums[1] - log_z
    # H = log Z - E_p[shifted]:  -sum p log p with log p = shifted - log Z.
    entropy = log_z - sums[2] / sums[0] if with_entropy else None
    return logprobs, entropy
