"""The sampler: min-p, top-k and top-p in vLLM's order; its logprobs, computed only for
the rows whose request needs them (`SamplingParams.needs_logprobs`), in one logsumexp
over just those rows; the others get None, and the tokens chosen do not depend on who
asked."""

from __future__ import annotations

import pytest
import torch

from serve import SamplingParams
from serve.sequence import Sequence
from serve.worker.sampler import Sampler

VOCAB = 64


def _seq(seq_id: int, **params) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [1, 2, 3], SamplingParams(**params), seed=seq_id)


def _logits(num_rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=gen) * 3


@pytest.fixture
def normalised_rows(monkeypatch) -> list[int]:
    """The rows of every logsumexp / log_softmax the sampler runs (one entry per call)."""
    seen: list[int] = []
    logsumexp, log_softmax = torch.logsumexp, torch.log_softmax

    def counting_logsumexp(x, *args, **kwargs):
        seen.append(x.shape[0])
        return logsumexp(x, *args, **kwargs)

    def counting_log_softmax(x, *args, **kwargs):
        seen.append(x.shape[0])
        return log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "logsumexp", counting_logsumexp)
    monkeypatch.setattr(torch, "log_softmax", counting_log_softmax)
    return seen


# Rows 1 (logprobs=2), 3 (logprobs=0) and 4 (best_of > n, ranked by its logprobs) need
# their token's logprob; rows 0 and 2 (greedy and sampled, nothing asked) do not.
MIXED = [
    {"temperature": 0.0},
    {"temperature": 0.0, "logprobs": 2},
    {"temperature": 1.0},
    {"temperature": 1.0, "logprobs": 0},
    {"temperature": 1.0, "n": 1, "best_of": 2},
]
NEEDING = [1, 3, 4]


def test_only_the_rows_that_need_a_logprob_are_normalised(normalised_rows):
    logits = _logits(len(MIXED), seed=1)
    seqs = [_seq(i, **p) for i, p in enumerate(MIXED)]
    out = Sampler(0)(logits, seqs)
    assert normalised_rows == [len(NEEDING)]  # one logsumexp, over the needing rows only
    expected = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        if i in NEEDING:
            assert out.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-5)
        else:
            assert out.logprobs[i] is None
    assert [t is None for t in out.top_logprobs] == [True, False, True, False, True]
    top2 = logits[1].topk(2).indices.tolist()
    assert set(out.top_logprobs[1]) == {*top2, out.token_ids[1]}
    for token_id, logprob in out.top_logprobs[1].items():
        assert logprob == pytest.approx(expected[1, token_id].item(), abs=1e-5)
    assert out.top_logprobs[3] == {out.token_ids[3]: out.logprobs[3]}  # logprobs=0


def test_a_batch_where_nobody_needs_logprobs_normalises_nothing(normalised_rows):
    seqs = [_seq(0, temperature=0.0), _seq(1, temperature=1.0), _seq(2, temperature=0.5, n=2)]
    out = Sampler(0)(_logits(3, seed=2), seqs)
    assert normalised_rows == []
    assert out.logprobs == [None, None, None] and out.top_logprobs == [None, None, None]


def test_a_poisoned_row_that_needs_nothing_leaves_the_others_exact():
    """Row 0 needs no logprob and holds an inf and a NaN: it is never normalised (it
    gets None, not a NaN), and the rows that need one get their exact values."""
    logits = _logits(3, seed=3)
    logits[0, 5], logits[0, 6] = float("inf"), float("nan")
    seqs = [_seq(0, temperature=0.0), _seq(1, temperature=0.0, logprobs=1), _seq(2, best_of=3)]
    out = Sampler(0).report(logits, [5, 7, 9], seqs)
    expected = torch.log_softmax(logits[1:], dim=-1)
    assert out.logprobs[0] is None
    assert out.logprobs[1] == pytest.approx(expected[0, 7].item(), abs=1e-5)
    assert out.logprobs[2] == pytest.approx(expected[1, 9].item(), abs=1e-5)


def test_ranks_only_for_the_rows_that_ask_for_logprobs():
    """Rows 1 and 3 asked for logprobs: each token's rank is vLLM's, the tokens at least
    as likely, itself included. Row 4 needs a logprob (best_of) but asked for none, and
    rows 0 and 2 need nothing: no rank."""
    logits = _logits(len(MIXED), seed=5)
    out = Sampler(0)(logits, [_seq(i, **p) for i, p in enumerate(MIXED)])
    logprobs = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        if i in (1, 3):
            assert out.ranks[i] == int((logprobs[i] >= logprobs[i, token]).sum())
        else:
            assert out.ranks[i] is None
    assert out.ranks[1] == 1  # greedy


def test_a_rank_counts_ties_and_every_more_likely_token():
    """vLLM counts the tokens whose logprob is >= the chosen one's: tied tokens all take
    the worst of their places, a token outside the top ones its place in the vocabulary."""
    logits = torch.zeros(4, VOCAB)
    logits[:, :3] = torch.tensor([5.0, 5.0, 4.0])
    seqs = [_seq(i, temperature=1.0, logprobs=1) for i in range(4)]
    out = Sampler(0).report(logits, [0, 1, 2, 9], seqs)
    assert out.ranks == [2, 2, 3, VOCAB]


def test_tokens_do_not_depend_on_who_asks_for_logprobs():
    """The same seeded batch sampled with and without logprobs asked for: the same tokens."""
    logits = _logits(len(MIXED), seed=4)
    without = [{k: v for k, v in p.items() if k != "logprobs"} for p in MIXED]
    every = [{**p, "logprobs": 1} for p in MIXED]
    tokens = [
        Sampler(0)(logits, [_seq(i, **p) for i, p in enumerate(batch)]).token_ids
        for batch in (MIXED, without, every)
    ]
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[0][0] == logits[0].argmax().item()


def test_min_p_goes_before_top_p_as_in_vllm():
    """Two likely tokens and a long tail: min-p drops the tail first, so top-p's nucleus
    (0.5 of what is left) is the first token alone; the other way round, top-p took the
    first two from the full distribution and min-p kept them both."""
    probs = torch.tensor([0.30, 0.25] + [0.01] * 45)
    logits = probs.log()[None, :]
    seq = _seq(0, temperature=1.0, top_p=0.5, min_p=0.05)
    got = Sampler(seed=0).probabilities(logits, [seq])[0]
    assert got[0] == pytest.approx(1.0) and got[1:].sum() == 0
    # Alone, each keeps what it always did.
    top_p_only = Sampler(seed=0).probabilities(logits, [_seq(1, temperature=1.0, top_p=0.5)])
    assert (top_p_only[0] > 0).nonzero().flatten().tolist() == [0, 1]
    min_p_only = Sampler(seed=0).probabilities(logits, [_seq(2, temperature=1.0, min_p=0.05)])
    assert (min_p_only[0] > 0).nonzero().flatten().tolist() == [0, 1]


def _nucleus(probs: torch.Tensor, top_p: float) -> list[int]:
    """The reference: the fewest most likely tokens whose probability reaches top_p."""
    order = probs.double().sort(descending=True)
    count = int((order.values.cumsum(0) < top_p).sum()) + 1
    return sorted(order.indices[:count].tolist())


def test_top_p_keeps_each_row_s_nucleus():
    """A peaked row, a flat one, a row with top-k 3 and one with top_p 1 (which keeps every
    token) in one batch: each keeps exactly the float64 reference's nucleus, renormalised."""
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(VOCAB, generator=gen) * 4
    flat = torch.randn(VOCAB, generator=gen) * 0.3
    logits = torch.stack([peaked, flat, peaked, flat])
    params = [
        {"top_p": 0.9},
        {"top_p": 0.9},
        {"top_p": 0.95, "top_k": 3},
        {"top_p": 1.0},
    ]
    seqs = [_seq(i, temperature=1.0, **p) for i, p in enumerate(params)]
    got = Sampler(seed=0).probabilities(logits, seqs)

    full = logits.softmax(dim=-1)
    three = peaked.topk(3).indices
    top_three = torch.zeros(VOCAB).index_copy_(0, three, peaked.softmax(dim=0)[three])
    expected = [
        _nucleus(full[0], 0.9),
        _nucleus(full[1], 0.9),
        _nucleus(top_three / top_three.sum(), 0.95),
        list(range(VOCAB)),
    ]
    assert len(expected[0]) < 8 < len(expected[1])  # a narrow nucleus and a wide one
    for row, tokens in enumerate(expected):
        assert (got[row] > 0).nonzero().flatten().tolist() == tokens
        kept = full[row, tokens] / full[row, tokens].sum()
        torch.testing.assert_close(got[row, tokens], kept)


def test_top_p_keeps_tokens_tied_at_its_edge_together():
    """Two tokens equally likely at the nucleus' edge are both kept or both left out,
    whichever one a sort would put first."""
    probs = torch.tensor([0.5, 0.2, 0.2] + [0.1 / 61] * 61)
    seq = _seq(0, temperature=1.0, top_p=0.6)
    got = Sampler(seed=0).probabilities(probs.log()[None, :], [seq])[0]
    assert (got > 0).nonzero().flatten().tolist() == [0, 1, 2]
    assert got[1] == got[2]


def test_a_row_whose_allowed_tokens_are_all_banned_raises_rather_than_escape_them():
    """Bad words ban a token once the tokens before it are written (a longer word's last
    token): where that leaves none of allowed_token_ids, sampling raises (the request
    fails alone) instead of yielding a token outside them."""
    seq = _seq(0, temperature=0.0, allowed_token_ids=[7], bad_words=["x"])
    seq.sampling_params._bad_words_token_ids = [[7, 7]]  # a word that is token 7 twice
    sampler = Sampler()
    assert sampler(_logits(1, 0), [seq]).token_ids == [7]  # allowed: nothing written yet
    seq.append_token(7, None, None)
    with pytest.raises(ValueError, match="allowed_token_ids is banned"):
        sampler(_logits(1, 1), [seq])
