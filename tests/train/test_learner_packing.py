"""How the Tinker learner lays datums out (``learner.shared_prefixes`` and ``packing.pack``): a group's
datums run their common observation once. The logits this gives are checked against ``transformers``
and against unshared calls in ``tests/tinker/test_service.py``."""

from __future__ import annotations

from inverted.train.learner import shared_prefixes
from inverted.train.packing import pack


def test_a_run_of_datums_that_begin_alike_shares_its_longest_common_beginning():
    observation = [3, 14, 15, 92, 65]
    inputs = [observation + [79, 32], observation + [79], observation + [28, 84], [7, 8, 9], [7, 8], [5], [5, 6]]
    # the first three share the observation (the third holds only it, not the first two's 79: giving up one
    # token of two datums costs less than running the observation again); [7, 8] begins the next run; a run
    # needs two tokens in common, so [5] and [5, 6] keep one-token prompts
    assert shared_prefixes(inputs) == [5, 5, 5, 2, 2, 1, 1]
    # a group after a group: sharing only a common 3-token head would cost four datums 2 tokens each
    other = [3, 14, 15, 7, 7]
    assert shared_prefixes([observation + [a] for a in (1, 2, 3, 4)] + [other + [1], other + [2]]) == [5] * 6
    # but giving up one token of ten to take a datum in is cheaper than running nine again
    long = list(range(20, 30))
    assert shared_prefixes([long + [1], long + [2], long[:9] + [5, 5]]) == [9, 9, 9]
    assert shared_prefixes([observation + [79, 32], observation + [79]]) == [6, 6]  # a datum may be all prompt
    assert shared_prefixes([[1, 2], [3, 4]]) == [1, 1]


def test_a_shared_run_is_one_segment_whose_prompt_runs_once():
    observation = [3, 14, 15, 92, 65]
    inputs = [observation + [79, 32], observation + [79], observation + [28, 84]]
    prompts = shared_prefixes(inputs)
    sequences = [[*tokens, 0] for tokens in inputs]
    [mb] = pack(sequences, [len(t) + 1 - p for t, p in zip(inputs, prompts)], [0, 1, 2], 4096, share_prefixes=True)
    assert len(mb.segments) == 1 and mb.segments[0].prompt_length == 5
    assert len(mb.tokens_T) == 5 + 3 + 2 + 3  # unshared: 8 + 7 + 8
    # each datum's positions are its whole sequence's: the shared observation's, then its own
    positions = [p[:-1].tolist() for p in mb.sequence_positions()]
    assert positions == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 8], [0, 1, 2, 3, 4, 10, 11]]
    assert [mb.tokens_T[p].tolist() for p in positions] == inputs
