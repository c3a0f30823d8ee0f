"""Beam search for one request, step by step, with HF transformers' rules.

HF's (vectorised, transformers >= 4.45) beam search, restated for one request whose beams
are engine sequences:

- each step, every running beam's next-token log-probabilities are added to its running
  score, and the top `max(2, 1 + num_stop_tokens) * width` (beam, token) candidates taken;
- candidates that end (a stop token, or the length limit) and rank in the first `width`
  become finished hypotheses, scored `score / output_len ** length_penalty`; the `width`
  best hypotheses are kept;
- the best `width` candidates that do not end are the next running beams;
- the search stops when no candidate can continue, when `early_stopping=True` and `width`
  hypotheses are finished, or when the best running beam can no longer beat the worst
  finished hypothesis (judged at the current length, or at the maximum length for
  `early_stopping="never"` with a positive penalty).

Scores are float32 sums, as HF keeps them, so ties resolve alike. The search runs on the
scheduler's side and never sees logits: each beam's worker-side candidates (its best
`SamplingParams.num_beam_candidates` next tokens and their log-probabilities) hold every
candidate the step can rank among the best over all beams. numpy's float32 arithmetic is
IEEE's, as torch's is on the CPU, so the sums and ratios are HF's to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve.sampling_params import SamplingParams
from serve.sequence import Sequence
from serve.step import BeamCandidates


@dataclass
class Hypothesis:
    """A finished beam: its output tokens and scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    ended_by_stop_token: bool
    logprobs: list[float]  # each output token's
    top_logprobs: list[dict[int, float]] | None  # each position's, when the request asked


@dataclass
class Continuation:
    """A beam that runs on: `parent`'s tokens plus `token_id`."""

    parent: int  # index into the beams given to `BeamSearch.step`
    token_id: int
    score: float  # the new running score (cumulative logprob, float32)
    token_logprob: float


class BeamSearch:
    def __init__(
        self, params: SamplingParams, eos_token_ids: set[int], max_output_tokens: int
    ) -> None:
        self.width = params.best_of
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.stop_token_ids = params.beam_stop_token_ids(eos_token_ids)
        self.max_output_tokens = max_output_tokens  # max_tokens, capped by the context window
        self.num_candidates = params.num_beam_candidates(eos_token_ids)
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.is_done = False
        # HF's `is_early_stop_heuristic_unsatisfied`: once False, nothing more can finish.
        self._can_improve = True

    def step(
        self,
        running_beams: list[Sequence],  # their outputs all of the same length
        candidates: list[BeamCandidates],  # per beam, its best next tokens
    ) -> list[Continuation]:
        """Advance one token. Returns the next running beams, best first (empty when done).
        Reads the beams' outputs and running scores (`beam_score`); writes nothing."""
        out_len = running_beams[0].num_output_tokens + 1  # output length of every candidate
        # One row per (beam, token) candidate, ranked by total score, then as HF's top-k
        # over the flattened [beam, vocab] scores: lower beam, then lower token, first.
        beams = np.concatenate([np.full(len(c.token_ids), b) for b, c in enumerate(candidates)])
        tokens = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in candidates])
        logprobs = np.concatenate([np.asarray(c.logprobs, dtype=np.float32) for c in candidates])
        scores = np.asarray([seq.beam_score for seq in running_beams], dtype=np.float32)
        totals = logprobs + scores[beams]  # float32, as HF
        order = np.lexsort((tokens, beams, -totals))[: self.num_candidates]
        # Divided in float32, as HF does, so that rankings of near-equal scores agree.
        penalized = totals[order] / np.float32(out_len**self.length_penalty)
        at_length_limit = out_len >= self.max_output_tokens

        running: list[Continuation] = []
        new_finished: list[Hypothesis] = []
        num_ended = 0
        for rank, (row, score) in enumerate(zip(order.tolist(), penalized.tolist())):
            parent, token, total = int(beams[row]), int(tokens[row]), float(totals[row])
            is_stop = token in self.stop_token_ids
            if is_stop or at_length_limit:
                num_ended += 1
                if rank < self.width:
                    beam, top = running_beams[parent], candidates[parent].top_logprobs
                    new_finished.append(
                        Hypothesis(
                            [*beam.output_token_ids, token],
                            total,
                            score,
                            is_stop,
                            [*beam.output_logprobs, float(logprobs[row])],
                            None if top is None else [*beam.output_top_logprobs, top],
                        )
                    )
            elif len(running) < self.width:
                running.append(Continuation(parent, token, total, float(logprobs[row])))

        full = len(self.finished) == self.width
        if self._can_improve and not (full and self.early_stopping is True):
            # Stable sort, earlier hypotheses first: HF's top-k over [old, new] keeps order on ties.
            merged = sorted(self.finished + new_finished, key=lambda h: -h.score)
            self.finished = merged[: self.width]

        if running and self._can_improve and len(self.finished) == self.width:
            if self.early_stopping == "never" and self.length_penalty > 0:
                best_length = self.max_output_tokens
            else:
                best_length = out_len
            best_score = np.float32(running[0].score)
            best_possible = float(best_score / np.float32(best_length**self.length_penalty))
            self._can_improve = best_possible > self.finished[-1].score

        all_finished_and_eager = len(self.finished) == self.width and self.early_stopping is True
        if not self._can_improve or all_finished_and_eager or num_ended == len(order):
            self.is_done = True
            return []
        return running
