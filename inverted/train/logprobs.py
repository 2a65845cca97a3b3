"""Per-token log-probabilities and entropies of the trained tokens, in fp32, at a temperature.

Two ways to the same numbers:

- ``token_logprobs_and_entropy(logits, ...)`` from the model's logits ``[T, V / tp]``: what a loss
  plug-in that reads the logits themselves needs (slime's custom losses).
- ``fused_logprobs_and_entropy(hidden, weight, ...)`` from the final hidden states and the output
  layer's weight, chunked over tokens: each chunk's logits are made, reduced to a few numbers per
  row and dropped, and backward makes them again (the technique of Liger's fused linear
  cross-entropy and of Megatron's vocab-parallel cross-entropy). A micro-batch of ``T`` tokens
  then never holds ``[T x V]`` fp32 tensors: only ``[chunk x V]`` ones, one at a time. At
  SmolLM2's 49,152-token vocabulary a 4,096-token micro-batch's logits are 0.8 GB a tensor,
  and the logits path keeps several of them for backward.

Under tensor parallelism each rank holds a slice of the vocabulary, so a softmax needs the maximum
and the normaliser of the whole row: both are all-reduced over the tensor-parallel group. Every TP
rank computes the same loss from the reduced values, so the logits path reduces with Megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), and the fused
path's backward gives each rank the gradient of its own slice; the gradients of the hidden states
are summed over the group by the mapping that ``output_hidden_states`` puts where the output layer
was (what Megatron's ``ColumnParallelLinear`` does for its input). The detached maximum only shifts
for stability. Logits are divided by the rollout temperature first, so the training log-probs are
those of the distribution the engine sampled from.

Under top-p or top-k the engine sampled from a cut distribution: each token's **kept set** (its
sampling mask, ``packing.KeptSets``) replays that cut. A row with a set has its softmax taken over
the set alone: a ``[rows x V / tp]`` keep mask zeroes the others' ``exp`` in the sums (each rank its
own slice, so TP reduces the same sums), and backward zeroes their probabilities, so they get no
gradient. Log-prob, entropy and every ratio built on them then read the distribution the token
was sampled from; the whole vocabulary's normaliser is kept beside it (``Head.unmasked``: the log-prob
a trainer without the masks would compute, for the metric that shows the bias).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from inverted.train.packing import KeptSets


class Head(NamedTuple):
    """Per response token (fp32, ``[R]`` each): its log-prob, its distribution's entropy (None where not
    asked for), and with kept sets the log-prob over the whole vocabulary (detached; None without)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    unmasked: torch.Tensor | None = None


def _tensor_parallel() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _row_sums(
    scaled: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    in_place: bool = False,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum (over the whole vocabulary) and, over this rank's slice, ``[sum exp(z - max),
    z_target - max (0 off the slice), sum exp(z - max) (z - max)]`` (``[2 or 3, N]``, not yet summed over TP).

    ``keep`` (``[N, width]`` bool, the kept sets on this slice): the sums run over the kept tokens, and a
    last row adds the whole slice's ``sum exp(z - max)``. ``in_place``: ``scaled`` is a temporary outside
    autograd (the fused head's chunk), overwritten so that two ``[N x V]`` tensors exist at once, not
    four; the same operations, the same numbers."""
    size, rank, group = _tensor_parallel()
    width = scaled.shape[-1]
    start = rank * width
    row_max = scaled.detach().max(dim=-1).values
    if size > 1:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = scaled.sub_(row_max[:, None]) if in_place else scaled - row_max[:, None]
    exp = shifted.exp()
    local = (targets >= start) & (targets < start + width)
    picked = shifted.gather(-1, (targets - start).clamp(0, width - 1)[:, None]).squeeze(-1) * local
    whole = None
    if keep is not None:
        whole = exp.detach().sum(-1)
        exp = exp.masked_fill_(~keep, 0.0) if in_place else exp.masked_fill(~keep, 0.0)
    sums = [exp.sum(-1), picked]
    if with_entropy:
        sums.append((exp.mul_(shifted) if in_place else exp * shifted).sum(-1))
    if whole is not None:
        sums.append(whole)
    return row_max, torch.stack(sums)


def _from_sums(sums: torch.Tensor, with_entropy: bool, masked: bool = False) -> Head:
    log_z = sums[0].log()
    # H = log Z - E_p[shifted]:  -sum p log p with log p = shifted - log Z.
    return Head(
        sums[1] - log_z,
        log_z - sums[2] / sums[0] if with_entropy else None,
        (sums[1] - sums[-1].log()).detach() if masked else None,
    )


def token_logprobs_and_entropy(
    logits_TV: torch.Tensor,
    targets_T: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    keep: torch.Tensor | None = None,
) -> Head:
    """``log p(target_t)`` and the entropy of each row's distribution, ``[T]`` each (fp32), from the logits;
    with ``keep`` (``[T, V / tp]`` bool) each row's distribution over its kept set."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    _, sums = _row_sums(logits_TV.float() / temperature, targets_T, with_entropy, keep=keep)
    if _tensor_parallel()[0] > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    return _from_sums(sums, with_entropy, keep is not None)


def keep_mask(kept: KeptSets | None, rows: int, width: int, device: torch.device | str) -> torch.Tensor | None:
    """The first ``rows`` kept sets as a ``[rows, width]`` mask over this tensor-parallel rank's vocabulary
    slice; None without kept sets."""
    if kept is None:
        return None
    return kept.mask(slice(0, rows), _tensor_parallel()[1] * width, width, device)


def masked_logits(logits_TV: torch.Tensor, rows_R: torch.Tensor, keep_RV: torch.Tensor | None) -> torch.Tensor:
    """The logits a loss that reads them sees: at ``rows_R`` (the positions that predict the responses),
    the tokens outside each one's kept set 1e4 below the row's least, so that any softmax of the row, at
    any temperature up to 1, is over the set (and ``p log p`` stays finite there: 0)."""
    if keep_RV is None:
        return logits_TV
    keep = torch.ones(logits_TV.shape, dtype=torch.bool, device=logits_TV.device)
    keep[rows_R] = keep_RV
    return torch.where(keep, logits_TV, logits_TV.detach().amin(dim=-1, keepdim=True) - 1e4)


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, low: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    # The output layer's matmul in the model's dtype, then fp32: as the logits path computes them
    # (with an adapter: plus its low-rank activations times its scaled B, as its forward hook adds them).
    z = hidden @ weight.t()
    if low is not None and b is not None:
        z = torch.addmm(z, low, b.t())
    return z.float() / temperature


class _FusedHead(torch.autograd.Function):
    """Log-probs and entropies of ``hidden @ weight.T / temperature`` chunk by chunk; backward recomputes."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        low: torch.Tensor | None,
        b: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        kept: KeptSets | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, rank, group = _tensor_parallel()
        rows, width = len(hidden), weight.shape[0]
        logprobs, entropy, unmasked = (hidden.new_empty(rows, dtype=torch.float32) for _ in range(3))
        # Per row, what backward needs to rebuild the softmax without a second reduction:
        # log Z (the maximum included) and E_p[z].
        log_z, mean_z = (hidden.new_empty(rows, dtype=torch.float32) for _ in range(2))
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            keep = kept.mask(part, rank * width, width, hidden.device) if kept is not None else None
            z = _scaled_logits(hidden[part], weight, temperature, low[part] if low is not None else None, b)
            row_max, sums = _row_sums(z, targets[part], True, in_place=True, keep=keep)
            del z
            if size > 1:
                torch.distributed.all_reduce(sums, group=group)
            head = _from_sums(sums, True, keep is not None)
            assert head.entropy is not None  # asked for
            logprobs[part], entropy[part] = head.logprobs, head.entropy
            unmasked[part] = head.unmasked if head.unmasked is not None else head.logprobs
            log_z[part] = row_max + sums[0].log()
            mean_z[part] = row_max + sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, low, b, targets, log_z, mean_z)
        ctx.temperature, ctx.chunk, ctx.kept = temperature, chunk, kept
        ctx.mark_non_differentiable(unmasked)
        return logprobs, entropy, unmasked

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, _grad_unmasked: torch.Tensor):
        hidden, weight, low, b, targets, log_z, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        _, rank, _ = _tensor_parallel()
        width = weight.shape[0]
        want_hidden, want_weight, want_low, want_b = ctx.needs_input_grad[:4]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_low = torch.empty_like(low) if want_low else None
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if want_b else None
        for start in range(0, len(hidden), ctx.chunk):
            part = slice(start, start + ctx.chunk)
            z = _scaled_logits(hidden[part], weight, temperature, low[part] if low is not None else None, b)
            # d log p_t / dz_j = [j = t] - p_j;  dH / dz_j = -p_j (z_j - E_p[z]). In place, so that two
            # [chunk x V] tensors exist at once (z and p), not five.
            g_logp, g_ent = grad_logprobs[part, None], grad_entropy[part, None]
            p = (z - log_z[part, None]).exp_()
            keep = ctx.kept.mask(part, rank * width, width, hidden.device) if ctx.kept is not None else None
            if keep is not None:  # outside its kept set a token has no probability, and no gradient
                p.masked_fill_(~keep, 0.0)
            grad_z = p.mul_(z.sub_(mean_z[part, None]).mul_(g_ent).add_(g_logp)).neg_()
            del z, p
            local = targets[part] - rank * width
            on_slice = ((local >= 0) & (local < width)).nonzero().squeeze(-1)
            grad_z[on_slice, local[on_slice]] += g_logp[on_slice, 0]
            grad_logits = grad_z.div_(temperature).to(hidden.dtype)
            del grad_z
            if grad_hidden is not None:
                grad_hidden[part] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden[part]).float()
            if grad_low is not None:
                grad_low[part] = grad_logits @ b
            if grad_b is not None:
                grad_b += (grad_logits.t() @ low[part]).float()
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_low,
            grad_b.to(b.dtype) if grad_b is not None else None,
            *(None,) * 4,
        )


def fused_logprobs_and_entropy(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    kept: KeptSets | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Head:
    """``log p(target_t)`` and entropies (``[T]`` each, fp32) of ``hidden_TH @ weight_VH.T``, this rank's
    vocabulary slice of the output layer, ``chunk`` tokens at a time; equal to
    ``token_logprobs_and_entropy`` of those logits. ``kept``: the rows' kept sets (their distributions
    are over them). ``low_rank``: an adapted output layer's low-rank activations ``[T, r]`` and its
    scaled ``B`` slice ``[V / tp, r]``, whose product is added to the logits."""
    low, b = low_rank if low_rank is not None else (None, None)
    logprobs, entropy, unmasked = _FusedHead.apply(
        hidden_TH, weight_VH, low, b, targets_T, temperature, max(1, chunk), kept
    )
    return Head(logprobs, entropy, unmasked if kept is not None else None)


def output_weight(model) -> torch.Tensor:
    """The output layer's weight of a (DDP-wrapped) ``GPTModel``'s last stage: with tied embeddings, the
    embedding (or the last stage's copy of it), as Megatron's own forward passes it."""
    gpt = getattr(model, "module", model)
    return (
        gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
    )


def head_inputs(model, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """What the fused head multiplies, from what the model returned inside ``output_hidden_states``: the
    hidden states, the output layer's weight, and an adapted output layer's ``(low-rank activations,
    scaled B)`` (None without an adapter there, or with it disabled)."""
    weight = output_weight(model)
    lora = getattr(getattr(getattr(model, "module", model), "output_layer", None), "lora", None)
    if lora is None or output.shape[-1] == weight.shape[1]:
        return output, weight, None
    hidden, low = output.split([weight.shape[1], output.shape[-1] - weight.shape[1]], dim=-1)
    return hidden, weight, (low, lora.products()[1][0].to(hidden.dtype))


@contextlib.contextmanager
def output_hidden_states(model) -> Iterator[None]:
    """Inside, the (DDP-wrapped) ``GPTModel`` returns its final hidden states ``[1, T, H]`` where it
    returned logits: its output layer is skipped, keeping only what that layer does to its input across
    tensor-parallel ranks (sequence parallelism's all-gather, whose backward reduce-scatters; else
    Megatron's copy, whose backward sums the ranks' partial gradients). An adapted output layer
    (``train.lora``) appends its low-rank activations ``[1, T, r]`` (``head_inputs`` parts them)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = getattr(getattr(model, "module", model), "output_layer", None)
    if layer is None:  # not the last pipeline stage: it returns hidden states anyway
        yield
        return

    lora = getattr(layer, "lora", None)

    def hidden(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=layer.tp_group), None
        if lora is not None and lora.enabled:  # the reference (adapters disabled) has no low-rank part
            # One copy for both: Megatron's all-reduce of a gradient needs it contiguous, and the parts
            # of a concatenation's gradient are not.
            input_ = torch.cat([input_, lora.local_low(input_).to(input_.dtype)], dim=-1)
        return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None

    layer.forward = hidden  # an instance attribute: the module, its weights and their names are untouched
    if lora is not None:
        lora.in_fused_head = True
    try:
        yield
    finally:
        del layer.forward
        if lora is not None:
            lora.in_fused_head = False
