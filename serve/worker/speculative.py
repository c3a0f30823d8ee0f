"""Speculative decoding on the worker: proposals for a sequence's next tokens, and their
check against the model.

The scheduler leaves room after a decoding sequence's last token (`num_spec_tokens`);
each rank fills it with the same proposals (`NgramProposer` is deterministic over the
sequence's tokens, which every rank's mirror holds; `DraftModelProposer`, draft_model.py,
proposes a draft model's argmax, which rank 0 broadcasts), so the step's forward computes the
last token and the m proposals as one query of 1 + m tokens over the sequence's cache.
Row j of its logits is the model's distribution for the token after proposal j (row 0:
after the last token).

`verify` keeps the proposals as far as the model agrees with them, by rejection sampling
(Leviathan et al. 2023, Chen et al. 2023) with a deterministic proposer: q is a point mass
on the proposal d, so d is accepted with probability min(1, p(d) / q(d)) = p(d); at the
first rejection the token is drawn from the residual max(p - q, 0), renormalised: p with
d taken out; when all m are accepted, one more token is drawn from row m. Every token
taken is then distributed exactly as the model's p given the tokens before it. p is the
distribution plain sampling draws from: the request's controls (penalties, bias, bans,
min_tokens) applied with the accepted proposals counted as output, then temperature,
top-k, top-p and min-p. Greedy rows accept a proposal only when it is the argmax, and
take the argmax where it is not: exactly the tokens of decoding without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from serve import kernels
from serve.config import ModelConfig, SpeculativeMethod
from serve.step import SchedulerOutput
from serve.worker.grammar_start import GrammarStart
from serve.worker.sampler import LogitsMask, Sampler, SamplerOutput
from serve.worker.sequence_mirror import MirroredSequence, SequenceMirror

if TYPE_CHECKING:
    from serve.worker.draft_model import DraftModelProposer


class NgramProposer:
    """Prompt lookup: the longest n-gram (`max_n` down to `min_n` tokens) that ends the
    sequence and occurred earlier in it proposes the tokens that followed it there: the
    latest earlier occurrence followed by k tokens, else the earliest (the longest run)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        if k < 1 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start at i <= length - 1 - n: each has a token after it.
            windows = sliding_window_view(tokens[: length - 1], n)
            starts = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(starts) == 0:
                continue
            whole = starts[starts + n + k <= length]
            start = int(whole[-1] if len(whole) else starts[0]) + n
            return tokens[start : start + k].tolist()
        return []

    def propose_step(self, out: SchedulerOutput, mirror: SequenceMirror) -> dict[int, list[int]]:
        """Proposals for the room the scheduler made after sequences' last tokens (seq id
        -> proposals; none found: left out), from the mirror's tokens alone."""
        drafts = {}
        for s in out.scheduled:
            if s.num_spec_tokens:
                seq = mirror[s.seq_id]
                known = seq.token_ids_between(0, s.start + s.num_new_tokens - s.num_spec_tokens)
                proposed = self.propose(known, s.num_spec_tokens)
                if proposed:
                    drafts[s.seq_id] = proposed
        return drafts


def before_grammar_start(
    drafts: dict[int, list[int]], mirror: SequenceMirror
) -> dict[int, list[int]]:
    """Proposals cut before the first one that completes the token sequence a sequence's
    grammar starts after (the end of a reasoning model's thinking; grammar_start.py), read
    on from the tokens before them: the rows past it would be checked without the
    grammar's mask, which exists only once that token is taken. The token itself may still
    be sampled, after the proposals kept. Every rank cuts alike, from its mirror's tokens
    (a grammar started already is cut alike: a later match only costs proposals)."""
    kept = {}
    for seq_id, proposed in drafts.items():
        seq = mirror[seq_id]
        spec = seq.sampling_params.structured_outputs
        at = None
        if spec is not None and spec.start_after_token_ids:
            sequence, end = spec.start_after_token_ids, seq.num_tokens
            before = seq.token_ids_between(max(0, end - len(sequence) + 1), end)
            at = GrammarStart.after(sequence, before).completed_at(proposed)
        at = len(proposed) if at is None else at
        if at:
            kept[seq_id] = proposed[:at]
    return kept


def make_proposer(
    method: SpeculativeMethod | None,
    model_config: ModelConfig,
    target_hf_config: Any,
    block_size: int,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> NgramProposer | DraftModelProposer | None:
    """The method's proposer; a draft model is loaded here (draft_model.py), its KV cache in
    `kv_cache_dtype` as the target's."""
    if method is None:
        return None
    if method.method == "ngram":
        return NgramProposer(method.prompt_lookup_min, method.prompt_lookup_max)
    if method.method == "draft_model":
        from serve.worker.draft_model import DraftModelProposer

        return DraftModelProposer(
            method, model_config, target_hf_config, block_size, device, kv_cache_dtype
        )
    raise ValueError(f"No proposer for speculative method {method.method!r}.")


@dataclass
class Verified:
    """One sequence's tokens from a checked step: its accepted proposals, then one more
    (drawn where the first was rejected, or after the last), with their logprobs."""

    num_accepted: int
    sampled: SamplerOutput


def at_position(seq: MirroredSequence, drafts: list[int], j: int) -> MirroredSequence:
    """`seq` as the sampler sees it at checked position j: the proposals before j count
    as its output (penalties, min_tokens, bad words see them)."""
    if j == 0:
        return seq
    return MirroredSequence(
        seq.seq_id,
        seq.request_id,
        seq.prompt_token_ids,
        seq.sampling_params,
        seq.seed,
        seq.output_token_ids + drafts[:j],
    )


def verify(
    sampler: Sampler,
    logits: torch.Tensor,  # [sum of 1 + len(drafts[i]), vocab] float32, each sequence's rows
    seqs: list[MirroredSequence],
    drafts: list[list[int]],  # per sequence: its proposals (at least one)
    logits_mask: LogitsMask | None = None,  # a grammar's, per checked position
) -> list[Verified]:
    """Each sequence's accepted proposals and next token, by the rules above."""
    positions = [at_position(seq, d, j) for seq, d in zip(seqs, drafts) for j in range(len(d) + 1)]
    processed = sampler.process_logits(logits, positions, logits_mask)
    argmax = kernels.argmax(processed).tolist()
    offsets = np.cumsum([0] + [len(d) + 1 for d in drafts]).tolist()
    random = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
    taken: dict[int, tuple[int, list[int]]] = {}  # seq index -> (accepted, tokens)
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        if seq.sampling_params.is_greedy:
            rows = argmax[offsets[i] : offsets[i + 1]]
            a = 0
            while a < len(d) and d[a] == rows[a]:
                a += 1
            taken[i] = (a, d[:a] + [rows[a]])
    if random:
        taken.update(_verify_random(sampler, processed, positions, seqs, drafts, offsets, random))

    # Every kept token's logprobs in one call: the rows of each sequence's kept positions.
    rows = [r for i in range(len(seqs)) for r in range(offsets[i], offsets[i] + taken[i][0] + 1)]
    reported = sampler.report(
        logits.index_select(0, torch.tensor(rows, device=logits.device)),
        [t for i in range(len(seqs)) for t in taken[i][1]],
        [positions[r] for r in rows],
    )
    results, start = [], 0
    for i in range(len(seqs)):
        a = taken[i][0]
        end = start + a + 1
        kept = SamplerOutput(
            reported.token_ids[start:end],
            reported.logprobs[start:end],
            reported.top_logprobs[start:end],
            reported.ranks[start:end],
        )
        results.append(Verified(a, kept))
        start = end
    return results


def _verify_random(
    sampler: Sampler,
    processed: torch.Tensor,
    positions: list[MirroredSequence],
    seqs: list[MirroredSequence],
    drafts: list[list[int]],
    offsets: list[int],
    which: list[int],
) -> dict[int, tuple[int, list[int]]]:
    """Rejection sampling for the sampled (not greedy) sequences `which`."""
    device = processed.device
    rows = [r for i in which for r in range(offsets[i], offsets[i + 1])]
    row_positions = [positions[r] for r in rows]
    probs = sampler.probabilities(processed[torch.tensor(rows, device=device)], row_positions)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalised
    local = {r: k for k, r in enumerate(rows)}  # a global row -> its row of `probs`
    # p(proposal) at each checked position, and one uniform number per position (the last
    # position's goes unused: its row is only drawn from).
    proposal_rows = [local[offsets[i] + j] for i in which for j in range(len(drafts[i]))]
    proposed = [t for i in which for t in drafts[i]]
    p_proposed = probs[
        torch.tensor(proposal_rows, device=device), torch.tensor(proposed, device=device)
    ].tolist()
    uniform = sampler.uniform(row_positions, device).tolist()
    final_rows, residual_tokens = [], []
    accepted: dict[int, int] = {}
    k = 0  # index into proposal_rows / proposed / p_proposed
    for i in which:
        m, a = len(drafts[i]), 0
        u = uniform[local[offsets[i]] : local[offsets[i]] + m]
        while a < m and u[a] < p_proposed[k + a]:
            a += 1
        k += m
        accepted[i] = a
        final_rows.append(local[offsets[i] + a])
        residual_tokens.append(drafts[i][a] if a < m else -1)
    final = probs[torch.tensor(final_rows, device=device)].clone()
    for r, token in enumerate(residual_tokens):
        if token >= 0:  # rejected: draw from p without the proposal
            final[r, token] = 0.0
    last = [seqs[i] for i in which]
    drawn = sampler.draw(final, sampler.uniform(last, device)).tolist()
    return {i: (accepted[i], drafts[i][: accepted[i]] + [t]) for i, t in zip(which, drawn)}
