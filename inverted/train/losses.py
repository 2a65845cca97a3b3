"""RL objectives: advantages, the policy-gradient surrogates, KL, entropy, and loss aggregation.

Everything here is plain tensor math on flat per-token tensors, so each formula can be read and
tested on its own (``tests/train/test_losses.py`` recomputes every one independently).

**Advantages** (``--advantage-estimator``), one value per response token:

- ``grpo``, ``gspo``, ``cispo``: group-relative. A sample's advantage is its reward minus its
  group's mean, divided by the group's (unbiased) std unless ``--disable-grpo-std-normalization``
  (Dr. GRPO). A group of one sample has advantage 0: it has nothing to be compared with.
- ``reinforce_plus_plus``: the reward sits on the last response token, a per-token KL penalty
  (``--kl-coef``) on every token; the return is their discounted sum to the end (``--gamma``);
  returns are whitened over all loss tokens of the batch.
- ``reinforce_plus_plus_baseline``: reward minus the group mean on every token, then whitened.

For the group estimators ``--kl-coef`` shapes the reward: ``r - kl_coef * sum_t kl_t``.

**Surrogates**, with ``ratio = exp(logp - old_logp)``:

- PPO clip (``grpo``, ``reinforce_plus_plus*``): ``max(-A r, -A clip(r, 1 - eps, 1 + eps_high))``,
  and with ``--eps-clip-c`` (dual clip, > 1) at most ``-A c`` where ``A < 0``.
- GSPO: the same clip on a sequence-level ratio, ``exp(mean_t(logp - old_logp))`` over the
  sequence's loss tokens, shared by its tokens.
- CISPO: ``-sg(clip(r, 1 - eps, 1 + eps_high)) * A * logp``: the clipped ratio weights a
  REINFORCE term, so clipped tokens still get gradient.

**Truncated importance sampling** (``--use-tis``) multiplies each token's surrogate by
``sg(clip(exp(old_logp - rollout_logp), tis_clip_low, tis_clip))``, correcting for the gap
between the engine that sampled and the trainer. **KL loss** (``--use-kl-loss``) adds
``kl_loss_coef * kl(logp, ref_logp)`` with ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``,
``k3 = exp(ref - logp) - (ref - logp) - 1`` (``low_var_kl`` is k3 clamped to [-10, 10]).
``--entropy-coef`` subtracts the entropy bonus.

**On-policy distillation** (``--distill``, slime's ``--use-opd``): after the estimator, each token's
advantage loses ``distill_kl_coef * (logp_old - logp_teacher)``, the teacher's log-probs coming with
the Samples (``--distill samples``: a reward post-process sets ``teacher_log_probs``, as slime's
``--opd-type sglang`` reads them from a teacher server) or from a teacher the trainer runs
(``--distill teacher --distill-teacher CKPT``, slime's ``--opd-type megatron``).

**Aggregation** (``--loss-aggregation``) turns per-token values into one number through weights
fixed per optimizer step over the whole global batch (all micro-batches, all data-parallel
ranks), so summing ``weight * value`` anywhere and summing gradients over ranks gives exactly
the global loss: ``token_mean`` weights each loss token ``1 / tokens``; ``seq_mean_token_mean``
weights ``1 / (len_i * sequences)``; ``seq_mean_token_sum`` weights ``1 / sequences``. Sequences
with no loss token are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS = 1e-6


def group_baseline(rewards_N: torch.Tensor, groups: Sequence[object], std_normalize: bool) -> torch.Tensor:
    """Reward minus the group mean, over the group std if asked; 0 for a group of one."""
    out = torch.zeros_like(rewards_N)
    for group in dict.fromkeys(groups):
        idx = torch.tensor([i for i, g in enumerate(groups) if g == group])
        if len(idx) < 2:
            continue
        r = rewards_N[idx]
        centered = r - r.mean()
        out[idx] = centered / (r.std() + EPS) if std_normalize else centered
    return out


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Shift and scale to mean 0, std 1 over all masked tokens of the batch."""
    flat = torch.cat([v[m.bool()] for v, m in zip(values, masks)])
    if flat.numel() < 2:
        return [torch.zeros_like(v) for v in values]
    mean, std = flat.mean(), flat.std()
    return [(v - mean) / (std + EPS) for v in values]


def discounted_returns(rewards_T: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rewards_T)
    running = torch.zeros((), dtype=rewards_T.dtype)
    for t in range(len(rewards_T) - 1, -1, -1):
        running = rewards_T[t] + gamma * running
        out[t] = running
    return out


def compute_advantages(
    estimator: str,
    rewards_N: torch.Tensor,
    groups: Sequence[object],
    masks: list[torch.Tensor],
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    std_normalize: bool = True,
    baseline: bool = True,
) -> list[torch.Tensor]:
    """Per-token advantages for each sample (``masks[i]`` has one entry per response token).

    ``baseline=False``: the rewards were normalised already (``--custom-reward-post-process-path``,
    slime's hook), so the group estimators take them as they are."""
    kl = kl if kl is not None and kl_coef else [torch.zeros(len(m)) for m in masks]
    if estimator == "reinforce_plus_plus":
        returns = []
        for reward, mask, kl_i in zip(rewards_N.tolist(), masks, kl):
            token_rewards = -kl_coef * kl_i * mask
            last = mask.nonzero()
            if len(last):
                token_rewards[last[-1]] += reward
            returns.append(discounted_returns(token_rewards, gamma))
        return whiten(returns, masks)
    shaped = rewards_N - kl_coef * torch.stack([(k * m).sum() for k, m in zip(kl, masks)]) if masks else rewards_N
    if estimator == "reinforce_plus_plus_baseline":
        centered = group_baseline(shaped, groups, std_normalize=False) if baseline else shaped
        return whiten([torch.full((len(m),), float(a)) for a, m in zip(centered, masks)], masks)
    centered = group_baseline(shaped, groups, std_normalize) if baseline else shaped
    return [torch.full((len(m),), float(a)) for a, m in zip(centered, masks)]


def distillation_penalty(
    advantages: list[torch.Tensor], student: list[torch.Tensor], teacher: list[torch.Tensor], coef: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On-policy distillation (slime's ``--use-opd``): each token's advantage minus ``coef`` times the
    reverse KL's sample ``logp_student - logp_teacher`` at that token; also returns that KL."""
    reverse_kl = [s.float() - t.float() for s, t in zip(student, teacher)]
    return [a - coef * kl for a, kl in zip(advantages, reverse_kl)], reverse_kl


def masked_mean(values: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    """The mean over every masked token of the batch (0.0 with none)."""
    total, count = sum(float((v * m).sum()) for v, m in zip(values, masks)), sum(float(m.sum()) for m in masks)
    return total / count if count else 0.0


def token_weights(aggregation: str, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each token's weight in the step's loss (0 off the loss mask); see the module docstring."""
    counts = [float(m.sum()) for m in masks]
    sequences = sum(1 for c in counts if c > 0)
    tokens = sum(counts)
    weights = []
    for mask, count in zip(masks, counts):
        if count == 0:
            weights.append(torch.zeros(len(mask)))
        elif aggregation == "token_mean":
            weights.append(mask / tokens)
        elif aggregation == "seq_mean_token_mean":
            weights.append(mask / (count * sequences))
        else:
            weights.append(mask / sequences)
    return weights


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.exp(-log_ratio) + log_ratio - 1
    return k3.clamp(-10, 10) if kind == "low_var_kl" else k3


def sequence_mean(values_T: torch.Tensor, mask_T: torch.Tensor, seq_ids_T: torch.Tensor, count: int) -> torch.Tensor:
    """Each token gets the masked mean of its sequence's values (0 for a sequence with no mask)."""
    sums = values_T.new_zeros(count).index_add(0, seq_ids_T, values_T * mask_T)
    lengths = values_T.new_zeros(count).index_add(0, seq_ids_T, mask_T)
    return (sums / lengths.clamp(min=1))[seq_ids_T]


def policy_loss(
    estimator: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token surrogate loss and per-token diagnostics (ratio, clipped) for one micro-batch."""
    log_ratio = logp - old_logp
    if estimator == "gspo":
        log_ratio = sequence_mean(log_ratio, mask, seq_ids, num_seqs)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    if estimator == "cispo":
        loss = -clipped_ratio.detach() * advantages * logp
        clipped = (ratio != clipped_ratio).float()
    else:
        unclipped_loss, clipped_loss = -advantages * ratio, -advantages * clipped_ratio
        loss = torch.maximum(unclipped_loss, clipped_loss)
        clipped = (clipped_loss > unclipped_loss).float()
        if eps_clip_c is not None:
            dual = torch.minimum(loss, -advantages * eps_clip_c)
            clipped = torch.where((advantages < 0) & (dual < loss), torch.ones_like(clipped), clipped)
            loss = torch.where(advantages < 0, dual, loss)
    return loss, {"ratio": ratio.detach(), "clipped": clipped}


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.exp(old_logp - rollout_logp).clamp(low, high).detach()
