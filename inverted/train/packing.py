"""Samples → packed micro-batches: sequences end to end, no padding, split by a token budget.

A micro-batch is one row of ``T`` tokens holding several sequences; ``cu_seqlens`` marks where
each starts (``thd`` format), positions restart at 0 for each, and attention never crosses a
boundary (``train/attention.py``). Logits at position ``t`` predict token ``t + 1``, so a
sequence's response log-probs come from positions ``[prompt_len - 1, len - 1)``.

``pack`` fills micro-batches greedily up to ``max_tokens`` (a sequence longer than the budget gets
a micro-batch of its own); ``balance`` deals sequences to data-parallel ranks so each gets about
the same number of tokens (longest first, to the lightest rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MicroBatch:
    """Packed sequences: ``tokens_T``, ``positions_T``, ``cu_seqlens`` (``[n + 1]``, int32), and per sequence its index in the batch."""

    tokens_T: torch.Tensor
    positions_T: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: list[int]
    response_lengths: list[int]

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def response_positions(self) -> torch.Tensor:
        """Positions in the packed row whose logits predict a response token, in sequence order."""
        spans = [torch.arange(int(end) - length - 1, int(end) - 1)
                 for end, length in zip(self.cu_seqlens[1:].tolist(), self.response_lengths)]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)

    def response_targets(self) -> torch.Tensor:
        spans = [self.tokens_T[int(end) - length:int(end)] for end, length in zip(self.cu_seqlens[1:].tolist(), self.response_lengths)]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)


def make_micro_batch(sequences: list[list[int]], response_lengths: list[int], indices: list[int]) -> MicroBatch:
    lengths = [len(s) for s in sequences]
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return MicroBatch(
        tokens_T=torch.tensor([t for s in sequences for t in s], dtype=torch.long),
        positions_T=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu, indices=list(indices), response_lengths=list(response_lengths),
    )


def pack(sequences: list[list[int]], response_lengths: list[int], indices: list[int], max_tokens: int) -> list[MicroBatch]:
    """Greedy first-fit in the given order: each micro-batch holds at most ``max_tokens`` tokens."""
    batches: list[MicroBatch] = []
    current: list[int] = []
    used = 0
    for position, seq in enumerate(sequences):
        if current and used + len(seq) > max_tokens:
            batches.append(make_micro_batch([sequences[i] for i in current], [response_lengths[i] for i in current], [indices[i] for i in current]))
            current, used = [], 0
        current.append(position)
        used += len(seq)
    if current:
        batches.append(make_micro_batch([sequences[i] for i in current], [response_lengths[i] for i in current], [indices[i] for i in current]))
    return batches


def balance(lengths: list[int], ranks: int) -> list[list[int]]:
    """Indices dealt to ``ranks`` ranks, longest first to the lightest, each rank's list sorted."""
    loads = [0] * ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        dealt[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(d) for d in dealt]
