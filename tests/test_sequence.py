"""Sequence token bookkeeping."""

from __future__ import annotations

import itertools

import pytest

from serve.sampling_params import SamplingParams
from serve.sequence import Sequence


@pytest.mark.parametrize(("num_prompt", "num_output"), [(1, 0), (5, 0), (5, 7), (12, 12)])
def test_token_ids_between_equals_slicing_all_tokens(num_prompt, num_output):
    seq = Sequence(0, "r", list(range(num_prompt)), SamplingParams())
    for i in range(num_output):
        seq.append_token(100 + i, 0.0, None)
    limit = num_prompt + num_output + 3
    for start, end in itertools.product(range(limit), [None, *range(limit)]):
        assert seq.token_ids_between(start, end) == seq.all_token_ids[start:end], (start, end)
    assert [seq.token_at(p) for p in range(seq.num_tokens)] == seq.all_token_ids


def test_a_fork_copies_the_per_token_record():
    """A fork (best_of's samples, a beam) starts with its parent's tokens, logprobs, top
    logprobs and ranks, in lists of its own."""
    parent = Sequence(0, "r", [1, 2], SamplingParams(logprobs=1))
    parent.append_token(7, -0.5, {7: -0.5, 3: -0.25}, 2)
    child = parent.fork(1)
    child.append_token(8, -1.0, {8: -1.0}, 1)
    assert parent.output_ranks == [2] and child.output_ranks == [2, 1]
    assert parent.output_top_logprobs == [{7: -0.5, 3: -0.25}]
    assert child.output_logprobs == [-0.5, -1.0]
