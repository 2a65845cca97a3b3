"""What a token's kept set under top-p, top-k and min-p must be, checked against a recomputed
distribution: SGLang's rules, up to the near-ties two fp32 forwards on different CPUs can split."""

from __future__ import annotations

import torch

TIE = 1e-5  # two fp32 forwards differ by ~1e-6 in probability: a token this close to a cut may fall either side


def assert_kept(mask: list[int], probs: torch.Tensor, params: dict) -> None:
    """``mask`` is the set SGLang's rules keep from ``probs``, most likely first, up to near-ties.

    Each rule keeps a prefix of the tokens by probability: the ``top_k`` most likely, those with
    mass before them <= ``top_p``, those with probability >= ``min_p`` x the top one. A token whose
    rule is decided within ``TIE`` of its threshold may fall either side on another CPU.
    """
    kept = probs[mask]
    outside = probs.clone()
    outside[mask] = -1.0
    assert len(set(mask)) == len(mask) <= params.get("top_k", len(probs)), mask
    assert bool((kept[:-1] >= kept[1:] - TIE).all()), "most likely first"
    assert float(kept.min()) >= float(outside.max()) - TIE, "a prefix by probability"
    top_p, floor = params.get("top_p", 1.0), params.get("min_p", 0.0) * float(probs.max())
    assert float(kept[:-1].sum()) <= top_p + TIE and float(kept[-1]) >= floor - TIE, "kept past a cut"
    if len(mask) < params.get("top_k", len(probs)):  # then top-p or min-p must have cut the next one
        assert float(kept.sum()) > top_p - TIE or float(outside.max()) < floor + TIE, "cut too early"


def renormalised(mask: list[int], probs: torch.Tensor) -> torch.Tensor:
    return (probs[mask] / probs[mask].sum()).log()
