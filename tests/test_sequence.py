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
