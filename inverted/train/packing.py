"""Samples → packed micro-batches: sequences end to end, no padding, split by a token budget.

A micro-batch is one row of ``T`` tokens holding several **segments**. A segment is a prompt and
the responses that continue it: ``[prompt, response 1, ..., response k]``, each response placed at
the positions it had after the prompt. With prefix sharing, the samples of a GRPO group (one
prompt, n responses) become one segment, so the prompt is run once instead of n times: with a
40-token prompt, 16 samples of 4 tokens are 104 tokens instead of 704. Without it (Transformer
Engine's attention takes plain sequences) every sample is a segment with one response. The
attention (``train/attention.py``) lets the prompt attend causally to itself and each response to
the prompt and causally to itself, never to a sibling, so every logit is the one the unshared
sequence would give. ``cu_seqlens`` marks where each segment starts (``thd`` format).

Logits at position ``t`` predict token ``t + 1``: a response's first token is predicted from the
prompt's last position (shared by its siblings), the rest from its own positions.

``pack`` fills micro-batches greedily up to ``max_tokens`` (a segment longer than the budget gets
a micro-batch of its own). Under sequence parallelism a row must split evenly between the
tensor-parallel ranks: ``multiple_of`` then ends each row with a segment of padding (token 0, no
responses), which no real token attends to and no loss reads. ``balance`` deals sequences to
data-parallel ranks so each gets about the same number of tokens (longest first, to the lightest
rank).

A micro-batch also carries its responses' **kept sets** (``KeptSets``), where the Samples recorded
them: the set each token was sampled from under top-p or top-k, which the log-prob head replays.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """A prompt shared by ``len(response_lengths)`` responses, laid out after it in the row."""

    prompt_length: int
    response_lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prompt_length + sum(self.response_lengths)


@dataclass(slots=True)
class KeptSets:
    """Each response row's kept set, ragged (a Sample's ``rollout_top_p_token_ids``/``offsets``, the
    micro-batch's responses end to end): row r's ids are ``ids[offsets[r]:offsets[r + 1]]``, an empty
    range the whole vocabulary."""

    offsets: torch.Tensor  # int64 [R + 1]
    ids: torch.Tensor  # int64 [M]

    @classmethod
    def of(cls, samples: list) -> "KeptSets | None":
        """The kept sets of these Samples' responses, in order; None where none recorded any."""
        if all(s.rollout_top_p_token_ids is None for s in samples):
            return None
        offsets, ids, total = [torch.zeros(1, dtype=torch.long)], [], 0
        for sample in samples:
            if sample.rollout_top_p_token_ids is None:
                offsets.append(torch.full((sample.response_length,), total, dtype=torch.long))
                continue
            offsets.append(torch.tensor(sample.rollout_top_p_token_offsets[1:], dtype=torch.long) + total)
            ids.append(torch.tensor(sample.rollout_top_p_token_ids, dtype=torch.long))
            total += len(sample.rollout_top_p_token_ids)
        return cls(torch.cat(offsets), torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long))

    def mask(self, rows: slice, start: int, width: int, device: torch.device | str) -> torch.Tensor | None:
        """``[rows, width]`` bool over the vocabulary slice ``[start, start + width)``: True where a token
        is in its row's kept set (every token of a row without one); None where no row has one."""
        first, last = rows.start, min(rows.stop, len(self.offsets) - 1)
        offsets = self.offsets[first : last + 1]
        lengths = offsets.diff()
        if not bool((lengths > 0).any()):
            return None
        keep = (lengths == 0)[:, None].repeat(1, width)
        ids = self.ids[int(offsets[0]) : int(offsets[-1])] - start
        row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        on = (ids >= 0) & (ids < width)
        keep[row[on], ids[on]] = True
        return keep.to(device)


@dataclass(slots=True)
class MicroBatch:
    """Packed segments: ``tokens_T``, ``positions_T``, ``cu_seqlens`` (segment starts, ``[n + 1]``, int32),
    the ``segments``, per response its sample's index in the batch and its length, and the ``padding``
    tokens that end the row (the last segment's, when there are any)."""

    tokens_T: torch.Tensor
    positions_T: torch.Tensor
    cu_seqlens: torch.Tensor
    segments: list[Segment]
    indices: list[int]
    response_lengths: list[int]
    padding: int = 0
    kept: KeptSets | None = None  # the responses' kept sets (sampling masks), where recorded
    targets: torch.Tensor | None = None  # each response position's target, where not the next token (Tinker's datums)
    positions: torch.Tensor | None = None  # each target's row position, where not the response's (Tinker's datums)

    @property
    def max_seqlen(self) -> int:
        return max(s.length for s in self.segments)

    def _responses(self) -> list[tuple[int, int, int, int]]:
        """(start of its prompt, end of its prompt, start, length) of every response in the row, in order."""
        found = []
        for offset, segment in zip(self.cu_seqlens.tolist(), self.segments):
            prompt_end = start = offset + segment.prompt_length
            for length in segment.response_lengths:
                found.append((offset, prompt_end, start, length))
                start += length
        return found

    def response_positions(self) -> torch.Tensor:
        """Positions in the packed row whose logits predict a response token, in response order."""
        if self.positions is not None:
            return self.positions
        spans = [
            torch.cat([torch.tensor([prompt_end - 1]), torch.arange(start, start + length - 1)])
            for _, prompt_end, start, length in self._responses()
        ]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)

    def sequence_positions(self) -> list[torch.Tensor]:
        """Per response, in order: the row positions of its whole sequence (shared prompt, then its own tokens)."""
        return [
            torch.cat([torch.arange(prompt_start, prompt_end), torch.arange(start, start + length)])
            for prompt_start, prompt_end, start, length in self._responses()
        ]

    def response_targets(self) -> torch.Tensor:
        if self.targets is not None:
            return self.targets
        spans = [self.tokens_T[start : start + length] for _, _, start, length in self._responses()]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)


def segments_of(
    sequences: list[list[int]],
    response_lengths: list[int],
    share_prefixes: bool,
    prompt_keys: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Consecutive sequences grouped by equal prompt (with ``share_prefixes``), as lists of positions.

    ``prompt_keys``: what else two prompts must agree on to be run once (routing replay: the experts each
    prompt token went to, which differ when one sample was re-prefilled on new weights).
    """
    groups: list[list[int]] = []
    for i, (tokens, length) in enumerate(zip(sequences, response_lengths)):
        if share_prefixes and groups:
            first = groups[-1][0]
            prompt = len(tokens) - length
            if (
                prompt == len(sequences[first]) - response_lengths[first]
                and tokens[:prompt] == sequences[first][:prompt]
                and (prompt_keys is None or prompt_keys[i] == prompt_keys[first])
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def make_micro_batch(
    sequences: list[list[int]],
    response_lengths: list[int],
    indices: list[int],
    groups: list[list[int]],
    multiple_of: int = 1,
) -> MicroBatch:
    """The micro-batch of ``groups`` (positions into ``sequences``, each a segment), padded to a multiple."""
    tokens, positions, segments = [], [], []
    for group in groups:
        first = sequences[group[0]]
        prompt_length = len(first) - response_lengths[group[0]]
        tokens += first[:prompt_length]
        positions.append(torch.arange(prompt_length))
        for i in group:
            tokens += sequences[i][prompt_length:]
            positions.append(torch.arange(prompt_length, len(sequences[i])))
        segments.append(Segment(prompt_length, tuple(response_lengths[i] for i in group)))
    padding = -len(tokens) % multiple_of
    if padding:
        tokens += [0] * padding
        positions.append(torch.arange(padding))
        segments.append(Segment(padding, ()))
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([s.length for s in segments], dtype=torch.int32).cumsum(0)
    order = [i for group in groups for i in group]
    return MicroBatch(
        tokens_T=torch.tensor(tokens, dtype=torch.long),
        positions_T=torch.cat(positions),
        cu_seqlens=cu,
        segments=segments,
        indices=[indices[i] for i in order],
        response_lengths=[response_lengths[i] for i in order],
        padding=padding,
    )


def pack(
    sequences: list[list[int]],
    response_lengths: list[int],
    indices: list[int],
    max_tokens: int,
    share_prefixes: bool = False,
    multiple_of: int = 1,
    prompt_keys: Sequence[Hashable] | None = None,
) -> list[MicroBatch]:
    """Greedy first-fit of segments in the given order: each micro-batch holds at most ``max_tokens`` tokens
    (and padding up to a multiple of ``multiple_of``). ``prompt_keys``: as ``segments_of``'s."""
    batches: list[MicroBatch] = []
    current: list[list[int]] = []
    used = 0
    for group in segments_of(sequences, response_lengths, share_prefixes, prompt_keys):
        prompt = len(sequences[group[0]]) - response_lengths[group[0]]
        size = prompt + sum(response_lengths[i] for i in group)
        if current and used + size > max_tokens:
            batches.append(make_micro_batch(sequences, response_lengths, indices, current, multiple_of))
            current, used = [], 0
        current.append(group)
        used += size
    if current:
        batches.append(make_micro_batch(sequences, response_lengths, indices, current, multiple_of))
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
