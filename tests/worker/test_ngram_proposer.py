"""`NgramProposer` (prompt lookup): which earlier occurrence of the sequence's last n-gram
proposes the next tokens, and `parse_speculative_config`'s refusals."""

from __future__ import annotations

import pytest
import torch

from serve.config import (
    InvalidSettingError,
    ModelConfig,
    SpeculativeMethod,
    parse_speculative_config,
)
from serve.worker.speculative import NgramProposer, make_proposer


def test_the_longest_matching_ngram_wins():
    # [2, 3] last occurred before 8, but the longer [1, 2, 3] occurred before 9.
    tokens = [1, 2, 3, 9, 9, 2, 3, 8, 4, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 2) == [9, 9]
    assert NgramProposer(1, 2).propose(tokens, 2) == [8, 4]  # the 3-gram out of reach


def test_the_latest_occurrence_with_k_tokens_after_it():
    tokens = [5, 6, 7, 5, 8, 9, 5]
    assert NgramProposer(1, 1).propose(tokens, 2) == [8, 9]
    # Only the first occurrence has 4 tokens after it.
    assert NgramProposer(1, 1).propose(tokens, 4) == [6, 7, 5, 8]


def test_the_earliest_occurrence_when_none_has_k_tokens_after_it():
    tokens = [5, 6, 5, 7, 5]
    assert NgramProposer(1, 1).propose(tokens, 5) == [6, 5, 7, 5]  # the longest run there


def test_no_proposal_without_a_match():
    assert NgramProposer(1, 3).propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(1, 3).propose([4], 3) == []
    assert NgramProposer(1, 3).propose([4, 4], 0) == []


def test_min_n_bounds_the_match():
    tokens = [7, 1, 2, 7]  # only the 1-gram [7] occurred before
    assert NgramProposer(1, 3).propose(tokens, 2) == [1, 2]
    assert NgramProposer(2, 3).propose(tokens, 2) == []


def test_make_proposer_takes_the_lookup_bounds():
    method = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    engine = (ModelConfig(), None, 16, torch.device("cpu"))  # what only a draft model reads
    proposer = make_proposer(method, *engine)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n) == (2, 4)
    assert make_proposer(None, *engine) is None


def test_parse_fills_one_bound_from_the_other():
    one = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}
    )
    assert one == SpeculativeMethod("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=1)
    other = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6}
    )
    assert (other.prompt_lookup_min, other.prompt_lookup_max) == (6, 6)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not json", "speculative_config is not valid JSON"),
        ("[1, 2]", "speculative_config must be a JSON object"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}',
            "unknown keys ['lookahead']",
        ),
        ('{"num_speculative_tokens": 2}', 'needs "method": one of ngram, draft_model; got None'),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "got 'medusa'"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            "num_speculative_tokens to be a positive",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min 4 above prompt_lookup_max 2",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            "disable_by_batch_size",
        ),
    ],
)
def test_parse_refuses_with_what_is_wrong(value, message):
    with pytest.raises(InvalidSettingError, match="speculative_config") as info:
        parse_speculative_config(value)
    assert message in str(info.value)
