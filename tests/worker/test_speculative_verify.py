"""`verify` (worker/speculative.py) is lossless: the tokens it emits are distributed exactly
as plain sampling draws them, one at a time.

With a deterministic proposer (q a point mass on each proposal d_j) the exact law of one
checked step is known: it emits d_0..d_{a-1} and then a token t != d_a with probability
p_0(d_0)...p_{a-1}(d_{a-1}) p_a(t), or all m proposals and then t ~ p_m. So the first
token emitted is distributed as p_0, and after d_0 the next one as p_1 (p_1 computed with
d_0 counted as output). Each test runs thousands of copies of one checked sequence
through `verify` in a batch, each with its own random numbers, and compares the counts
with these laws by a chi-square test; the p_j come from plain sampling (`Sampler` on one
row, with the proposals before it appended to the sequence's output by hand). The same
statistic rejects two wrong rules (accepting every proposal; drawing the replacement from
p without taking the proposal out), so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from serve import SamplingParams
from serve.worker.sampler import Sampler
from serve.worker.sequence_mirror import MirroredSequence
from serve.worker.speculative import verify

VOCAB = 8
NUM_PROPOSALS = 3
NUM_SAMPLES = 4000
PROMPT = [1, 2, 3]
# A correct rule passes at this p-value (fails 1 run in 1000 by chance; the seeds are
# fixed, so the outcome is deterministic); a wrong one must fall below WRONG.
ALPHA, WRONG = 1e-3, 1e-8

VARIANTS = {
    "temperature": SamplingParams(temperature=0.7, max_tokens=16),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8, max_tokens=16),
    "penalties": SamplingParams(
        temperature=0.9, presence_penalty=0.8, frequency_penalty=0.4, max_tokens=16
    ),
}


def _seq(i: int, params: SamplingParams, output: list[int] = ()) -> MirroredSequence:
    return MirroredSequence(i, f"r{i}", PROMPT, params, None, list(output))


def _logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_PROPOSALS + 1, VOCAB, generator=gen) * 1.5


def _plain(logits: torch.Tensor, params: SamplingParams) -> tuple[list[int], torch.Tensor]:
    """The proposals (each row's most likely token, given the ones before) and each row's
    plain-sampling distribution p_j, with the proposals before row j as output."""
    sampler, drafts, rows = Sampler(), [], []
    for j in range(NUM_PROPOSALS + 1):
        seq = _seq(0, params, drafts)
        processed = sampler.process_logits(logits[j : j + 1], [seq])
        p = sampler.probabilities(processed, [seq])[0]
        rows.append(p / p.sum())
        if j < NUM_PROPOSALS:
            drafts.append(int(p.argmax()))
    return drafts, torch.stack(rows).double()


def _exact_outcomes(drafts: list[int], p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every token sequence one checked step can emit, with its probability."""
    law, prefix = {}, 1.0
    for a in range(NUM_PROPOSALS + 1):
        for t in range(VOCAB):
            if a < NUM_PROPOSALS and t == drafts[a]:
                continue
            law[(*drafts[:a], t)] = prefix * float(p[a, t])
        if a < NUM_PROPOSALS:
            prefix *= float(p[a, drafts[a]])
    return law


def _speculative(sampler: Sampler, logits, params, drafts) -> list[tuple[int, ...]]:
    seqs = [_seq(i, params) for i in range(NUM_SAMPLES)]
    results = verify(sampler, logits.repeat(NUM_SAMPLES, 1), seqs, [drafts] * NUM_SAMPLES)
    emitted = []
    for result in results:
        tokens = tuple(result.sampled.token_ids)
        assert len(tokens) == result.num_accepted + 1
        emitted.append(tokens)
    return emitted


def _chi_square_p_value(counts: dict, law: dict) -> float:
    """P-value of observed `counts` under the probabilities `law` (outcomes with an
    expected count under 5 pooled into one bin); 0 when an impossible outcome occurs."""
    if any(law.get(outcome, 0.0) == 0.0 for outcome in counts):
        return 0.0
    total = sum(counts.values())
    bins, pooled_observed, pooled_expected = [], 0, 0.0
    for outcome, prob in law.items():
        expected, observed = prob * total, counts.get(outcome, 0)
        if expected >= 5:
            bins.append((observed, expected))
        else:
            pooled_observed, pooled_expected = (
                pooled_observed + observed,
                pooled_expected + expected,
            )
    if pooled_expected > 0:
        bins.append((pooled_observed, pooled_expected))
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def _p_values(emitted, drafts, p) -> dict[str, float]:
    """The step's whole output, its first token (~ p_0), and its second token after the
    first proposal was taken (~ p_1)."""
    whole = _chi_square_p_value(_count(emitted), _exact_outcomes(drafts, p))
    first = _chi_square_p_value(_count(t[0] for t in emitted), _law(p[0]))
    after_d0 = [t[1] for t in emitted if t[0] == drafts[0] and len(t) > 1]
    second = _chi_square_p_value(_count(after_d0), _law(p[1]))
    return {"whole step": whole, "first token": first, "token after d0": second}


def _count(outcomes) -> dict:
    counts: dict = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _law(row: torch.Tensor) -> dict[int, float]:
    return {t: float(row[t]) for t in range(VOCAB)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculative_tokens_follow_plain_sampling(variant):
    params = VARIANTS[variant]
    logits = _logits(seed=list(VARIANTS).index(variant))
    drafts, p = _plain(logits, params)
    emitted = _speculative(Sampler(seed=7), logits, params, drafts)
    p_values = _p_values(emitted, drafts, p)
    assert all(value > ALPHA for value in p_values.values()), p_values
    # Every depth was reached, so the whole-step test saw each checked position.
    assert max(len(t) for t in emitted) == NUM_PROPOSALS + 1
    assert sum(t[0] == drafts[0] for t in emitted) > 0.2 * NUM_SAMPLES


class _AcceptsEverything(Sampler):
    """Wrong rule: every proposal accepted (each acceptance number 0; `verify` draws its
    acceptance numbers first and the final draw's second)."""

    _calls = 0

    def uniform(self, seqs, device):
        u = super().uniform(seqs, device)
        self._calls += 1
        return torch.zeros_like(u) if self._calls % 2 == 1 else u


class _ResidualKeepsProposal(Sampler):
    """Wrong rule: after a rejection, the token drawn from p itself (the rejected proposal
    not taken out)."""

    def probabilities(self, logits, seqs):
        probs = super().probabilities(logits, seqs)
        self._rows = (probs / probs.sum(dim=-1, keepdim=True)).unique(dim=0)
        return probs

    def draw(self, probs, uniform):
        # Each row is one of the checked rows' p, with at most the proposal set to 0.
        differ = (probs[:, None, :] != self._rows[None, :, :]).sum(dim=-1)  # [rows, distinct]
        restored = self._rows[(differ <= 1).int().argmax(dim=1)]
        return Sampler.draw(restored, uniform)


@pytest.mark.parametrize("wrong", [_AcceptsEverything, _ResidualKeepsProposal])
@pytest.mark.parametrize("variant", ["temperature", "penalties"])
def test_the_statistic_rejects_a_wrong_rule(variant, wrong):
    params = VARIANTS[variant]
    logits = _logits(seed=list(VARIANTS).index(variant))
    drafts, p = _plain(logits, params)
    p_values = _p_values(_speculative(wrong(seed=7), logits, params, drafts), drafts, p)
    assert p_values["whole step"] < WRONG and p_values["first token"] < WRONG, p_values


def test_greedy_accepts_exactly_the_argmax_and_reports_model_logprobs():
    logits = _logits(seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    argmax = logits.argmax(dim=-1).tolist()
    wrong = (argmax[2] + 1) % VOCAB
    cases = {
        "all accepted": (argmax[:3], 3),
        "third rejected": ([argmax[0], argmax[1], wrong], 2),
        "first rejected": ([(argmax[0] + 1) % VOCAB, argmax[1], argmax[2]], 0),
    }
    seqs = [_seq(i, params) for i in range(len(cases))]
    drafts = [d for d, _ in cases.values()]
    results = verify(Sampler(), logits.repeat(len(cases), 1), seqs, drafts)
    log_probs = torch.log_softmax(logits, dim=-1)
    for (name, (d, accepted)), result in zip(cases.items(), results):
        assert result.num_accepted == accepted, name
        assert result.sampled.token_ids == d[:accepted] + [argmax[accepted]], name
        for j, token in enumerate(result.sampled.token_ids):
            assert result.sampled.logprobs[j] == pytest.approx(float(log_probs[j, token]), abs=1e-5)
            top = set(logits[j].topk(2).indices.tolist()) | {token}
            assert set(result.sampled.top_logprobs[j]) == top, name


def test_the_statistic_rejects_penalties_that_miss_the_proposals(monkeypatch):
    """Wrong rule: each checked row penalised as if the proposals before it were not
    output; the token after d_0 is then drawn from the wrong p_1."""
    import serve.worker.speculative as speculative

    monkeypatch.setattr(speculative, "at_position", lambda seq, drafts, j: seq)
    params = VARIANTS["penalties"]
    logits = _logits(seed=list(VARIANTS).index("penalties"))
    drafts, p = _plain(logits, params)
    p_values = _p_values(_speculative(Sampler(seed=7), logits, params, drafts), drafts, p)
    assert p_values["token after d0"] < WRONG, p_values
