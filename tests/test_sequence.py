"""Sequence token bookkeeping."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from serve.sampling_params import SamplingParams
from serve.sequence import Sequence


@given(
    prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12),
    output=st.lists(st.integers(0, 99), max_size=12),
    start=st.integers(0, 30),
    end=st.one_of(st.none(), st.integers(0, 30)),
)
def test_token_ids_between_equals_slicing_all_tokens(prompt, output, start, end):
    seq = Sequence(0, "r", prompt, SamplingParams())
    for token in output:
        seq.append_token(token, 0.0, None)
    assert seq.token_ids_between(start, end) == seq.all_token_ids[start:end]
    assert seq.token_at(len(prompt) - 1) == prompt[-1]
