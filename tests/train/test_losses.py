"""Every advantage estimator, surrogate, KL and aggregation against an independent per-token recomputation.

The reference implementations below are written from the papers' formulas with plain Python
loops over samples and tokens, not from ``losses.py``; edge cases (empty response, all-masked
sample, single-sample group) are in every batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from inverted.train import losses

# Five samples: a normal one, an empty response, an all-masked one, a partly masked one, and a
# single-sample group (group 2).
LENGTHS = [5, 0, 3, 6, 4]
GROUPS = [0, 0, 1, 1, 2]
MASKS = [[1, 1, 0, 1, 1], [], [0, 0, 0], [1, 0, 1, 1, 0, 1], [1, 1, 1, 1]]


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(LENGTHS), generator=g)
    masks = [torch.tensor(m, dtype=torch.float32) for m in MASKS]
    per_token = lambda: [torch.randn(n, generator=g) * 0.3 for n in LENGTHS]  # noqa: E731
    return rewards, masks, per_token


def ref_group_adv(rewards, std_normalize):
    out = []
    for i, group in enumerate(GROUPS):
        members = [float(rewards[j]) for j, h in enumerate(GROUPS) if h == group]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((float(rewards[i]) - mean) / (std + 1e-6) if std_normalize else float(rewards[i]) - mean)
    return out


def ref_whiten(values):
    flat = [v for vals, mask in zip(values, MASKS) for v, m in zip(vals, mask) if m]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(v - mean) / (std + 1e-6) for v in vals] for vals in values]


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_group_advantages(estimator, std_normalize):
    rewards, masks, per_token = batch(0)
    kl = per_token()
    got = losses.compute_advantages(estimator, rewards, GROUPS, masks, kl, kl_coef=0.1, std_normalize=std_normalize)
    shaped = [
        float(r) - 0.1 * sum(float(k) * m for k, m in zip(kl_i, mask)) for r, kl_i, mask in zip(rewards, kl, MASKS)
    ]
    want = ref_group_adv(torch.tensor(shaped), std_normalize)
    for g, w, n in zip(got, want, LENGTHS):
        assert g.shape == (n,)
        torch.testing.assert_close(g, torch.full((n,), w), rtol=1e-5, atol=1e-6)
    assert got[4].abs().sum() == 0  # a group of one has nothing to be compared with


def test_reinforce_plus_plus():
    rewards, masks, per_token = batch(1)
    kl = per_token()
    gamma, coef = 0.9, 0.05
    got = losses.compute_advantages("reinforce_plus_plus", rewards, GROUPS, masks, kl, kl_coef=coef, gamma=gamma)
    returns = []
    for reward, kl_i, mask in zip(rewards.tolist(), kl, MASKS):
        token_rewards = [-coef * float(k) * m for k, m in zip(kl_i, mask)]
        masked = [t for t, m in enumerate(mask) if m]
        if masked:
            token_rewards[masked[-1]] += reward
        returns.append(
            [sum(gamma ** (k - t) * token_rewards[k] for k in range(t, len(mask))) for t in range(len(mask))]
        )
    for g, w in zip(got, ref_whiten(returns)):
        torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def test_reinforce_plus_plus_baseline():
    rewards, masks, _ = batch(2)
    got = losses.compute_advantages("reinforce_plus_plus_baseline", rewards, GROUPS, masks)
    centered = ref_group_adv(rewards, std_normalize=False)
    want = ref_whiten([[c] * n for c, n in zip(centered, LENGTHS)])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_weights(aggregation):
    _, masks, per_token = batch(3)
    values = per_token()
    weights = losses.token_weights(aggregation, masks)
    got = sum(float((w * v).sum()) for w, v in zip(weights, values))
    live = [(vals, mask) for vals, mask in zip(values, MASKS) if sum(mask)]
    if aggregation == "token_mean":
        want = sum(float(v) * m for vals, mask in live for v, m in zip(vals, mask)) / sum(sum(m) for _, m in live)
    elif aggregation == "seq_mean_token_mean":
        want = sum(sum(float(v) * m for v, m in zip(vals, mask)) / sum(mask) for vals, mask in live) / len(live)
    else:
        want = sum(sum(float(v) * m for v, m in zip(vals, mask)) for vals, mask in live) / len(live)
    assert got == pytest.approx(want, rel=1e-5)
    assert all(float(w.abs().sum()) == 0 for w, m in zip(weights, MASKS) if not sum(m))


def ref_surrogate(estimator, logp, old, adv, mask, eps, eps_high, dual):
    """Per-token loss from the formulas, sample by sample."""
    out = []
    for lp_i, old_i, adv_i, mask_i in zip(logp, old, adv, mask):
        n = len(lp_i)
        if estimator == "gspo":
            masked = [float(a - b) for a, b, m in zip(lp_i, old_i, mask_i) if m]
            seq = math.exp(sum(masked) / len(masked)) if masked else 1.0
            ratios = [seq] * n
        else:
            ratios = [math.exp(float(a - b)) for a, b in zip(lp_i, old_i)]
        row = []
        for t in range(n):
            r, a = ratios[t], float(adv_i[t])
            clipped = min(max(r, 1 - eps), 1 + eps_high)
            if estimator == "cispo":
                row.append(-clipped * a * float(lp_i[t]))
                continue
            loss = max(-a * r, -a * clipped)
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            row.append(loss)
        out.append(row)
    return out


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_policy_loss_values(estimator, dual):
    _, masks, per_token = batch(4)
    logp = [-(x.abs() + 0.1) for x in per_token()]
    old = [lp + d for lp, d in zip(logp, per_token())]
    adv = per_token()
    adv[3] = adv[3] * 20  # large advantages and ratios reach the clip and dual-clip bounds
    seq_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    got, info = losses.policy_loss(
        estimator,
        torch.cat(logp),
        torch.cat(old),
        torch.cat(adv),
        torch.cat(masks),
        seq_ids,
        len(LENGTHS),
        eps_clip=0.1,
        eps_clip_high=0.15,
        eps_clip_c=dual,
    )
    want = ref_surrogate(estimator, logp, old, adv, MASKS, 0.1, 0.15, dual)
    torch.testing.assert_close(got, torch.tensor([v for row in want for v in row]), rtol=1e-5, atol=1e-6)
    assert 0 < float(info["clipped"].mean()) < 1


def test_gradients_of_the_surrogates():
    """PPO: no gradient where the clip binds; CISPO: gradient everywhere, weighted by the clipped ratio."""
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.5, -1.0, -0.5])  # ratios e^0.5, 1, e^-0.5
    adv = torch.tensor([1.0, 1.0, 1.0])
    ones, ids = torch.ones(3), torch.arange(3)
    loss, _ = losses.policy_loss("grpo", logp, old, adv, ones, ids, 3, 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -1.0, -math.exp(-0.5)])
    logp.grad = None
    loss, _ = losses.policy_loss("cispo", logp, old, adv, ones, ids, 3, 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.2, -1.0, -0.8])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp = torch.tensor([-1.0, -2.0, -0.1, -30.0])
    ref = torch.tensor([-1.5, -1.0, -0.1, -0.5])
    got = losses.kl_penalty(logp, ref, kind)
    want = []
    for a, b in zip(logp.tolist(), ref.tolist()):
        lr = a - b
        value = {"k1": lr, "k2": lr * lr / 2}.get(kind, math.exp(b - a) - (b - a) - 1)
        want.append(min(value, 10.0) if kind == "low_var_kl" else value)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_tis_weights_are_clipped_and_detached():
    old = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-3.0, -1.0, -0.2])
    w = losses.tis_weights(old, rollout, 0.5, 2.0)
    assert w.tolist() == pytest.approx([2.0, 1.0, 0.5]) and not w.requires_grad
