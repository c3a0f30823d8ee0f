"""Prompt logprobs from a step's logits (serve/worker/logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from serve.worker import logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_taken_a_few_at_a_time_give_each_rows_own_logprobs_and_rank(monkeypatch, dtype):
    """A prompt chunk's rows are converted to float32 a few hundred at a time (all of them
    at once outgrew a GPU's profiled memory); across those boundaries each row keeps its
    own target, top-k and rank, as one pass over every row gives them."""
    monkeypatch.setattr(logprobs, "ROWS_AT_A_TIME", 3)
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(10, 50, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 50, (10,), generator=gen).tolist()
    entries, ranks = logprobs.token_logprobs(logits, targets, num_top=4)

    expected = torch.log_softmax(logits.float(), dim=-1)
    assert len(entries) == len(ranks) == 10
    for row, (entry, rank, target) in enumerate(zip(entries, ranks, targets)):
        top = expected[row].topk(4)
        assert entry == {
            **dict(zip(top.indices.tolist(), top.values.tolist())),
            target: expected[row, target].item(),
        }
        assert rank == int((expected[row] >= expected[row, target]).sum())
