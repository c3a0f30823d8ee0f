"""Per-request logits controls against per-row Python references, on random logits.

Each test builds a batch in which some rows use a control and others do not, runs the
sampler's `process_logits`, and compares every row with a plain loop over that row.
"""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from serve import SamplingParams
from serve.sequence import Sequence
from serve.worker import logits_processors as lp
from serve.worker.sampler import Sampler

VOCAB = 32
EOS = (0, 3)
INF = float("inf")


class FakeTokenizer:
    """Maps a few texts to fixed token ids: `foo` is one token, `bar baz` two."""

    vocab = {"foo": [5], " foo": [6], "bar baz": [7, 8], " bar baz": [9, 8], "qux": [10]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.vocab.get(text, [11])


def make_seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    params.update_from_tokenizer(FakeTokenizer())
    seq = Sequence(0, "r", prompt, params)
    seq.output_token_ids = list(output)
    return seq


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(num_rows, VOCAB) * 3  # positive and negative logits


def random_tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def reference_row(row: torch.Tensor, seq: Sequence, eos: tuple[int, ...]) -> torch.Tensor:
    """One row processed token by token, in vLLM's order."""
    row = row.clone()
    p, out = seq.sampling_params, seq.output_token_ids
    if p.allowed_token_ids:
        for t in range(VOCAB):
            if t not in p.allowed_token_ids:
                row[t] = -INF
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            row[word[-1]] = -INF
    if len(out) < p.min_tokens:
        for t in (*eos, *p.stop_token_ids):
            row[t] = -INF
    for t, bias in (p.logit_bias or {}).items():
        row[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(seq.prompt_token_ids) | set(out):
            r = p.repetition_penalty
            row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


def check_against_reference(seqs: list[Sequence], seed: int) -> torch.Tensor:
    logits = random_logits(len(seqs), seed)
    raw = logits.clone()
    processed = Sampler(0, EOS).process_logits(logits, seqs)
    assert torch.equal(logits, raw), "the model's logits must be left unchanged"
    expected = torch.stack([reference_row(raw[i], s, EOS) for i, s in enumerate(seqs)])
    torch.testing.assert_close(processed, expected)
    return processed


def mixed_batch(controlled: SamplingParams, seed: int) -> list[Sequence]:
    """Six rows; rows 1 and 4 use `controlled`, the others plain sampling or greedy."""
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)]
    params = [plain[0], controlled, plain[1], plain[0], controlled, plain[1]]
    return [
        make_seq(p, random_tokens(7, seed + 10 * i), random_tokens(5 + i, seed + 10 * i + 1))
        for i, p in enumerate(params)
    ]


def test_no_controls_is_the_models_logits():
    seqs = mixed_batch(SamplingParams(temperature=0.5, top_k=4), seed=0)
    logits = random_logits(len(seqs), 0)
    assert Sampler(0, EOS).process_logits(logits, seqs) is logits


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "controlled",
    [
        SamplingParams(logit_bias={4: 5.5, 17: -100.0, 31: 0.25}),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=-0.7),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.6, temperature=0.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.1, repetition_penalty=1.2),
        SamplingParams(allowed_token_ids=[2, 9, 30]),
    ],
    ids=["bias", "presence", "frequency", "repetition", "repetition<1", "penalties", "allowed"],
)
def test_control_matches_reference(controlled, seed):
    seqs = mixed_batch(controlled, seed)
    processed = check_against_reference(seqs, seed)
    untouched = random_logits(len(seqs), seed)[[0, 2, 3, 5]]
    assert torch.equal(processed[[0, 2, 3, 5]], untouched)


def test_every_control_at_once_matches_reference():
    everything = SamplingParams(
        temperature=0.7,
        logit_bias={1: 3.0, 8: -2.0},
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.4,
        allowed_token_ids=list(range(0, VOCAB, 2)),
        bad_words=["foo", "bar baz"],
        min_tokens=50,
        max_tokens=60,
        stop_token_ids=[12],
    )
    check_against_reference(mixed_batch(everything, seed=5), seed=5)


def test_repetition_penalty_equals_hf():
    seqs = mixed_batch(SamplingParams(repetition_penalty=1.3), seed=3)
    logits = random_logits(len(seqs), 3)
    processed = Sampler(0, EOS).process_logits(logits, seqs)
    hf = RepetitionPenaltyLogitsProcessor(1.3)
    for i in (1, 4):
        input_ids = torch.tensor([seqs[i].all_token_ids])
        expected = hf(input_ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(processed[i], expected, rtol=0, atol=0)


def test_bad_words_single_and_multi_token():
    params = SamplingParams(bad_words=["foo", "bar baz"])
    outputs = [[1, 2], [1, 7], [1, 9], [], [7, 2]]
    seqs = [make_seq(params, [7, 9], out) for out in outputs]
    assert params.bad_words_token_ids == [[5], [6], [7, 8], [9, 8]]
    processed = check_against_reference(seqs, seed=4)
    banned = [set(torch.nonzero(row == -INF).flatten().tolist()) for row in processed]
    # Single-token forms always; the last token of `bar baz` only right after its first,
    # in the output (the prompt ends with 9, but the output is empty or does not).
    assert banned == [{5, 6}, {5, 6, 8}, {5, 6, 8}, {5, 6}, {5, 6}]


def test_allowed_token_ids_leave_only_those():
    seqs = mixed_batch(SamplingParams(allowed_token_ids=[3, 4, 20]), seed=6)
    processed = check_against_reference(seqs, seed=6)
    for i in (1, 4):
        assert torch.isfinite(processed[i]).nonzero().flatten().tolist() == [3, 4, 20]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=[12, 13])
    seqs = [make_seq(params, [1, 2], random_tokens(n, n)) for n in range(5)]
    processed = check_against_reference(seqs, seed=7)
    masked = {0, 3, 12, 13}
    for n, row in enumerate(processed):
        banned = set(torch.nonzero(row == -INF).flatten().tolist())
        assert banned == (masked if n < 3 else set()), n


def test_logits_mask_sees_processed_logits_and_steers_greedy_and_sampled_rows():
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias={9: 100.0}), [1], [2]),
        make_seq(SamplingParams(temperature=1.0, seed=3), [1], [2]),
    ]
    logits = random_logits(2, 8)
    seen = []

    def mask(processed: torch.Tensor) -> None:
        seen.append(processed.clone())
        processed[:, :20] = -INF  # only tokens 20.. allowed

    out = Sampler(0, EOS)(logits, seqs, logits_mask=mask)
    assert len(seen) == 1 and seen[0][0, 9] == logits[0, 9] + 100.0
    assert all(t >= 20 for t in out.token_ids)


def test_greedy_takes_the_processed_argmax_and_reports_raw_logprobs():
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias={9: 100.0}, logprobs=1), [1], []),
        make_seq(SamplingParams(temperature=0.0, logprobs=1), [1], []),
    ]
    logits = random_logits(2, 9)
    out = Sampler(0, EOS)(logits, seqs)
    assert out.token_ids == [9, logits[1].argmax().item()]
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] == pytest.approx(raw[0, 9].item(), abs=1e-5)
    top_raw = raw[0].argmax().item()
    assert out.top_logprobs[0][top_raw] == pytest.approx(raw[0, top_raw].item(), abs=1e-5)


def test_count_tokens_and_coordinates():
    rows, ids = lp.coordinates([2, 0], [[5, 5, 1], [3]], torch.device("cpu"))
    assert rows.tolist() == [2, 2, 2, 0] and ids.tolist() == [5, 5, 1, 3]
    counts = lp.count_tokens(rows, ids, 3, 8)
    expected = torch.zeros(3, 8)
    expected[2, 5], expected[2, 1], expected[0, 3] = 2, 1, 1
    assert torch.equal(counts, expected)


def test_update_from_tokenizer_tokenizes_both_forms_once():
    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    params = SamplingParams(bad_words=["  quick", "serving engine"])
    with pytest.raises(RuntimeError, match="update_from_tokenizer"):
        _ = params.bad_words_token_ids
    params.update_from_tokenizer(tokenizer)
    words = params.bad_words_token_ids
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    expected = [encode(t) for t in ("quick", " quick", "serving engine", " serving engine")]
    assert words == [w for i, w in enumerate(expected) if w not in expected[:i]]
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids is words  # idempotent: not recomputed
    assert SamplingParams().bad_words_token_ids == []
    assert params == SamplingParams(bad_words=["  quick", "serving engine"])
